"""Sessions: where a conversation's KV cache lives, so that its next turn goes there.

Agentic traffic is sessions of many turns over a growing context, separated by tool
calls (DESIGN.md section 3, "Sessions"). The data plane names a request's session
(``RouteRequest.session``: an opaque id, already scoped by the caller's key); the
:class:`SessionTable` remembers, per session, its **home** (the backend its last turn
was dispatched to) and the prompt blocks that turn placed there. When the next turn
comes, the router (:meth:`routing.router.Router.match`) counts those blocks as held
by the home, on the evidence of the session itself: the next turn's prompt extends the
last one, which is checked by the chained hash of its last block
(:meth:`SessionTable.held_blocks`). The policy then weighs the home's hit against its
queue in the one unit of every decision (estimated time): the turn goes home unless
moving is cheaper, and where it goes becomes the home (:meth:`SessionTable.place`).

A session's turns are sequential: when its next turn comes, the last one is over. So
the load another replica's snapshot may still show at the home for that last turn (it
is shared at a bounded staleness, :mod:`routing.store`) is not counted against the home
(``Match.home_queued``: at most that turn's uncached prompt tokens and one stream).

The table is pure state: no clock of its own (every call takes the router's monotonic
``now``, seconds) and no I/O. A store in the gateway shares it with the other replicas
and keeps it across restarts: it takes the sessions placed here from
:attr:`SessionTable.changed` and gives the others' to :meth:`SessionTable.learn`
(:mod:`gateway.store.sessions`).

Expiry is a fixed time to live since a session's last turn (``ttl_s``); a session not
seen for that long is forgotten (its next turn is ``new``). The table holds at most
``max_sessions``, the least recently seen leaving first.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

HOME, MOVED, NEW = "home", "moved", "new"  # where a session's turn went (Decision.placement)
PLACEMENTS = (HOME, MOVED, NEW)
CHANGED_MAX = 100_000  # placements waiting for a store; older ones are dropped (their sessions were placed again)


@dataclass(slots=True)
class Session:
    """One session's home: ``home`` (backend name), the ``blocks`` leading prompt
    blocks its last turn placed there and the chained hash of the last of them
    (``tail``, 0 when none), when it was last seen (``seen``, monotonic seconds of the
    table's clock), how many ``turns`` were placed, the last turn's uncached prompt
    tokens (``queued``: the prefill it queued at the home) and whether this replica
    placed it (``here``; else it was learned from another replica)."""

    home: str
    blocks: int
    tail: int
    seen: float
    turns: int
    queued: int = 0
    here: bool = True


class SessionTable:
    """Session id -> :class:`Session`, with a time to live.

    - ``ttl_s``: a session not seen for this many seconds is forgotten.
    - ``max_sessions``: at most this many sessions are held (the least recently seen
      one leaves first).
    - ``share``: record every placement's session id in :attr:`changed`, for a store
      that shares the table, and call :attr:`notify` (the store's wake-up, which must
      do no I/O) when set; off: nothing is recorded.

    ``placements`` counts the turns placed by kind (``home``, ``moved``, ``new``).
    Raises ``ValueError`` on a ``ttl_s`` or ``max_sessions`` that is not positive.
    """

    def __init__(self, ttl_s: float = 1800.0, max_sessions: int = 100_000, share: bool = False) -> None:
        if ttl_s <= 0 or max_sessions <= 0:
            raise ValueError("ttl_s and max_sessions must be positive")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.share = share
        self.sessions: OrderedDict[str, Session] = OrderedDict()  # least recently seen first
        self.changed: deque[str] = deque(maxlen=CHANGED_MAX)
        self.notify: Callable[[], None] | None = None  # called (no I/O) after a placement is recorded in changed
        self.placements: dict[str, int] = dict.fromkeys(PLACEMENTS, 0)

    def configure(self, ttl_s: float, max_sessions: int, share: bool) -> None:
        """New ``ttl_s``, ``max_sessions`` and ``share`` (see the class); the sessions
        held stay. Raises ``ValueError`` as the constructor does."""
        if ttl_s <= 0 or max_sessions <= 0:
            raise ValueError("ttl_s and max_sessions must be positive")
        self.ttl_s, self.max_sessions, self.share = ttl_s, max_sessions, share

    def __len__(self) -> int:
        return len(self.sessions)

    def get(self, session: str, now: float) -> Session | None:
        """``session``'s entry at ``now``, or ``None`` (unknown, or expired)."""
        s = self.sessions.get(session)
        if s is None:
            return None
        if now - s.seen > self.ttl_s:
            del self.sessions[session]
            return None
        return s

    @staticmethod
    def held_blocks(s: Session, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt whose chained block hashes are
        ``hashes`` the home of ``s`` holds by the session's own evidence: all the
        blocks its last turn placed when this prompt starts with that turn's prompt
        (the hash of its last block matches: a chained hash covers every block before
        it), else none."""
        n = s.blocks
        if n == 0 or n > len(hashes) or hashes[n - 1] != s.tail:
            return 0
        return n

    def place(self, session: str, backend: str, hashes: Sequence[int], now: float, queued: int = 0) -> str:
        """Record that ``session``'s turn (prompt blocks ``hashes``, ``queued`` uncached
        prompt tokens) was dispatched to ``backend`` at ``now``: it is the session's
        home from now on. Returns the kind of placement: ``home`` (where it already
        was), ``moved`` or ``new``."""
        s = self.sessions.get(session)
        if s is not None and now - s.seen > self.ttl_s:
            s = None
        n = len(hashes)
        tail = hashes[-1] if n else 0
        if s is None:
            kind = NEW
            self.sessions[session] = Session(backend, n, tail, now, 1, queued)
            if len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        else:
            kind = HOME if s.home == backend else MOVED
            s.home, s.blocks, s.tail, s.seen, s.turns = backend, n, tail, now, s.turns + 1
            s.queued, s.here = queued, True
            self.sessions.move_to_end(session)
        self.placements[kind] += 1
        if self.share:
            self.changed.append(session)
            if self.notify is not None:
                self.notify()
        return kind

    def learn(self, session: str, home: str, blocks: int, tail: int, seen: float, turns: int,
              queued: int = 0) -> bool:
        """Another replica (or this one before a restart) placed ``session``: take its
        entry unless the one held here is as recent (``seen``, on this table's clock).
        Returns whether it was taken."""
        s = self.sessions.get(session)
        if s is not None and s.seen >= seen:
            return False
        if s is None:
            self.sessions[session] = Session(home, blocks, tail, seen, turns, queued, False)
            if len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        else:
            s.home, s.blocks, s.tail, s.seen, s.turns = home, blocks, tail, seen, max(turns, s.turns)
            s.queued, s.here = queued, False
            self.sessions.move_to_end(session)
        return True

    def expire(self, now: float) -> int:
        """Forget the sessions not seen for ``ttl_s`` at ``now``; returns how many.
        O(expired) (plus entries learned out of order, which :meth:`get` drops when
        they are asked for)."""
        cutoff = now - self.ttl_s
        gone = 0
        sessions = self.sessions
        while sessions:
            first = next(iter(sessions.values()))
            if first.seen >= cutoff:
                break
            sessions.popitem(last=False)
            gone += 1
        return gone

    def backend_emptied(self, backend: str) -> None:
        """``backend`` lost its cache (it restarted, or left the fleet): the sessions
        at home there keep it as their home, holding nothing there any more."""
        for s in self.sessions.values():
            if s.home == backend:
                s.blocks, s.tail = 0, 0
