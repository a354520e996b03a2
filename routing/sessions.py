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

Expiry is learned from the gaps the sessions show (:class:`routing.gaps.GapEstimator`):
a session is kept while it may still come back (until all but about one in a hundred
of the sessions that come back are back), at most ``ttl_s``. A forgotten session is
remembered as a *ghost* (its id and its last turn's time) until ``ttl_s``: one that
comes back late still teaches its gap, so that the horizon is not shortened by its own
truncation. The table holds at most ``max_sessions``, the least recently seen leaving
first.

While a session waits between turns its KV cache is worth keeping. The table keeps,
per home backend, the blocks of its waiting sessions by how long they have waited (the
bins of :mod:`routing.gaps`, each session moved along as time passes: O(1) per session
and bin), which the router values in the eviction cost
(:meth:`routing.router.Router.kv_turnover`). A session whose home publishes KV events
is counted until its engine removes the last block of its context (``key_tail``,
:meth:`SessionTable.kv_gone`; vLLM evicts a request's blocks tail first).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from routing.gaps import EDGES, N_BINS, GapEstimator, bin_of

HOME, MOVED, NEW = "home", "moved", "new"  # where a session's turn went (Decision.placement)
PLACEMENTS = (HOME, MOVED, NEW)
# why a session's turn left its home: the home could not take it, held nothing of it,
# or held some but another backend's estimate was sooner (its queue cost more)
UNAVAILABLE, NO_HIT, CHEAPER = "unavailable", "no_hit", "cheaper"
MOVE_REASONS = (UNAVAILABLE, NO_HIT, CHEAPER)
AGED_EVERY_S = 1.0  # how often the router ages the table (routing.router.EXPIRE_EVERY_S)
CHANGED_MAX = 100_000  # placements waiting for a store; older ones are dropped (their sessions were placed again)


@dataclass(slots=True)
class Session:
    """One session's home: ``home`` (backend name), the ``blocks`` leading prompt
    blocks its last turn placed there and the chained hash of the last of them
    (``tail``, 0 when none), when it was last seen (``seen``, monotonic seconds of the
    table's clock), how many ``turns`` were placed, the last turn's uncached prompt
    tokens (``queued``: the prefill it queued at the home) and whether this replica
    placed it (``here``; else it was learned from another replica). ``bucket``: the bin
    of waiting time its blocks are counted in at the home (-1: not counted);
    ``key_tail``: the token-exact key of its last block at a home that publishes KV
    events (0: none)."""

    home: str
    blocks: int
    tail: int
    seen: float
    turns: int
    queued: int = 0
    here: bool = True
    bucket: int = -1
    key_tail: int = 0


@dataclass(slots=True)
class Waiting:
    """The blocks of the sessions waiting at one backend, per bin of waiting time
    (:data:`routing.gaps.EDGES`); ``value``: the router's valuation of them (a sum over
    the bins of their blocks times ``factors``, :mod:`routing.session_kv`), kept up to
    date as blocks come and go (:meth:`add`), a new tuple at every change (what is
    derived from it is kept while it is the same object); ``None``: to be computed
    again. ``turnover``: the router's turnover of the backend derived from ``value``,
    kept with what it was derived from (:meth:`routing.session_kv.SessionRouting.kv_turnover`)."""

    blocks: list[float] = field(default_factory=lambda: [0.0] * N_BINS)
    value: tuple[float, float] | None = None
    factors: tuple[Sequence[float], Sequence[float]] = ((), ())
    turnover: tuple[object, int, tuple[float, float], float, tuple[float, float]] | None = None

    def add(self, k: int, n: float) -> None:
        """``n`` blocks (negative: fewer) in bin ``k``; O(1)."""
        blocks = self.blocks
        if blocks[k] + n < 0:
            n = -blocks[k]
        blocks[k] += n
        v = self.value
        if v is not None:
            held, value = self.factors
            self.value = (v[0] + n * held[k], v[1] + n * value[k])

    def move(self, k: int, m: float, j: int, n: float) -> None:
        """``m`` blocks leave bin ``k`` and ``n`` blocks join bin ``j``: :meth:`add`
        ``(k, -m)`` then ``(j, n)`` (the same sums, in the same order), in one call
        (a session's turn, and its ageing, move its blocks); O(1)."""
        blocks = self.blocks
        m = -blocks[k] if blocks[k] < m else -m
        blocks[k] += m
        blocks[j] += n
        v = self.value
        if v is not None:
            held, value = self.factors
            v0 = v[0] + m * held[k]
            v1 = v[1] + m * value[k]
            self.value = (v0 + n * held[j], v1 + n * value[j])


class SessionTable:
    """Session id -> :class:`Session`, kept while the session may come back.

    - ``ttl_s``: a session not seen for this many seconds is forgotten, whatever the
      gaps (the cap of the learned horizon, :attr:`expiry_s`).
    - ``max_sessions``: at most this many sessions are held (the least recently seen
      one leaves first).
    - ``share``: record every placement's session id in :attr:`changed`, for a store
      that shares the table, and call :attr:`notify` (the store's wake-up, which must
      do no I/O) when set; off: nothing is recorded.

    ``placements`` counts the turns placed by kind (``home``, ``moved``, ``new``),
    ``moves`` the moved ones by reason (:data:`MOVE_REASONS`), ``hit_tokens`` per kind
    the prompt tokens and the engines' reported cached tokens of turns whose engine
    reported them. ``gaps`` learns the gaps; ``waiting`` holds, per backend, its
    waiting sessions' blocks, and ``waiting_sessions``, over all backends, how many
    of those sessions wait in each bin (the gaps not yet seen:
    :meth:`routing.gaps.GapEstimator.return_values`). Raises ``ValueError`` on a
    ``ttl_s`` or ``max_sessions`` that is not positive.
    """

    def __init__(self, ttl_s: float = 1800.0, max_sessions: int = 100_000, share: bool = False) -> None:
        if ttl_s <= 0 or max_sessions <= 0:
            raise ValueError("ttl_s and max_sessions must be positive")
        self.ttl_s = ttl_s
        self.expiry_s = ttl_s  # the learned horizon: a session not seen for this long is forgotten
        self.max_sessions = max_sessions
        self.share = share
        self.sessions: OrderedDict[str, Session] = OrderedDict()  # least recently seen first
        self.ghosts: OrderedDict[str, float] = OrderedDict()  # forgotten session -> its last turn's time
        self.changed: deque[str] = deque(maxlen=CHANGED_MAX)
        self.notify: Callable[[], None] | None = None  # called (no I/O) after a placement is recorded in changed
        self.placements: dict[str, int] = dict.fromkeys(PLACEMENTS, 0)
        self.moves: dict[str, int] = dict.fromkeys(MOVE_REASONS, 0)
        self.hit_tokens: dict[str, list[int]] = {k: [0, 0] for k in PLACEMENTS}  # kind -> [prompt, cached]
        self.gaps = GapEstimator()
        self.waiting: dict[str, Waiting] = {}
        self.waiting_sessions = [0.0] * N_BINS  # per bin of waiting time, the sessions counted there
        # per bin but the last, the counted sessions in it, oldest first, as (session, its seen then)
        self._fifos: list[deque[tuple[Session, float]]] = [deque() for _ in range(N_BINS - 1)]
        self._tails: dict[str, dict[int, Session]] = {}  # backend -> key_tail -> session

    def configure(self, ttl_s: float, max_sessions: int, share: bool) -> None:
        """New ``ttl_s``, ``max_sessions`` and ``share`` (see the class); the sessions
        held stay. Raises ``ValueError`` as the constructor does."""
        if ttl_s <= 0 or max_sessions <= 0:
            raise ValueError("ttl_s and max_sessions must be positive")
        self.ttl_s, self.max_sessions, self.share = ttl_s, max_sessions, share
        self.expiry_s = self.gaps.horizon(ttl_s)

    def __len__(self) -> int:
        return len(self.sessions)

    # ---- the waiting sessions' blocks ------------------------------------------------

    def _count(self, s: Session, bucket: int) -> None:
        """Count ``s``'s blocks at its home in ``bucket``."""
        if s.blocks <= 0:
            return
        w = self.waiting.get(s.home)
        if w is None:
            w = self.waiting[s.home] = Waiting()
        w.add(bucket, s.blocks)
        s.bucket = bucket
        self.waiting_sessions[bucket] += 1.0
        if bucket < N_BINS - 1:
            self._fifos[bucket].append((s, s.seen))

    def _uncount(self, s: Session) -> None:
        """Stop counting ``s``'s blocks (it came back, moved, left, or lost its KV)."""
        if s.bucket >= 0:
            w = self.waiting.get(s.home)
            if w is not None:
                w.add(s.bucket, -s.blocks)
            self.waiting_sessions[s.bucket] -= 1.0
            s.bucket = -1
        if s.key_tail:
            tails = self._tails.get(s.home)
            if tails is not None and tails.get(s.key_tail) is s:
                del tails[s.key_tail]
            s.key_tail = 0

    def _age(self, now: float) -> None:
        """Move the counted sessions to the bin of their waiting time at ``now``, in one
        step each, once they have waited :data:`AGED_EVERY_S` (the table is aged that
        often: finer bins would not be kept up to date). O(sessions moved). The bins
        are taken oldest first, so that each one's entries stay ordered by when they
        were seen (those moved in come from younger bins, after those already there)."""
        fifos = self._fifos
        counted = self.waiting_sessions
        last = N_BINS - 1
        for k in range(last - 1, -1, -1):
            fifo = fifos[k]
            cutoff = now - max(EDGES[k], AGED_EVERY_S)
            while fifo and fifo[0][1] <= cutoff:
                s, seen = fifo.popleft()
                if s.seen != seen or s.bucket != k:
                    continue  # placed again, or no longer counted, since
                to = bin_of(now - seen)
                self.waiting[s.home].move(k, s.blocks, to, s.blocks)
                counted[k] -= 1.0
                counted[to] += 1.0
                s.bucket = to
                if to < last:
                    fifos[to].append((s, seen))

    def kv_gone(self, backend: str, keys: Iterable[int]) -> None:
        """``backend``'s engine no longer holds the token-exact blocks ``keys`` (its KV
        events): a session waiting there whose last block is one of them is no longer
        counted (its context's tail is gone)."""
        tails = self._tails.get(backend)
        if not tails:
            return
        for k in keys:
            s = tails.pop(k, None)
            if s is not None:
                s.key_tail = 0
                self._uncount(s)

    # ---- sessions --------------------------------------------------------------------

    def _forget(self, session: str, s: Session, ghost: bool) -> None:
        """``session`` leaves the table; ``ghost``: it expired (remembered as a ghost,
        counted as ended)."""
        self._uncount(s)
        if ghost:
            self.gaps.ended()
            self.ghosts[session] = s.seen
            self.ghosts.move_to_end(session)
            if len(self.ghosts) > self.max_sessions:
                self.ghosts.popitem(last=False)

    def _add(self, session: str, s: Session) -> None:
        self.sessions[session] = s
        if len(self.sessions) > self.max_sessions:
            sid, old = self.sessions.popitem(last=False)
            self._forget(sid, old, False)

    def get(self, session: str, now: float) -> Session | None:
        """``session``'s entry at ``now``, or ``None`` (unknown, or expired)."""
        s = self.sessions.get(session)
        if s is None:
            return None
        if now - s.seen > self.expiry_s:
            del self.sessions[session]
            self._forget(session, s, True)
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

    def place(self, session: str, backend: str, hashes: Sequence[int], now: float, queued: int = 0,
              reason: str = CHEAPER, key_tail: int = 0) -> str:
        """Record that ``session``'s turn (prompt blocks ``hashes``, ``queued`` uncached
        prompt tokens) was dispatched to ``backend`` at ``now``: it is the session's
        home from now on. ``reason``: why it left its home, if it did
        (:data:`MOVE_REASONS`); ``key_tail``: the token-exact key of its last block
        when ``backend`` publishes KV events. Returns the kind of placement: ``home``
        (where it already was), ``moved`` or ``new``."""
        s = self.sessions.get(session)
        if s is not None and now - s.seen > self.expiry_s:
            s = self.get(session, now)  # expired: forgotten as a ghost (None)
        n = len(hashes)
        tail = hashes[-1] if n else 0
        if s is None:
            seen = self.ghosts.pop(session, None)
            if seen is not None:  # forgotten, yet back: it teaches its gap too
                self.gaps.came_back(now - seen)
            kind = NEW
            s = Session(backend, n, tail, now, 1, queued)
            self._add(session, s)
            self._count(s, 0)
        elif s.home == backend and s.bucket >= 0 and n > 0 and not s.key_tail:
            # the usual turn: back home, its blocks counted there; they move to the
            # first bin (what _uncount then _count do, in one step)
            self.gaps.observe(now - s.seen)
            self.waiting[backend].move(s.bucket, s.blocks, 0, n)
            counted = self.waiting_sessions
            counted[s.bucket] -= 1.0
            counted[0] += 1.0
            kind = HOME
            s.blocks, s.tail, s.seen, s.turns = n, tail, now, s.turns + 1
            s.queued, s.here = queued, True
            s.bucket = 0
            self._fifos[0].append((s, now))
            self.sessions.move_to_end(session)
        else:
            self.gaps.observe(now - s.seen)
            self._uncount(s)
            kind = HOME if s.home == backend else MOVED
            s.home, s.blocks, s.tail, s.seen, s.turns = backend, n, tail, now, s.turns + 1
            s.queued, s.here = queued, True
            self.sessions.move_to_end(session)
            if kind == MOVED:
                self.moves[reason] = self.moves.get(reason, 0) + 1
            self._count(s, 0)
        if key_tail and s.bucket >= 0:
            s.key_tail = key_tail
            self._tails.setdefault(backend, {})[key_tail] = s
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
        Returns whether it was taken. A turn that follows one known here teaches its gap."""
        s = self.sessions.get(session)
        if s is not None and s.seen >= seen:
            return False
        if s is None:
            gone = self.ghosts.pop(session, None)
            if gone is not None and seen > gone:
                self.gaps.came_back(seen - gone)
            s = Session(home, blocks, tail, seen, turns, queued, False)
            self._add(session, s)
        else:
            self.gaps.observe(seen - s.seen)
            self._uncount(s)
            s.home, s.blocks, s.tail, s.seen, s.turns = home, blocks, tail, seen, max(turns, s.turns)
            s.queued, s.here = queued, False
            self.sessions.move_to_end(session)
        self._count(s, 0)  # moved to its bin by the next ageing
        return True

    def expire(self, now: float) -> int:
        """Learn the horizon again, forget the sessions not seen within it at ``now``
        (and the ghosts older than ``ttl_s``) and move the waiting sessions' blocks to
        the bins of their waiting time; returns how many sessions were forgotten.
        O(expired + moved) (plus entries learned out of order, which :meth:`get` drops
        when they are asked for)."""
        self.expiry_s = self.gaps.horizon(self.ttl_s)
        cutoff = now - self.expiry_s
        gone = 0
        sessions = self.sessions
        while sessions:
            sid, first = next(iter(sessions.items()))
            if first.seen >= cutoff:
                break
            sessions.popitem(last=False)
            self._forget(sid, first, True)
            gone += 1
        ghosts, old = self.ghosts, now - self.ttl_s
        while ghosts and next(iter(ghosts.values())) < old:
            ghosts.popitem(last=False)
        self._age(now)
        return gone

    def backend_emptied(self, backend: str) -> None:
        """``backend`` lost its cache (it restarted, or left the fleet): the sessions
        at home there keep it as their home, holding nothing there any more."""
        for s in self.sessions.values():
            if s.home == backend:
                self._uncount(s)
                s.blocks, s.tail = 0, 0
        self.waiting.pop(backend, None)
