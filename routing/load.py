"""Token-level load of each backend, and the speeds learned from what it served.

For every backend the gateway keeps (DESIGN.md section 3):

- ``queued_prefill_tokens``: uncached prompt tokens of requests dispatched whose first
  token has not arrived;
- ``running``: streams past their first token, and ``decode_tokens_remaining``, the sum
  of their expected remaining output tokens;
- ``kv_tokens``: KV cache tokens its in-flight requests hold (prompt + output so far);
- learned speeds: TTFT as ``overhead_s + work_tokens / prefill_tokens_per_s`` and
  inter-token latency as ``itl_base_s + itl_per_stream_s * running``, both fitted by
  exponentially weighted least squares on observed requests and seeded by hints;
- drift corrections from the engine's own metrics (``vllm:num_requests_waiting``,
  ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc`` or SGLang's equivalents):
  load the gateway does not know about (other clients) is added, stale samples ignored;
- the engine's own prefill rate (its prefill seconds and uncached prompt tokens,
  counted since it started): before the first request of ours it seeds the TTFT fit,
  and while none of ours teaches it, it keeps teaching it
  (:meth:`BackendLoad.observe_engine_prefill`).

A backend's TTFT fit starts from the best prior there is, in this order: the operator's
hint, the engine's measured prefill rate, its pool peers' learned speed
(``routing.router.Router.refresh_speeds``), the built-in default; the first samples of
its own soon outweigh it (:class:`DecayedLinearFit`).

Every :class:`RequestLoad` moves through ``queued -> running -> done`` and its
:meth:`RequestLoad.finish` is idempotent, so each exit path releases exactly once.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

DEFAULT_PREFILL_TOKENS_PER_S = 8000.0
DEFAULT_TTFT_OVERHEAD_S = 0.02
DEFAULT_ITL_S = 0.02
DEFAULT_KV_CAPACITY_TOKENS = 200_000
# Seconds to make a LoRA adapter that is not at work on a backend ready there (read its
# weights into host memory, copy them into a GPU slot): an assumed order of magnitude for
# a rank-16 adapter of a 7-8B model read from local disk, overridden per backend by
# ``hints.lora_load_s``.
DEFAULT_LORA_LOAD_S = 0.1
# A sample this many times off the fit's prediction (either way) is a change of regime,
# not noise: the observations before it keep only SURPRISE_KEEP of their weight (a
# variable forgetting factor, after Fortescue, Kershenbaum and Ydstie, "Implementation
# of self-tuning regulators with variable forgetting factors", Automatica 17, 1981).
SURPRISE_RATIO = 5.0
FASTER_RATIO = 2.0  # after a silence, a sample this many times faster than predicted is a surprise too
UNSETTLED_RATIO = 1.5  # either way, while the fit is unsettled: the new regime takes over in a few samples
SURPRISE_KEEP = 0.1
SETTLED_RATIO = 1.03  # a sample this close to the prediction ends the surprise (``unsettled``)
WHOLE_SAMPLE_EVERY_S = 0.05  # whole answers teach a backend's speeds at most this often (they are many)
# While samples are few the prior is forgotten faster: per sample its weight is kept at
# lambda(t) = STARTUP_GROWTH * lambda(t-1) + (1 - STARTUP_GROWTH), from STARTUP_KEEP up to the
# fit's own decay (the growing forgetting factor of Ljung and Soderstrom, "Theory and
# Practice of Recursive Identification", MIT Press 1983, section 5.6).
STARTUP_KEEP = 0.5
STARTUP_GROWTH = 0.8
# The engine's prefill rate is taught to the TTFT fit as one sample of a prompt this long.
ENGINE_SAMPLE_TOKENS = 4096.0


class DecayedLinearFit:
    """Least-squares fit of ``y = intercept + slope * x`` with exponential forgetting,
    seeded by a prior line worth ``prior_weight`` samples at ``x = 0`` and
    ``x = prior_x``.

    Observations are forgotten per sample (each new one multiplies older weights, the
    prior's included, by ``decay``) and per unit of time (their weight halves every
    ``half_life_s`` seconds: :meth:`age`). The prior's weight never falls below
    ``prior_floor``, so a backend that gets no traffic drifts back to its prior instead
    of keeping a bad estimate forever, and a sample after a long silence outweighs the
    old ones. While samples are few the prior is forgotten faster (:data:`STARTUP_KEEP`).
    The prior can be replaced (:meth:`set_prior`). ``slope`` is kept within
    ``[min_slope, max_slope]`` and the intercept at >= 0, so a few noisy samples cannot
    produce a negative speed.
    """

    __slots__ = ("decay", "half_life_s", "prior", "wprior", "prior_intercept", "prior_slope", "prior_x", "prior_w",
                 "prior_floor", "s", "sx", "sy", "sxx", "sxy", "min_slope", "max_slope", "samples", "slope",
                 "intercept", "aged_at", "age_due", "last_sample_at", "unsettled", "prior_keep")

    def __init__(self, intercept: float, slope: float, prior_x: float, *, decay: float = 0.97,
                 prior_weight: float = 2.0, min_slope: float = 1e-9, max_slope: float = 1e3,
                 half_life_s: float = 30.0, prior_floor: float = 0.02) -> None:
        self.decay = decay
        self.half_life_s = half_life_s
        self.min_slope, self.max_slope = min_slope, max_slope
        self.prior_x, self.prior_w, self.prior_floor = prior_x, prior_weight, prior_floor
        self.s = self.sx = self.sy = self.sxx = self.sxy = 0.0  # the observations' weighted sums
        self.samples = 0
        self.aged_at: float | None = None  # the time the observations' weights refer to
        self.age_due = -math.inf  # the next ageing step is taken from this time on
        self.last_sample_at: float | None = None
        self.unsettled = False  # a sample came in much faster than predicted, and none has agreed since
        self.prior_keep = STARTUP_KEEP  # the prior's weight kept per sample while samples are few
        self.set_prior(intercept, slope)

    def set_prior(self, intercept: float, slope: float) -> None:
        """The line the fit starts from and returns to as observations age."""
        self.prior_intercept, self.prior_slope = intercept, slope
        x = self.prior_x
        # (s, sx, sy, sxx, sxy) of the points (0, b) and (x, b + m x), each of weight 1/2
        self.prior = (1.0, x / 2, (2 * intercept + slope * x) / 2, x * x / 2, x * (intercept + slope * x) / 2)
        self._weigh_prior()
        self._refit()

    def _weigh_prior(self) -> None:
        w = self.prior_w
        self.wprior = tuple([w * v for v in self.prior])

    def age(self, now: float, refit: bool = True) -> None:
        """Forget the observations by the time passed since they were last aged (loop
        time, seconds): their weight halves every ``half_life_s``. Steps shorter than
        a hundredth of the half-life wait to be taken together."""
        if now < self.age_due:
            return
        at = self.aged_at
        self.aged_at = now
        self.age_due = now + self.half_life_s * 0.01
        if at is None or not self.s:
            return
        f = 0.5 ** ((now - at) / self.half_life_s)
        self.s *= f
        self.sx *= f
        self.sy *= f
        self.sxx *= f
        self.sxy *= f
        if refit:
            self._refit()

    def add(self, x: float, y: float, now: float | None = None) -> None:
        """Add one observation (made at loop time ``now``, when given)."""
        silent = False  # the first sample after a third of a half-life without one (a probe's)
        if now is not None:
            if now >= self.age_due:
                self.age(now, refit=False)  # the refit below covers it
            last = self.last_sample_at
            silent = last is not None and now - last >= self.half_life_s / 3
            self.last_sample_at = now
        d = self.decay
        if self.samples:
            pred = self.intercept + self.slope * x
            unsettled = self.unsettled
            if y > (UNSETTLED_RATIO if unsettled else SURPRISE_RATIO) * pred:  # slower than thought: learn it at once
                d *= SURPRISE_KEEP
                self.unsettled = False
            elif y * (UNSETTLED_RATIO if unsettled else FASTER_RATIO if silent else SURPRISE_RATIO) < pred:
                # faster than thought: learn it, and measure again soon
                d *= SURPRISE_KEEP
                self.unsettled = True
            elif unsettled and y < SETTLED_RATIO * pred and y * SETTLED_RATIO > pred:
                self.unsettled = False
        if self.prior_w > self.prior_floor:
            keep = self.prior_keep
            if keep < d:
                self.prior_keep = STARTUP_GROWTH * keep + (1.0 - STARTUP_GROWTH)
            else:
                keep = d
            self.prior_w = max(self.prior_w * keep, self.prior_floor)
            self._weigh_prior()
        self.s = self.s * d + 1.0
        self.sx = self.sx * d + x
        self.sy = self.sy * d + y
        self.sxx = self.sxx * d + x * x
        self.sxy = self.sxy * d + x * y
        self.samples += 1
        self._refit()

    def _refit(self) -> None:
        # ``slope`` and ``intercept`` are plain attributes, refitted on each change:
        # routing reads them for every candidate of every request
        ps, psx, psy, psxx, psxy = self.wprior
        s, sx, sy, sxx, sxy = ps + self.s, psx + self.sx, psy + self.sy, psxx + self.sxx, psxy + self.sxy
        # comparisons rather than min() and max(): this runs for every sample
        scale = s * sxx
        var = scale - sx * sx
        if var <= 1e-12 * (scale if scale > 1e-30 else 1e-30):
            slope = self.min_slope
        else:
            slope = (s * sxy - sx * sy) / var
            if slope < self.min_slope:
                slope = self.min_slope
            elif slope > self.max_slope:
                slope = self.max_slope
        self.slope = slope
        intercept = (sy - slope * sx) / s
        self.intercept = intercept if intercept > 0.0 else 0.0

    def predict(self, x: float) -> float:
        return self.intercept + self.slope * x


@dataclass(slots=True)
class RemoteLoad:
    """The same backend's load as the *other* gateway replicas hold it (summed over
    replicas, from the shared store), with their learned speeds."""

    queued: float = 0.0
    queued_prefill_tokens: float = 0.0
    running: float = 0.0
    decode_tokens_remaining: float = 0.0
    kv_tokens: float = 0.0
    # (prefill tokens/s, TTFT overhead s, ITL base s, ITL per stream s, samples) per replica
    speeds: list[tuple[float, float, float, float, int]] = field(default_factory=list)


@dataclass(slots=True)
class EngineSample:
    """One scrape of a backend's own metrics at monotonic time ``at`` (seconds)."""

    at: float
    waiting: float
    running: float
    kv_usage: float | None  # fraction in [0, 1]


class BackendLoad:
    """Load and learned speed of one backend. Times in seconds, sizes in tokens."""

    def __init__(self, *, prefill_tokens_per_s: float | None = None, decode_tokens_per_s: float | None = None,
                 kv_capacity_tokens: int | None = None, metrics_max_age_s: float = 5.0,
                 lora_load_s: float | None = None) -> None:
        self.queued_prefill_tokens = 0.0
        self.lora_load_s = DEFAULT_LORA_LOAD_S if lora_load_s is None else lora_load_s
        self.queued = 0
        self.running = 0
        self.decode_tokens_remaining = 0.0
        self.kv_tokens = 0.0
        self.kv_capacity_tokens = float(kv_capacity_tokens or DEFAULT_KV_CAPACITY_TOKENS)
        self.kv_capacity_known = kv_capacity_tokens is not None
        rate = prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S
        # TTFT(work) = overhead + work / rate; x in tokens, y in seconds
        self.ttft_fit = DecayedLinearFit(DEFAULT_TTFT_OVERHEAD_S, 1.0 / rate, prior_x=4096.0,
                                         min_slope=1e-7, max_slope=1.0)
        itl = 1.0 / decode_tokens_per_s if decode_tokens_per_s else DEFAULT_ITL_S
        # ITL(n running) = base + per_stream * n
        self.itl_fit = DecayedLinearFit(itl, itl * 0.01, prior_x=32.0, min_slope=0.0, max_slope=1.0)
        self.engine: EngineSample | None = None
        self.metrics_max_age_s = metrics_max_age_s
        self.prefill_tokens_total = 0.0  # uncached prompt tokens ever dispatched here
        self.remote = RemoteLoad()
        # where the TTFT prior came from: "hint", "engine" (its prefill rate), "peers" (its pool's) or "default"
        self.prior_from = "hint" if prefill_tokens_per_s is not None else "default"
        self.engine_prefill_tokens_per_s: float | None = None  # the engine's own rate, over its last scrape interval
        self._prefill_counters: tuple[float, float, float] | None = None  # (at, prefill s, tokens) last scraped
        self.peer_ttft: tuple[float, float] | None = None  # (overhead s, s per token) of its pool's peers
        # streamed requests in the order dispatched, from the oldest still before its first
        # token (its wait bounds the prefill rate: routing.policies.estimated_ttft); those
        # behind it may have theirs already, and leave when they come to the front
        self.waiting: deque[RequestLoad] = deque()

    # ---- learned speeds ------------------------------------------------------------

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
        n = self.total_running if running is None else running
        return self._blend(self.itl_fit.intercept, 2, self.itl_fit.samples) + self.itl_per_stream_s * n

    def local_speed(self) -> tuple[float, float, float, float, int]:
        """This replica's own fit, as published to the shared store."""
        f, g = self.ttft_fit, self.itl_fit
        return (1.0 / f.slope, f.intercept, g.intercept, g.slope, f.samples + g.samples)

    # ---- totals over every replica ---------------------------------------------------

    @property
    def total_queued_prefill_tokens(self) -> float:
        return self.queued_prefill_tokens + self.remote.queued_prefill_tokens

    @property
    def total_running(self) -> float:
        return self.running + self.remote.running

    @property
    def total_decode_tokens_remaining(self) -> float:
        return self.decode_tokens_remaining + self.remote.decode_tokens_remaining

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

    # ---- engine metrics ------------------------------------------------------------

    def observe_engine(self, sample: EngineSample) -> None:
        self.engine = sample

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

    def fresh_engine(self, now: float) -> EngineSample | None:
        e = self.engine
        if e is None or now - e.at > self.metrics_max_age_s:
            return None
        return e

    def metrics_staleness(self, now: float) -> float:
        """How far past their useful age the engine's metrics are, as a fraction of
        ``metrics_max_age_s`` capped at 1 (0: fresh, or the engine exports none). An
        engine whose metrics stopped answering is uncertain, never idle: routing
        counts its estimate up to twice."""
        e = self.engine
        if e is None:
            return 0.0
        late = now - e.at - self.metrics_max_age_s
        return min(late / self.metrics_max_age_s, 1.0) if late > 0 else 0.0

    def external_queued_tokens(self, now: float) -> float:
        """Prefill tokens waiting on the engine that this gateway did not send (from
        the freshest engine sample, 0 when stale)."""
        e = self.fresh_engine(now)
        if e is None:
            return 0.0
        queued = self.queued + self.remote.queued
        extra = e.waiting - queued
        if extra <= 0:
            return 0.0
        per_request = self.total_queued_prefill_tokens / queued if queued else 1024.0
        return extra * per_request

    def external_running(self, now: float) -> float:
        e = self.fresh_engine(now)
        return max(e.running - self.total_running, 0.0) if e is not None else 0.0

    def kv_used_tokens(self, now: float) -> float:
        """KV tokens in use: the gateways' estimate or, when fresher and larger, the
        engine's own ``kv_cache_usage_perc * capacity``."""
        kv = self.kv_tokens + self.remote.kv_tokens
        e = self.fresh_engine(now)
        if e is not None and e.kv_usage is not None:
            return max(kv, e.kv_usage * self.kv_capacity_tokens)
        return kv

    # ---- LoRA adapters ---------------------------------------------------------------

    def adapter_wait_s(self, adapter: str, active: frozenset[str] | set[str], resident: bool,
                       max_lora: int | None, output_tokens: float) -> float:
        """Seconds a request for LoRA ``adapter`` waits here beyond its prefill queue.

        ``active``: the adapters at work here (in running or waiting requests);
        ``resident``: its weights are probably still in the backend's memory;
        ``max_lora``: the most adapters one batch may hold (``None``: unknown);
        ``output_tokens``: the request's expected output (tokens), the length of a
        typical request when none runs here yet. An active adapter costs nothing more.
        Another one costs ``lora_load_s`` unless resident (read its weights) and,
        when the batch's adapter slots are all taken, the wait for one to free: the
        mean remaining decode time of the running streams (vLLM's scheduler holds a
        request whose adapter finds no slot)."""
        if adapter in active:
            return 0.0
        wait = 0.0 if resident else self.lora_load_s
        if max_lora is not None and len(active) >= max_lora:
            running = self.total_running
            mean_remaining = self.total_decode_tokens_remaining / running if running else output_tokens
            wait += mean_remaining * self.itl_s()
        return wait

    # ---- accounting ----------------------------------------------------------------

    def admit(self, *, uncached_tokens: float, prompt_tokens: float, output_tokens: float, now: float,
              stream: bool = True) -> RequestLoad:
        """Account one dispatched request; returns its handle. A ``stream``'s first
        token will be seen, so its wait for it bounds the prefill rate
        (:attr:`waiting`); a whole answer's wait includes its decode."""
        r = RequestLoad(self, uncached_tokens, prompt_tokens, output_tokens, now, self.queued_prefill_tokens)
        if stream:
            self.waiting.append(r)
        self.queued += 1
        self.queued_prefill_tokens += uncached_tokens
        self.kv_tokens += prompt_tokens
        self.prefill_tokens_total += uncached_tokens
        return r

    def unwait(self) -> None:
        """A request left the ``queued`` stage: drop those at the front of
        :attr:`waiting` that no longer wait for their first token."""
        waiting = self.waiting
        while waiting and waiting[0].stage != "queued":
            waiting.popleft()


@dataclass(slots=True)
class RequestLoad:
    """One request's share of a backend's load.

    ``queued_ahead_tokens`` is the backend's queued prefill at dispatch, the work the
    request waited behind (used to learn the prefill rate from its TTFT).
    """

    backend: BackendLoad
    uncached_tokens: float
    prompt_tokens: float
    output_tokens: float
    dispatched_at: float
    queued_ahead_tokens: float
    stage: str = field(default="queued")  # queued | running | done
    first_token_at: float | None = None
    running_at_first_token: int = 0

    def first_token(self, now: float) -> None:
        """The first token arrived: prefill done, decode starts. Learns the TTFT fit."""
        if self.stage != "queued":
            return
        b = self.backend
        b.queued -= 1
        b.queued_prefill_tokens -= self.uncached_tokens
        self.stage = "running"
        waiting = b.waiting
        if waiting and waiting[0] is self:
            b.unwait()
        b.running += 1
        b.decode_tokens_remaining += self.output_tokens
        self.first_token_at = now
        self.running_at_first_token = b.running
        b.observe_ttft(self.queued_ahead_tokens + self.uncached_tokens, now - self.dispatched_at, now)

    def finish(self, now: float, completion_tokens: int | None = None, whole: bool = False) -> bool:
        """Release everything this request holds; returns ``True`` on the first call
        only. With ``completion_tokens`` (>1) the stream's mean ITL is learned. A
        ``whole`` (non-streamed) answer, whose first byte is its last, teaches both
        speeds from its total time: the TTFT is at most that time, less the decode of
        ``completion_tokens`` at the current ITL estimate, and the ITL is what the
        total leaves after the TTFT the fit predicts."""
        if self.stage == "done":
            return False
        b = self.backend
        if self.stage == "queued":
            b.queued -= 1
            b.queued_prefill_tokens -= self.uncached_tokens
            self.stage = "done"
            waiting = b.waiting
            if waiting and waiting[0] is self:
                b.unwait()
            if whole:
                self._learn_whole(now, completion_tokens or 1)
        else:
            b.running -= 1
            b.decode_tokens_remaining -= self.output_tokens
            if completion_tokens and completion_tokens > 1 and self.first_token_at is not None:
                b.observe_itl(self.running_at_first_token, (now - self.first_token_at) / (completion_tokens - 1))
        b.kv_tokens -= self.prompt_tokens
        self.stage = "done"
        if b.queued == 0:  # clear float dust so an idle backend reads exactly 0
            b.queued_prefill_tokens = 0.0
        if b.running == 0:
            b.decode_tokens_remaining = 0.0
        if b.queued == 0 and b.running == 0:
            b.kv_tokens = 0.0
        return True

    def _learn_whole(self, now: float, completion_tokens: int) -> None:
        b = self.backend
        last = b.ttft_fit.last_sample_at
        if last is not None and now - last < WHOLE_SAMPLE_EVERY_S:
            return
        total = now - self.dispatched_at
        work = self.queued_ahead_tokens + self.uncached_tokens
        decode = (completion_tokens - 1) * b.itl_s(b.running)
        b.observe_ttft(work, max(total - decode, 0.1 * total), now)
        if completion_tokens > 1:
            b.observe_itl(b.running, (total - b.ttft_fit.predict(work)) / (completion_tokens - 1), now)
