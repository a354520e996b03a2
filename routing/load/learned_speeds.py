"""A backend's speeds, learned online from what it served.

- TTFT as ``overhead_s + work_tokens / prefill_tokens_per_s`` and inter-token latency
  as ``itl_base_s + itl_per_stream_s * running``, each a :class:`DecayedLinearFit` of
  this replica's samples, blended with the other replicas' fits (weighted by their
  samples);
- the engine's own prefill rate (its prefill seconds and uncached prompt tokens,
  counted since it started): before the first request of ours it seeds the TTFT fit,
  and while none of ours teaches it, it keeps teaching it
  (:meth:`LearnedSpeeds.observe_engine_prefill`).

A backend's TTFT fit starts from the best prior there is, in this order: the operator's
hint, the engine's measured prefill rate, its pool peers' learned speed
(``routing.router.Router.refresh_speeds``), the built-in default; the first samples of
its own soon outweigh it (:class:`DecayedLinearFit`).
"""

from __future__ import annotations

import math

from routing.load.reports import RemoteLoad
from routing.load.speed_fit import DecayedLinearFit, EstimateError

DEFAULT_PREFILL_TOKENS_PER_S = 8000.0
DEFAULT_TTFT_OVERHEAD_S = 0.02
DEFAULT_ITL_S = 0.02
# The engine's prefill rate is taught to the TTFT fit as one sample of a prompt this long.
ENGINE_SAMPLE_TOKENS = 4096.0


class LearnedSpeeds:
    """The learned speeds of one backend: the base of its
    :class:`~routing.load.accounting.BackendLoad`, one object with its load because the
    policy reads both for every candidate of every request. Times in seconds, sizes
    in tokens.

    ``prefill_tokens_per_s`` and ``decode_tokens_per_s`` are the operator's hints
    (``None``: the defaults). The subclass keeps ``running`` (this replica's decode
    streams there) and ``remote`` (the other replicas' load and speeds).
    """

    running: int
    remote: RemoteLoad

    def __init__(self, *, prefill_tokens_per_s: float | None = None,
                 decode_tokens_per_s: float | None = None) -> None:
        rate = prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S
        # TTFT(work) = overhead + work / rate; x in tokens, y in seconds
        self.ttft_fit = DecayedLinearFit(DEFAULT_TTFT_OVERHEAD_S, 1.0 / rate, prior_x=4096.0,
                                         min_slope=1e-7, max_slope=1.0)
        itl = 1.0 / decode_tokens_per_s if decode_tokens_per_s else DEFAULT_ITL_S
        # ITL(n running) = base + per_stream * n
        self.itl_fit = DecayedLinearFit(itl, itl * 0.01, prior_x=32.0, min_slope=0.0, max_slope=1.0)
        # the spread of the routing policy's TTFT estimates here around the TTFTs that followed
        self.estimate_error = EstimateError(self.ttft_fit.decay)
        # where the TTFT prior came from: "hint", "engine" (its prefill rate), "peers" (its pool's) or "default"
        self.prior_from = "hint" if prefill_tokens_per_s is not None else "default"
        self.engine_prefill_tokens_per_s: float | None = None  # the engine's own rate, over its last scrape interval
        self._prefill_counters: tuple[float, float, float] | None = None  # (at, prefill s, tokens) last scraped
        self.peer_ttft: tuple[float, float] | None = None  # (overhead s, s per token) of its pool's peers

    # ---- the fits, blended with the other replicas' ---------------------------------

    def _blend(self, local: float, index: int, local_samples: int) -> float:
        # sample-weighted mean of this replica's fit and the other replicas' fits
        speeds = self.remote.speeds
        if not speeds:
            return local
        w = local_samples + 2.0
        total = w * local
        for sp in speeds:
            total += sp[4] * sp[index]
            w += sp[4]
        return total / w

    @property
    def prefill_tokens_per_s(self) -> float:
        """Learned prefill rate (tokens/s), blended with the other replicas' fits."""
        return self._blend(1.0 / self.ttft_fit.slope, 0, self.ttft_fit.samples)

    @property
    def ttft_overhead_s(self) -> float:
        return self._blend(self.ttft_fit.intercept, 1, self.ttft_fit.samples)

    def ttft_params(self) -> tuple[float, float]:
        """(:attr:`ttft_overhead_s` in seconds, :attr:`prefill_tokens_per_s`) in one call:
        the routing policy reads both for every candidate of every request."""
        f = self.ttft_fit
        if not self.remote.speeds:
            return f.intercept, 1.0 / f.slope
        return self._blend(f.intercept, 1, f.samples), self._blend(1.0 / f.slope, 0, f.samples)

    @property
    def itl_per_stream_s(self) -> float:
        return self._blend(self.itl_fit.slope, 3, self.itl_fit.samples)

    def itl_s(self, running: float | None = None) -> float:
        """Predicted inter-token latency with ``running`` streams (default: every
        replica's running streams now)."""
        n = self.running + self.remote.running if running is None else running  # BackendLoad.total_running
        return self._blend(self.itl_fit.intercept, 2, self.itl_fit.samples) + self.itl_per_stream_s * n

    def local_speed(self) -> tuple[float, float, float, float, int]:
        """This replica's own fit, as published to the shared store."""
        f, g = self.ttft_fit, self.itl_fit
        return (1.0 / f.slope, f.intercept, g.intercept, g.slope, f.samples + g.samples)

    # ---- what teaches them ----------------------------------------------------------

    def observe_ttft(self, work_tokens: float, ttft_s: float, now: float | None = None) -> None:
        """A request found ``work_tokens`` of prefill ahead of and including its own
        uncached tokens, and its first token came ``ttft_s`` after dispatch (observed at
        loop time ``now``)."""
        if ttft_s > 0 and work_tokens >= 0:
            self.ttft_fit.add(work_tokens, ttft_s, now)

    def observe_itl(self, running: float, itl_s: float, now: float | None = None) -> None:
        """A stream's mean inter-token latency while about ``running`` streams ran."""
        if itl_s > 0:
            self.itl_fit.add(running, itl_s, now)

    def age(self, now: float) -> None:
        """Forget the learned speeds by the time passed (see :class:`DecayedLinearFit`)."""
        self.ttft_fit.age(now)
        self.itl_fit.age(now)

    def stale_s(self, now: float) -> float:
        """Seconds since this backend's last TTFT sample (0 when it never had one: its
        prior is all there is to know)."""
        at = self.ttft_fit.last_sample_at
        return now - at if at is not None else 0.0

    def seed_from_peers(self, overhead_s: float, s_per_token: float) -> None:
        """Its pool peers' TTFT line (overhead in seconds, seconds per prefill token) as
        the prior of a backend without a hint: one with no sample of its own and no
        engine rate yet, or one whose prior was its engine's rate before its own samples
        came (that rate may be long gone; the prior is what it is forgotten toward)."""
        fit = self.ttft_fit
        prior_from = self.prior_from
        if prior_from == "hint":
            return
        if fit.samples:
            if prior_from != "engine":  # it has its own samples, and keeps the prior it started from
                return
        elif prior_from == "engine":  # cold, with its engine's rate: the better prior
            return
        if (fit.prior_intercept, fit.prior_slope) != (overhead_s, s_per_token):
            fit.set_prior(overhead_s, s_per_token)
        self.prior_from = "peers"

    # ---- the engine's prefill rate -------------------------------------------------

    def observe_engine_prefill(self, now: float, prefill_s_total: float, prefill_tokens_total: float) -> bool:
        """One scrape of the engine's own prefill counters at loop time ``now``: the
        seconds its requests spent in prefill and the uncached prompt tokens it
        prefilled, both counted since the engine started (vLLM's
        ``vllm:request_prefill_time_seconds`` sum and ``vllm:prompt_tokens_total`` minus
        ``vllm:prompt_tokens_cached_total``; llama.cpp's ``llamacpp:prompt_seconds_total``
        and ``llamacpp:prompt_tokens_total``).

        The rate over the interval since the previous scrape (since the engine started,
        on the first scrape or after a counter went back: a restart) is the engine's
        prefill rate in tokens/s. It is a lower bound of the rate the TTFT fit models:
        requests prefilled together each count the steps they share, and a request's
        prefill time is counted when its first token comes, so a queue that was slow
        reports its slowness late. A backend with no TTFT sample of its own takes it as
        its prior (unless hinted). Otherwise, when none of its own came since the
        previous scrape and the engine is faster than the fit says, it is one sample of
        :data:`ENGINE_SAMPLE_TOKENS` at the fit's overhead: a backend that gets none of
        this gateway's traffic and got faster is measured so, without waiting for a
        probe. It is not one of the backend's own samples: the silence probes of
        :mod:`routing.policies.estimated_ttft` still come, since a lower bound cannot
        say that a backend is no faster. An interval without prefill teaches nothing.
        Negative or non-finite counters are ignored.

        Returns whether a counter went back since the previous scrape: the engine
        restarted (and its KV cache is empty)."""
        if not (0.0 <= prefill_s_total < math.inf and 0.0 <= prefill_tokens_total < math.inf):
            return False
        prev = self._prefill_counters
        self._prefill_counters = (now, prefill_s_total, prefill_tokens_total)
        restarted = prev is not None and (prefill_s_total < prev[1] or prefill_tokens_total < prev[2])
        seconds, tokens = prefill_s_total, prefill_tokens_total
        if prev is not None and not restarted:
            seconds -= prev[1]
            tokens -= prev[2]
        if seconds > 0 and tokens > 0:
            self._learn_engine_prefill(tokens / seconds, prev)
        return restarted

    def _learn_engine_prefill(self, rate: float, prev: tuple[float, float, float] | None) -> None:
        """The engine's prefill ``rate`` (tokens/s) over the last scrape interval, which
        began at ``prev`` (see :meth:`observe_engine_prefill`)."""
        self.engine_prefill_tokens_per_s = rate
        fit = self.ttft_fit
        if not fit.samples and self.prior_from != "hint":
            fit.set_prior(fit.prior_intercept, 1.0 / rate)
            self.prior_from = "engine"
            return
        last = fit.last_sample_at
        if rate * fit.slope > 1.0 and (last is None or (prev is not None and last <= prev[0])):
            x = ENGINE_SAMPLE_TOKENS
            fit.add(x, fit.intercept + x / rate)  # without ``now``: not a sample of its own
