"""The batch priority class: admit a batch line only into capacity interactive traffic
leaves free.

A completion request carrying ``x-turbo-priority: batch`` (what the consumers send) from
a key granted it (``auth.keys[].batch_priority``; any caller without keys), or sent by the
in-process workers, passes :meth:`BatchGate.enter` after its key's limits and before it is
routed. It is
admitted when both hold, re-checked every few milliseconds for up to
``batch.admission_wait_s``:

1. **Interactive TTFT within the SLO**: the fleet's estimated time to first token of an
   interactive request of ``interactive_prompt_tokens`` tokens, i.e. the lowest
   :func:`routing.policies.estimated_ttft.estimate_ttft` over the healthy backends
   serving the model (queued prefill, decode interference of running streams and KV
   pressure, all replicas' load included) is at most ``ttft_slo_s``. Batch lines in
   flight raise that estimate like any load, so batch fills the fleet only up to the
   point where a newly arriving interactive request would still meet its SLO.
2. **Maximum share**: the estimated KV tokens (prompt + expected output) of this
   replica's batch lines in flight stay within ``max_share`` of the serving backends'
   KV-cache capacity divided by the number of live replicas. KV cache is the resource
   in-flight requests compete for (a count of requests would treat a 50-token and a
   50k-token line alike). One line is always admitted when no batch line is in flight
   here and the SLO holds, so a line larger than the share still runs.

Not admitted in time: HTTP 429 with code ``batch_deferred`` and ``Retry-After``; the
consumer waits and asks again without counting an attempt. The gate never delays an
interactive request: it has no lock and interactive requests never pass through it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from gateway.config import Batch
from gateway.errors import ClientError, retry_later_headers
from gateway.pipeline.director import PRIORITY_HEADER
from gateway.pipeline.openai_request import ParsedRequest
from routing.core import Match, RouteRequest, estimate_ttft

__all__ = ["PRIORITY_HEADER", "DEFERRED_CODE", "BatchGate", "GateCollector"]
DEFERRED_CODE = "batch_deferred"
_SERVING_ROLES = ("mixed", "decode")
_POLL_S = 0.01


class BatchGate:
    """Admission of batch lines on one gateway replica (see the module docstring)."""

    def __init__(self, state, cfg: Batch) -> None:
        self.state = state
        self.cfg = cfg
        self.in_flight = 0
        self.kv_in_flight = 0.0
        self.admitted_total = 0
        self.deferred_total = 0
        self._changed = asyncio.Event()

    def interactive_ttft_s(self, model: str, now: float) -> float | None:
        """The fleet's estimated TTFT for a new interactive request (``None``: no
        serving backend is up)."""
        cands = [b for b in self.state.fleet.by_model.get(model, ())
                 if b.healthy and b.cooldown_until <= now and b.spec.role in _SERVING_ROLES]
        if not cands:
            return None
        probe = RouteRequest(model, prompt_tokens=self.cfg.interactive_prompt_tokens, output_tokens=64)
        match = Match.of(probe, now)  # a new prompt: nothing cached
        return min(estimate_ttft(b, probe, match)[0] for b in cands)

    def kv_capacity(self, model: str) -> float:
        cands = [b for b in self.state.fleet.by_model.get(model, ()) if b.healthy and b.spec.role in _SERVING_ROLES]
        replicas = max(getattr(self.state.store.stats, "replicas", 1), 1)
        return sum(b.load.kv_capacity_tokens for b in cands) * self.cfg.max_share / replicas

    def admissible(self, model: str, kv_tokens: float, now: float) -> bool:
        ttft = self.interactive_ttft_s(model, now)
        if ttft is None:
            return True  # unknown model or nothing healthy: the proxy answers it (404 / 5xx) at once
        if ttft > self.cfg.ttft_slo_s:
            return False
        return self.in_flight == 0 or self.kv_in_flight + kv_tokens <= self.kv_capacity(model)

    async def enter(self, parsed: ParsedRequest) -> float:
        """Wait for admission of one line; returns its KV charge, to give back with
        :meth:`leave` once the line is done. Raises a 429 :class:`ClientError`
        (``batch_deferred``) when not admitted in time."""
        loop = asyncio.get_running_loop()
        est, _ = self.state.core.request(parsed.model, parsed.prompt_text, parsed.max_tokens, parsed.cache_salt)
        kv = float(est.prompt_tokens + est.output_tokens)
        deadline = loop.time() + self.cfg.admission_wait_s
        while not self.admissible(parsed.model, kv, loop.time()):
            left = deadline - loop.time()
            if left <= 0:
                self.deferred_total += 1
                raise ClientError(429, "The fleet has no spare capacity for batch work now; retry later.",
                                  code=DEFERRED_CODE, headers=retry_later_headers(1.0))
            self._changed.clear()
            try:
                async with asyncio.timeout(min(_POLL_S, left)):
                    await self._changed.wait()
            except TimeoutError:
                pass
        self.in_flight += 1
        self.kv_in_flight += kv
        self.admitted_total += 1
        return kv

    def leave(self, kv: float) -> None:
        """A line admitted by :meth:`enter` with charge ``kv`` is done."""
        self.in_flight -= 1
        self.kv_in_flight = max(self.kv_in_flight - kv, 0.0) if self.in_flight else 0.0
        self._changed.set()

    @asynccontextmanager
    async def admit(self, parsed: ParsedRequest) -> AsyncIterator[None]:
        """Hold one admission (:meth:`enter`, :meth:`leave`) for the duration of the block."""
        kv = await self.enter(parsed)
        try:
            yield
        finally:
            self.leave(kv)


class GateCollector:
    """Prometheus view of the gate (read at scrape time)."""

    def __init__(self, gate: BatchGate) -> None:
        self.gate = gate

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        g = self.gate
        yield GaugeMetricFamily("turbo_gateway_batch_in_flight", "Batch lines admitted and not finished",
                                value=g.in_flight)
        yield GaugeMetricFamily("turbo_gateway_batch_kv_tokens", "Estimated KV tokens of the batch lines in flight",
                                value=g.kv_in_flight)
        yield CounterMetricFamily("turbo_gateway_batch_admitted", "Batch lines admitted", value=g.admitted_total)
        yield CounterMetricFamily("turbo_gateway_batch_deferred", "Batch lines deferred (429 batch_deferred)",
                                  value=g.deferred_total)
