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

**Many replicas** (``state.url`` set): a key's counter is the service charged by every
replica, summed through Redis by :class:`gateway.tenancy.limits.LimiterSync` in its background
round trip (so within ``state.staleness_s``), plus this replica's own lift (a key starts
waiting in this replica's queue), kept as a local offset.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from dataclasses import dataclass

from gateway.config import Admission as AdmissionConfig
from gateway.errors import ClientError, retry_later_headers
from routing.core import Fleet

RECHECK_S = 0.05


class TokenCounters:
    """The per-key service counters of the Virtual Token Counter (see the module
    docstring), in weighted tokens. A key's counter is its shared service (``known``:
    every replica's charges as last read from the store, plus this replica's charges
    not yet acknowledged: ``pending``, ``publishing``) plus its local ``lift``."""

    def __init__(self) -> None:
        self.known: dict[str, float] = {}
        self.pending: dict[str, float] = {}  # charges not yet published (shared only)
        self.publishing: dict[str, float] = {}  # charges in the sync round trip
        self.lift: dict[str, float] = {}
        self.last_left: dict[int, float] = {}  # priority -> counter of the last key that stopped waiting
        self.shared = False  # a LimiterSync publishes pending charges

    def value(self, key: str) -> float:
        """``key``'s counter (weighted tokens; 0 for a key never served)."""
        return (self.known.get(key, 0.0) + self.pending.get(key, 0.0) + self.publishing.get(key, 0.0)
                + self.lift.get(key, 0.0))

    def charge(self, key: str, service: float) -> None:
        """Add ``service`` weighted tokens (negative: a refund) to ``key``'s counter."""
        if service:
            d = self.pending if self.shared else self.known
            d[key] = d.get(key, 0.0) + service

    def activate(self, key: str, priority: int, waiting: list[str]) -> None:
        """``key`` starts waiting in ``priority`` where the keys ``waiting`` wait: lift
        its counter to their lowest, or, none waiting, to the last one's to leave."""
        others = [self.value(k) for k in waiting if k != key]
        floor = min(others) if others else self.last_left.get(priority)
        if floor is None:
            return
        c = self.value(key)
        if c < floor:
            self.lift[key] = self.lift.get(key, 0.0) + floor - c

    def left(self, key: str, priority: int) -> None:
        """``key`` has nothing waiting in ``priority`` any more."""
        self.last_left[priority] = self.value(key)


class Charge:
    """One admitted request's service on its key's counter: its estimated prompt tokens
    from admission on; :meth:`settle` once when it ends."""

    __slots__ = ("counters", "key", "weight", "w_prompt", "w_output", "prompt_tokens", "settled")

    def __init__(self, counters: TokenCounters | None, key: str = "", weight: float = 1.0, w_prompt: float = 0.0,
                 w_output: float = 0.0, prompt_tokens: float = 0.0) -> None:
        self.counters, self.key, self.weight = counters, key, weight
        self.w_prompt, self.w_output, self.prompt_tokens = w_prompt, w_output, prompt_tokens
        self.settled = counters is None
        if counters is not None:
            counters.charge(key, w_prompt * prompt_tokens / weight)

    def settle(self, prompt_tokens: int | None, completion_tokens: int | None, dispatched: bool = True) -> None:
        """Correct the charge to the reported ``prompt_tokens`` (``None``: keep the
        estimate) and add ``completion_tokens``; refund it when the request was never
        ``dispatched`` to a backend. Idempotent."""
        if self.settled:
            return
        self.settled = True
        assert self.counters is not None
        if not dispatched:
            delta = -self.w_prompt * self.prompt_tokens
        else:
            delta = self.w_output * (completion_tokens or 0)
            if prompt_tokens is not None:
                delta += self.w_prompt * (prompt_tokens - self.prompt_tokens)
        self.counters.charge(self.key, delta / self.weight)


NO_CHARGE = Charge(None)


@dataclass(slots=True)
class _Waiter:
    model: str
    key: str
    prompt_tokens: float
    weight: float
    future: asyncio.Future[Charge]


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
        self.counters = TokenCounters()
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

    def admit_now(self, model: str, key: str, prompt_tokens: float = 0.0, weight: float = 1.0) -> Charge | None:
        """The :class:`Charge` of a request that may be routed at once (as :meth:`admit`
        gives it), or ``None`` when it would have to queue: the usual case answered
        without a coroutine."""
        if self.cfg.max_in_flight_per_backend is None:
            return NO_CHARGE
        now = asyncio.get_running_loop().time()
        # no routable backend at all: let the router answer (503 with its own Retry-After)
        if not self._routable(model, now) or (self.waiting == 0 and self.free(model, now) > 0):
            return self._charge(key, prompt_tokens, weight)
        return None

    async def admit(self, model: str, key: str, priority: int, prompt_tokens: float = 0.0,
                    weight: float = 1.0) -> Charge:
        """Return when the request may be routed, with its :class:`Charge` on ``key``'s
        counter (``prompt_tokens``: its estimated prompt; ``weight``: the key's share;
        :meth:`Charge.settle` it when the request ends). Raise :class:`ClientError` 503
        when the queue is full or its deadline passed."""
        charge = self.admit_now(model, key, prompt_tokens, weight)
        if charge is not None:
            return charge
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        if self.sizes.get(priority, 0) >= cfg.queue_size:
            self.rejected["queue_full"] += 1
            raise ClientError(503, "The fleet is saturated and the admission queue is full; retry later.",
                              code="fleet_saturated", headers=retry_later_headers(1.0))
        w = _Waiter(model, key, prompt_tokens, weight, loop.create_future())
        keys = self.queues.setdefault(priority, OrderedDict())
        q = keys.get(key)
        if q is None:  # the key starts waiting: no credit for the time it did not
            self.counters.activate(key, priority, list(keys))
            q = keys[key] = deque()
        q.append(w)
        self.sizes[priority] = self.sizes.get(priority, 0) + 1
        self._arm()
        try:
            await asyncio.wait_for(asyncio.shield(w.future), cfg.queue_timeout_s)
        except (TimeoutError, asyncio.CancelledError) as e:
            if w.future.done() and not w.future.cancelled():
                self.granted -= 1  # woken, but leaving: give the room to the next one
                w.future.result().settle(None, None, dispatched=False)
                self.pump()
            else:
                w.future.cancel()
                self._remove(priority, w)
            if isinstance(e, asyncio.CancelledError):
                raise
            self.rejected["queue_timeout"] += 1
            raise ClientError(503, f"The fleet is saturated; no backend had room within {cfg.queue_timeout_s} s.",
                              code="fleet_saturated", headers=retry_later_headers(1.0)) from None
        self.granted -= 1
        self.admitted_after_wait += 1
        return w.future.result()

    def _charge(self, key: str, prompt_tokens: float, weight: float) -> Charge:
        cfg = self.cfg
        if cfg.fairness != "tokens":
            return NO_CHARGE
        return Charge(self.counters, key, weight, cfg.prompt_token_weight, cfg.output_token_weight, prompt_tokens)

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
            self.counters.left(w.key, priority)
    def pump(self) -> None:
        """Wake as many waiters as there is room for: highest priority first; within a
        priority the key with the lowest counter (``fairness: tokens``) or the next key
        in turn (``round_robin``), each key's waiters in arrival order."""
        if not self.waiting:
            return
        if self.cfg.max_in_flight_per_backend is None:  # turned off by a reload: let everyone go
            for prio, keys in self.queues.items():
                for q in keys.values():
                    for w in q:
                        if not w.future.done():
                            w.future.set_result(NO_CHARGE)
                            self.granted += 1
                keys.clear()
                self.sizes[prio] = 0
            return
        now = asyncio.get_running_loop().time()
        by_tokens = self.cfg.fairness == "tokens"
        counters = self.counters
        free_by_model: dict[str, int] = {}
        for prio in sorted(self.queues, reverse=True):
            keys = self.queues[prio]
            while keys:
                pick: _Waiter | None = None
                lowest = 0.0
                for key, q in keys.items():  # in turn order: the first lowest wins a tie
                    if pick is not None and by_tokens and counters.value(key) >= lowest:
                        continue
                    for w in q:
                        f = free_by_model.get(w.model)
                        if f is None:
                            f = free_by_model[w.model] = self.free(w.model, now)
                        if f > 0:
                            pick = w
                            lowest = counters.value(key) if by_tokens else 0.0
                            break
                    if pick is not None and not by_tokens:
                        break
                if pick is None:
                    break
                if not pick.future.done():
                    pick.future.set_result(self._charge(pick.key, pick.prompt_tokens, pick.weight))
                    self.granted += 1
                    free_by_model = {}  # one more granted: every model's room shrinks
                q = keys[pick.key]
                q.remove(pick)
                self.sizes[prio] -= 1
                keys.move_to_end(pick.key)
                if not q:
                    del keys[pick.key]
                    counters.left(pick.key, prio)

    def _arm(self) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(RECHECK_S, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self.pump()
        if self.waiting:
            self._arm()
