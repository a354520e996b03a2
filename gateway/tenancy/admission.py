"""Admission control when the fleet is saturated.

A backend is *full* when its in-flight requests (every replica's, through the shared
store) reach ``admission.max_in_flight_per_backend``. A request whose model has no
routable backend with room waits in a bounded queue per priority (the key's
``priority``, higher first: fairness is within a priority). A waiter leaves the queue
when a backend has room (it is woken when a request ends, and re-checked every
``RECHECK_S`` for capacity freed elsewhere: other replicas, a backend back from its
breaker), or after ``queue_timeout_s`` with 503 and ``Retry-After``; a full queue
answers 503 at once. Off when ``max_in_flight_per_backend`` is unset.

Which key goes next within a priority (``admission.fairness``):

* ``tokens``: the Virtual Token Counter (VTC) of Sheng et al., "Fairness in Serving
  Large Language Models", OSDI 2024 (arXiv 2401.00588). Each key has a counter of the
  service it received, ``prompt_token_weight * prompt tokens + output_token_weight *
  output tokens`` divided by the key's ``weight``; the waiting key with the lowest
  counter goes next (ties: round robin order). A request is charged its estimated prompt
  tokens when it is admitted (from the queue or straight through), and when it ends the
  charge is corrected to the reported prompt tokens plus its output tokens (refunded
  when it never reached a backend). The paper charges output tokens as they are
  decoded; the gateway charges them at completion. When a key starts waiting (nothing
  of it was queued in its priority), its counter is lifted to the lowest counter of the
  keys already waiting there or, when none is, to the counter of the last key that
  stopped waiting there: idle time banks no credit, so a key back from a quiet hour
  shares the fleet instead of taking it. Defaults ``w_p = 1``, ``w_q = 2`` are the
  paper's artifact's (``input_price``, ``output_price`` of ``VTCReqQueue`` in
  github.com/Ying1123/VTC-artifact).
* ``round_robin``: one request per key in turn, whatever its size.

Within a key, ``admission.session_fairness: las`` orders the requests by the service
their session attained (least first, Autellix); ``off``: arrival order. The order
itself is :class:`gateway.tenancy.fair_queue.WaitQueue`'s (no clock, no event loop:
the offline agentic benchmark drives it too); this module waits on it.

**Many replicas** (``state.url`` set): a key's counter is the service charged by every
replica, summed through Redis by :class:`gateway.tenancy.limits.LimiterSync` in its background
round trip (so within ``state.staleness_s``), plus this replica's own lift (a key starts
waiting in this replica's queue), kept as a local offset.
"""

from __future__ import annotations

import asyncio

from gateway.config import Admission as AdmissionConfig
from gateway.errors import ClientError, retry_later_headers
from gateway.tenancy.fair_queue import NO_CHARGE, Charge, TokenCounters, Waiter, WaitQueue
from routing.core import Fleet

__all__ = ["NO_CHARGE", "RECHECK_S", "AdmissionControl", "Charge", "TokenCounters"]

RECHECK_S = 0.05


class AdmissionControl:
    def __init__(self, cfg: AdmissionConfig, fleet: Fleet) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.queue = WaitQueue(cfg)
        self.granted = 0  # woken waiters that have not routed yet
        self.rejected: dict[str, int] = {"queue_full": 0, "queue_timeout": 0}
        self.admitted_after_wait = 0
        self._timer: asyncio.TimerHandle | None = None

    @property
    def counters(self) -> TokenCounters:
        """The per-key service counters (``admission.fairness: tokens``)."""
        return self.queue.counters

    def configure(self, cfg: AdmissionConfig, fleet: Fleet) -> None:
        self.cfg, self.fleet = cfg, fleet
        self.queue.configure(cfg)
        self.pump()

    @property
    def waiting(self) -> int:
        return self.queue.waiting

    def free(self, model: str, now: float) -> int:
        cap = self.cfg.max_in_flight_per_backend
        assert cap is not None
        room = 0
        for b in self.fleet.by_model.get(model, ()):
            if b.draining or not b.healthy or b.ready_at(now) > now:
                continue
            room += max(cap - b.requests, 0)
        return room - self.granted

    def _routable(self, model: str, now: float) -> bool:
        return any(not b.draining and b.healthy and b.ready_at(now) <= now for b in self.fleet.by_model.get(model, ()))

    def admit_now(self, model: str, key: str, prompt_tokens: float = 0.0, weight: float = 1.0,
                  session: str | None = None) -> Charge | None:
        """The :class:`Charge` of a request that may be routed at once (as :meth:`admit`
        gives it), or ``None`` when it would have to queue: the usual case answered
        without a coroutine."""
        if self.cfg.max_in_flight_per_backend is None:
            return NO_CHARGE
        now = asyncio.get_running_loop().time()
        # no routable backend at all: let the router answer (503 with its own Retry-After)
        if not self._routable(model, now) or (self.waiting == 0 and self.free(model, now) > 0):
            return self.queue.charge(key, prompt_tokens, weight, session)
        return None

    async def admit(self, model: str, key: str, priority: int, prompt_tokens: float = 0.0,
                    weight: float = 1.0, session: str | None = None) -> Charge:
        """Return when the request may be routed, with its :class:`Charge` on ``key``'s
        counter (``prompt_tokens``: its estimated prompt; ``weight``: the key's share;
        ``session``: its scoped session id, or ``None``; :meth:`Charge.settle` it when
        the request ends). Raise :class:`ClientError` 503 when the queue is full or its
        deadline passed."""
        charge = self.admit_now(model, key, prompt_tokens, weight, session)
        if charge is not None:
            return charge
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        if self.queue.size(priority) >= cfg.queue_size:
            self.rejected["queue_full"] += 1
            raise ClientError(503, "The fleet is saturated and the admission queue is full; retry later.",
                              code="fleet_saturated", headers=retry_later_headers(1.0))
        future: asyncio.Future[Charge] = loop.create_future()
        w = Waiter(model, key, prompt_tokens, weight, session, loop.time(), future=future)
        self.queue.push(w, priority)
        self._arm()
        try:
            await asyncio.wait_for(asyncio.shield(future), cfg.queue_timeout_s)
        except (TimeoutError, asyncio.CancelledError) as e:
            if future.done() and not future.cancelled():
                self.granted -= 1  # woken, but leaving: give the room to the next one
                future.result().settle(None, None, dispatched=False)
                self.pump()
            else:
                future.cancel()
                self.queue.remove(w, priority)
            if isinstance(e, asyncio.CancelledError):
                raise
            self.rejected["queue_timeout"] += 1
            raise ClientError(503, f"The fleet is saturated; no backend had room within {cfg.queue_timeout_s} s.",
                              code="fleet_saturated", headers=retry_later_headers(1.0)) from None
        self.granted -= 1
        self.admitted_after_wait += 1
        return future.result()

    def pump(self) -> None:
        """Wake as many waiters as there is room for, in the queue's order
        (:meth:`WaitQueue.pop_next`: highest priority first, then the key's fair share,
        then the session's attained service)."""
        queue = self.queue
        if not queue.waiting:
            return
        loop = asyncio.get_running_loop()
        if self.cfg.max_in_flight_per_backend is None:  # turned off by a reload: let everyone go
            while (w := queue.pop_next(lambda _m: 1, 0.0)) is not None:
                if not w.future.done():
                    w.future.set_result(NO_CHARGE)
                    self.granted += 1
            return
        now = loop.time()
        while (w := queue.pop_next(lambda m: self.free(m, now), now)) is not None:
            if not w.future.done():
                w.future.set_result(queue.charge(w.key, w.prompt_tokens, w.weight, w.session))
                self.granted += 1

    def _arm(self) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(RECHECK_S, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self.pump()
        if self.waiting:
            self._arm()
