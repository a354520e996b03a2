"""Token-level load accounting of each backend: queues, running streams, KV in use.

For every backend the gateway keeps (DESIGN.md section 3):

- ``queued_prefill_tokens``: uncached prompt tokens of requests dispatched whose first
  token has not arrived;
- ``running``: streams past their first token, and ``decode_tokens_remaining``, the sum
  of their expected remaining output tokens;
- ``kv_tokens``: KV cache tokens its in-flight requests hold (prompt + output so far);
- drift corrections from the engine's own metrics (``vllm:num_requests_waiting``,
  ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc`` or SGLang's equivalents):
  load the gateway does not know about (other clients) is added, stale samples ignored;
- its learned speeds (:class:`~routing.load.learned_speeds.LearnedSpeeds`, the base of
  :class:`BackendLoad`), which requests teach as they pass their first token and end.

Every :class:`RequestLoad` moves through ``queued -> running -> done`` and its
:meth:`RequestLoad.finish` is idempotent, so each exit path releases exactly once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from routing.load.learned_speeds import LearnedSpeeds
from routing.load.reports import EngineSample, RemoteLoad

DEFAULT_KV_CAPACITY_TOKENS = 200_000
# Seconds to make a LoRA adapter that is not at work on a backend ready there (read its
# weights into host memory, copy them into a GPU slot): an assumed order of magnitude for
# a rank-16 adapter of a 7-8B model read from local disk, overridden per backend by
# ``hints.lora_load_s``.
DEFAULT_LORA_LOAD_S = 0.1
WHOLE_SAMPLE_EVERY_S = 0.05  # whole answers teach a backend's speeds at most this often (they are many)


class BackendLoad(LearnedSpeeds):
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
        super().__init__(prefill_tokens_per_s=prefill_tokens_per_s, decode_tokens_per_s=decode_tokens_per_s)
        self.engine: EngineSample | None = None
        self.metrics_max_age_s = metrics_max_age_s
        self.prefill_tokens_total = 0.0  # uncached prompt tokens ever dispatched here
        self.remote = RemoteLoad()
        # streamed requests in the order dispatched, from the oldest still before its first
        # token (its wait bounds the prefill rate: routing.policies.estimated_ttft); those
        # behind it may have theirs already, and leave when they come to the front
        self.waiting: deque[RequestLoad] = deque()

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

    # ---- the engine's own metrics ---------------------------------------------------

    def observe_engine(self, sample: EngineSample) -> None:
        self.engine = sample

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
    request waited behind (used to learn the prefill rate from its TTFT);
    ``estimate_s``, the routing policy's TTFT estimate for it there (0.0: none), which
    its TTFT teaches the backend's :class:`~routing.load.speed_fit.EstimateError`.
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
    estimate_s: float = 0.0

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
        ttft = now - self.dispatched_at
        b.observe_ttft(self.queued_ahead_tokens + self.uncached_tokens, ttft, now)
        if self.estimate_s:
            b.estimate_error.add(self.estimate_s, ttft)

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
