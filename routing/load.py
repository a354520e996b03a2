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
  load the gateway does not know about (other clients) is added, stale samples ignored.

Every :class:`RequestLoad` moves through ``queued -> running -> done`` and its
:meth:`RequestLoad.finish` is idempotent, so each exit path releases exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_PREFILL_TOKENS_PER_S = 8000.0
DEFAULT_TTFT_OVERHEAD_S = 0.02
DEFAULT_ITL_S = 0.02
DEFAULT_KV_CAPACITY_TOKENS = 200_000


class DecayedLinearFit:
    """Least-squares fit of ``y = intercept + slope * x`` with exponential forgetting
    (each new sample multiplies older weights by ``decay``), seeded by a prior line
    worth ``prior_weight`` samples at ``x = 0`` and ``x = prior_x``.

    ``slope`` is kept within ``[min_slope, max_slope]`` and the intercept at >= 0, so a
    few noisy samples cannot produce a negative speed.
    """

    __slots__ = ("decay", "s", "sx", "sy", "sxx", "sxy", "min_slope", "max_slope", "samples", "slope", "intercept")

    def __init__(self, intercept: float, slope: float, prior_x: float, *, decay: float = 0.97,
                 prior_weight: float = 2.0, min_slope: float = 1e-9, max_slope: float = 1e3) -> None:
        self.decay = decay
        self.min_slope, self.max_slope = min_slope, max_slope
        self.s = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.samples = 0
        half = prior_weight / 2
        for x in (0.0, prior_x):
            self._add(x, intercept + slope * x, half)
        self._refit()

    def _add(self, x: float, y: float, w: float) -> None:
        self.s += w
        self.sx += w * x
        self.sy += w * y
        self.sxx += w * x * x
        self.sxy += w * x * y

    def add(self, x: float, y: float) -> None:
        """Add one observation."""
        d = self.decay
        self.s *= d
        self.sx *= d
        self.sy *= d
        self.sxx *= d
        self.sxy *= d
        self._add(x, y, 1.0)
        self.samples += 1
        self._refit()

    def _refit(self) -> None:
        # ``slope`` and ``intercept`` are plain attributes, refitted on each sample:
        # routing reads them for every candidate of every request
        var = self.s * self.sxx - self.sx * self.sx
        if var <= 1e-12 * max(self.s * self.sxx, 1e-30):
            slope = self.min_slope
        else:
            slope = min(max((self.s * self.sxy - self.sx * self.sy) / var, self.min_slope), self.max_slope)
        self.slope = slope
        self.intercept = max((self.sy - slope * self.sx) / self.s, 0.0)

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
                 kv_capacity_tokens: int | None = None, metrics_max_age_s: float = 5.0) -> None:
        self.queued_prefill_tokens = 0.0
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

    def observe_ttft(self, work_tokens: float, ttft_s: float) -> None:
        """A request found ``work_tokens`` of prefill ahead of and including its own
        uncached tokens, and its first token came ``ttft_s`` after dispatch."""
        if ttft_s > 0 and work_tokens >= 0:
            self.ttft_fit.add(work_tokens, ttft_s)

    def observe_itl(self, running: float, itl_s: float) -> None:
        """A stream's mean inter-token latency while about ``running`` streams ran."""
        if itl_s > 0:
            self.itl_fit.add(running, itl_s)

    # ---- engine metrics ------------------------------------------------------------

    def observe_engine(self, sample: EngineSample) -> None:
        self.engine = sample

    def fresh_engine(self, now: float) -> EngineSample | None:
        e = self.engine
        if e is None or now - e.at > self.metrics_max_age_s:
            return None
        return e

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

    # ---- accounting ----------------------------------------------------------------

    def admit(self, *, uncached_tokens: float, prompt_tokens: float, output_tokens: float, now: float) -> "RequestLoad":
        """Account one dispatched request; returns its handle."""
        r = RequestLoad(self, uncached_tokens, prompt_tokens, output_tokens, now, self.queued_prefill_tokens)
        self.queued += 1
        self.queued_prefill_tokens += uncached_tokens
        self.kv_tokens += prompt_tokens
        self.prefill_tokens_total += uncached_tokens
        return r


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
        b.running += 1
        b.decode_tokens_remaining += self.output_tokens
        self.stage = "running"
        self.first_token_at = now
        self.running_at_first_token = b.running
        b.observe_ttft(self.queued_ahead_tokens + self.uncached_tokens, now - self.dispatched_at)

    def finish(self, now: float, completion_tokens: int | None = None) -> bool:
        """Release everything this request holds; returns ``True`` on the first call
        only. With ``completion_tokens`` (>1) the stream's mean ITL is learned."""
        if self.stage == "done":
            return False
        b = self.backend
        if self.stage == "queued":
            b.queued -= 1
            b.queued_prefill_tokens -= self.uncached_tokens
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
