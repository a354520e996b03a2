"""Admission control when the fleet is saturated.

A backend is *full* when its in-flight requests (every replica's, through the shared
store) reach ``admission.max_in_flight_per_backend``. A request whose model has no
routable backend with room waits in a bounded queue per priority (the key's
``priority``, higher first); within a priority the queue is served round robin across
keys, so one caller with a thousand queued requests does not starve another with one.
A waiter leaves the queue when a backend has room (it is woken when a request ends, and
re-checked every ``RECHECK_S`` for capacity freed elsewhere: other replicas, a backend
back from its breaker), or after ``queue_timeout_s`` with 503 and ``Retry-After``;
a full queue answers 503 at once. Off when ``max_in_flight_per_backend`` is unset.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from gateway.config import Admission as AdmissionConfig
from gateway.errors import ClientError, retry_later_headers
from routing.core import Fleet

RECHECK_S = 0.05


@dataclass(slots=True)
class _Waiter:
    model: str
    key: str
    future: asyncio.Future = field(default=None)  # type: ignore[assignment]


class AdmissionControl:
    def __init__(self, cfg: AdmissionConfig, fleet: Fleet) -> None:
        self.cfg = cfg
        self.fleet = fleet
        # priority -> key name -> its waiters in arrival order; key order = round robin
        self.queues: dict[int, OrderedDict[str, deque[_Waiter]]] = {}
        self.sizes: dict[int, int] = {}
        self.granted = 0  # woken waiters that have not routed yet
        self.rejected: dict[str, int] = {"queue_full": 0, "queue_timeout": 0}
        self.admitted_after_wait = 0
        self._timer: asyncio.TimerHandle | None = None

    def configure(self, cfg: AdmissionConfig, fleet: Fleet) -> None:
        self.cfg, self.fleet = cfg, fleet
        self.pump()

    @property
    def waiting(self) -> int:
        return sum(self.sizes.values())

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

    async def admit(self, model: str, key: str, priority: int) -> None:
        """Return when the request may be routed; raise :class:`ClientError` 503 when
        the queue is full or its deadline passed."""
        if self.cfg.max_in_flight_per_backend is None:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        # no routable backend at all: let the router answer (503 with its own Retry-After)
        if not self._routable(model, now) or (self.waiting == 0 and self.free(model, now) > 0):
            return
        if self.sizes.get(priority, 0) >= self.cfg.queue_size:
            self.rejected["queue_full"] += 1
            raise ClientError(503, "The fleet is saturated and the admission queue is full; retry later.",
                              code="fleet_saturated", headers=retry_later_headers(1.0))
        w = _Waiter(model, key, loop.create_future())
        self.queues.setdefault(priority, OrderedDict()).setdefault(key, deque()).append(w)
        self.sizes[priority] = self.sizes.get(priority, 0) + 1
        self._arm()
        try:
            await asyncio.wait_for(asyncio.shield(w.future), self.cfg.queue_timeout_s)
        except (TimeoutError, asyncio.CancelledError) as e:
            if w.future.done() and not w.future.cancelled():
                self.granted -= 1  # woken, but leaving: give the room to the next one
                self.pump()
            else:
                w.future.cancel()
                self._remove(priority, w)
            if isinstance(e, asyncio.CancelledError):
                raise
            self.rejected["queue_timeout"] += 1
            raise ClientError(503, f"The fleet is saturated; no backend had room within {self.cfg.queue_timeout_s} s.",
                              code="fleet_saturated", headers=retry_later_headers(1.0)) from None
        self.granted -= 1
        self.admitted_after_wait += 1

    def _remove(self, priority: int, w: _Waiter) -> None:
        keys = self.queues.get(priority)
        if not keys:
            return
        q = keys.get(w.key)
        if q is None:
            return
        try:
            q.remove(w)
        except ValueError:
            return
        self.sizes[priority] -= 1
        if not q:
            del keys[w.key]

    def pump(self) -> None:
        """Wake as many waiters as there is room for: highest priority first, round
        robin across keys within a priority."""
        if not self.waiting:
            return
        if self.cfg.max_in_flight_per_backend is None:  # turned off by a reload: let everyone go
            for prio, keys in self.queues.items():
                for q in keys.values():
                    for w in q:
                        if not w.future.done():
                            w.future.set_result(None)
                            self.granted += 1
                keys.clear()
                self.sizes[prio] = 0
            return
        now = asyncio.get_running_loop().time()
        free_by_model: dict[str, int] = {}
        for prio in sorted(self.queues, reverse=True):
            keys = self.queues[prio]
            progress = True
            while progress and keys:
                progress = False
                for key in list(keys):
                    q = keys[key]
                    pick = None
                    for w in q:
                        f = free_by_model.get(w.model)
                        if f is None:
                            f = free_by_model[w.model] = self.free(w.model, now)
                        if f > 0:
                            pick = w
                            break
                    if pick is None:
                        continue
                    q.remove(pick)
                    self.sizes[prio] -= 1
                    keys.move_to_end(key)
                    if not q:
                        del keys[key]
                    if not pick.future.done():
                        pick.future.set_result(None)
                        self.granted += 1
                        free_by_model = {}  # one more granted: every model's room shrinks
                    progress = True
                    break

    def _arm(self) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(RECHECK_S, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self.pump()
        if self.waiting:
            self._arm()
