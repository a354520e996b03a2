"""The order of the admission queue, with no clock and no event loop of its own.

:class:`WaitQueue` holds the requests waiting for room in the fleet and says which goes
next; :class:`gateway.tenancy.admission.AdmissionControl` wakes them on the event loop,
and the offline agentic benchmark (``loadtest/agentic_bench.py``) drives the same
queue in virtual time. The order, within the queue of one priority (higher first):

1. **Which key** (``admission.fairness``): ``tokens``, the waiting key with the lowest
   :class:`TokenCounters` counter (the Virtual Token Counter of Sheng et al., OSDI 2024;
   ties in round robin order), or ``round_robin``, the next key in turn.
2. **Which of the key's requests** (``admission.session_fairness``): ``las``, the one
   whose session has attained the least service (Autellix's program-level least
   attained service, Luo et al., "Autellix: An Efficient Serving Engine for LLM Agents
   as General Programs", arXiv 2502.13965: a program's next call is ordered by the
   service its earlier calls got, so short agent programs are not starved behind a
   long one), ties and requests without a session in arrival order; ``off``, arrival
   order. A request with no session is a program of one call: it has attained nothing.

A session's service (:class:`SessionService`) is what the engine spent on its turns,
in the counter's unit: ``prompt_token_weight * (prompt - cached prompt tokens) +
output_token_weight * output tokens`` as each turn's ``usage`` reports them (Autellix
counts engine time; uncached prefill plus decode is the gateway's measure of it). A
session id is already scoped by the caller's key (:mod:`gateway.pipeline.session`)
and sessions are only compared within one key's requests, so no key's traffic can
move another key's requests. Pure least-attained-service can starve a long session
while short ones keep coming, so a request that has waited half the queue's
``queue_timeout_s`` goes before its key's requests that have not, the oldest first:
least attained service reorders the first half of a wait, never the second.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.config import Admission as AdmissionConfig

SESSIONS_MAX = 100_000  # sessions whose service is kept (least recently charged first out)


class TokenCounters:
    """The per-key service counters of the Virtual Token Counter, in weighted tokens. A
    key's counter is its shared service (``known``: every replica's charges as last
    read from the store, plus this replica's charges not yet acknowledged: ``pending``,
    ``publishing``) plus its local ``lift``."""

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


class SessionService:
    """Per session, the service its turns attained (weighted tokens, see the module
    docstring); at most ``max_sessions`` are kept, the least recently charged leaving
    first (a forgotten session starts again from nothing)."""

    def __init__(self, max_sessions: int = SESSIONS_MAX) -> None:
        self.max_sessions = max_sessions
        self.service: OrderedDict[str, float] = OrderedDict()

    def value(self, session: str | None) -> float:
        """The service ``session`` attained (0 for none, or one never charged)."""
        return 0.0 if session is None else self.service.get(session, 0.0)

    def charge(self, session: str, service: float) -> None:
        """Add ``service`` weighted tokens to ``session``'s account."""
        s = self.service
        s[session] = s.pop(session, 0.0) + service
        if len(s) > self.max_sessions:
            s.popitem(last=False)


class Charge:
    """One admitted request's service on its key's counter (its estimated prompt tokens
    from admission on) and, once it ends, on its session's account; :meth:`settle` once."""

    __slots__ = ("counters", "key", "weight", "w_prompt", "w_output", "prompt_tokens", "settled", "sessions",
                 "session")

    def __init__(self, counters: TokenCounters | None, key: str = "", weight: float = 1.0, w_prompt: float = 0.0,
                 w_output: float = 0.0, prompt_tokens: float = 0.0, sessions: SessionService | None = None,
                 session: str | None = None) -> None:
        self.counters, self.key, self.weight = counters, key, weight
        self.w_prompt, self.w_output, self.prompt_tokens = w_prompt, w_output, prompt_tokens
        self.sessions: SessionService | None = sessions if session is not None else None
        self.session: str | None = session
        self.settled = counters is None and self.sessions is None
        if counters is not None:
            counters.charge(key, w_prompt * prompt_tokens / weight)

    def settle(self, prompt_tokens: int | None, completion_tokens: int | None, dispatched: bool = True,
               cached_tokens: int | None = None) -> None:
        """Correct the key's charge to the reported ``prompt_tokens`` (``None``: keep
        the estimate) and add ``completion_tokens``; refund it when the request was
        never ``dispatched`` to a backend. Charge the session (if any) the uncached
        prompt (``prompt_tokens - cached_tokens``) and the output. Idempotent."""
        if self.settled:
            return
        self.settled = True
        prompt = self.prompt_tokens if prompt_tokens is None else prompt_tokens
        if self.counters is not None:
            if not dispatched:
                delta = -self.w_prompt * self.prompt_tokens
            else:
                delta = self.w_output * (completion_tokens or 0) + self.w_prompt * (prompt - self.prompt_tokens)
            self.counters.charge(self.key, delta / self.weight)
        if self.sessions is not None and self.session is not None and dispatched:
            uncached = max(prompt - (cached_tokens or 0), 0)
            self.sessions.charge(self.session, self.w_prompt * uncached + self.w_output * (completion_tokens or 0))


NO_CHARGE = Charge(None)


@dataclass(slots=True)
class Waiter:
    """A request waiting for room: its ``model``, ``key`` (name), estimated
    ``prompt_tokens``, the key's ``weight``, its ``session`` (scoped id or ``None``),
    when it started waiting (``since``, the caller's clock in seconds) and its place in
    arrival order (``seq``, set by :meth:`WaitQueue.push`). ``future``: what the caller
    wakes it with (the data plane's asyncio future; unused by the queue)."""

    model: str
    key: str
    prompt_tokens: float
    weight: float
    session: str | None = None
    since: float = 0.0
    seq: int = 0
    future: Any = field(default=None, repr=False)


class WaitQueue:
    """The waiting requests per priority and key, and who goes next (module docstring).
    ``cfg``: the ``admission`` config (``fairness``, ``session_fairness``, the token
    weights, ``queue_timeout_s``); :meth:`configure` replaces it."""

    def __init__(self, cfg: AdmissionConfig) -> None:
        self.cfg = cfg
        # priority -> key name -> its waiters in arrival order; key order = round robin
        self.queues: dict[int, OrderedDict[str, list[Waiter]]] = {}
        self.sizes: dict[int, int] = {}
        self.counters = TokenCounters()
        self.sessions = SessionService()
        self._seq = 0

    def configure(self, cfg: AdmissionConfig) -> None:
        self.cfg = cfg

    @property
    def waiting(self) -> int:
        return sum(self.sizes.values())

    def size(self, priority: int) -> int:
        return self.sizes.get(priority, 0)

    def charge(self, key: str, prompt_tokens: float, weight: float, session: str | None = None) -> Charge:
        """The :class:`Charge` of a request of ``key`` admitted now (``prompt_tokens``:
        its estimate; ``session``: its session, charged when it settles under
        ``session_fairness: las``)."""
        cfg = self.cfg
        by_tokens = cfg.fairness == "tokens"
        sessions = self.sessions if cfg.session_fairness == "las" and session is not None else None
        if not by_tokens and sessions is None:
            return NO_CHARGE
        return Charge(self.counters if by_tokens else None, key, weight, cfg.prompt_token_weight,
                      cfg.output_token_weight, prompt_tokens, sessions, session)

    def push(self, w: Waiter, priority: int) -> None:
        """``w`` starts waiting in ``priority`` (its ``seq`` is set here)."""
        self._seq += 1
        w.seq = self._seq
        keys = self.queues.setdefault(priority, OrderedDict())
        q = keys.get(w.key)
        if q is None:  # the key starts waiting: no credit for the time it did not
            self.counters.activate(w.key, priority, list(keys))
            q = keys[w.key] = []
        q.append(w)
        self.sizes[priority] = self.sizes.get(priority, 0) + 1

    def remove(self, w: Waiter, priority: int) -> bool:
        """Take ``w`` out of the queue (it left); whether it was there."""
        keys = self.queues.get(priority)
        q = keys.get(w.key) if keys else None
        if q is None or w not in q:
            return False
        self._drop(keys, q, w, priority)  # type: ignore[arg-type]  # keys is set when q is
        return True

    def _drop(self, keys: OrderedDict[str, list[Waiter]], q: list[Waiter], w: Waiter, priority: int) -> None:
        q.remove(w)
        self.sizes[priority] -= 1
        if not q:
            del keys[w.key]
            self.counters.left(w.key, priority)

    def pop_next(self, room: Callable[[str], int], now: float) -> Waiter | None:
        """Take out and return the waiter that goes next among those whose model has
        room (``room(model)`` > 0: requests the fleet can take now), or ``None`` when
        none has. ``now``: the caller's clock (seconds), for the starvation bound."""
        rooms: dict[str, bool] = {}

        def fits(w: Waiter) -> bool:
            ok = rooms.get(w.model)
            if ok is None:
                ok = rooms[w.model] = room(w.model) > 0
            return ok

        by_tokens = self.cfg.fairness == "tokens"
        counters = self.counters
        for prio in sorted(self.queues, reverse=True):
            keys = self.queues[prio]
            pick: Waiter | None = None
            lowest = 0.0
            for key, q in keys.items():  # in turn order: the first lowest wins a tie
                if pick is not None and by_tokens and counters.value(key) >= lowest:
                    continue
                w = self._first(q, fits, now)
                if w is not None:
                    pick = w
                    lowest = counters.value(key) if by_tokens else 0.0
                    if not by_tokens:
                        break
            if pick is not None:
                self._drop(keys, keys[pick.key], pick, prio)
                if pick.key in keys:
                    keys.move_to_end(pick.key)
                return pick
        return None

    def _first(self, q: list[Waiter], fits: Callable[[Waiter], bool], now: float) -> Waiter | None:
        """The waiter of one key's ``q`` (arrival order) that goes first, among those that fit."""
        if self.cfg.session_fairness != "las":
            return next((w for w in q if fits(w)), None)
        starving_at = now - self.cfg.queue_timeout_s / 2
        sessions = self.sessions
        best: Waiter | None = None
        least = 0.0
        for w in q:  # arrival order: among equals the first stays
            if not fits(w):
                continue
            if w.since <= starving_at:
                return w  # the oldest starving one
            service = sessions.value(w.session)
            if best is None or service < least:
                best, least = w, service
        return best
