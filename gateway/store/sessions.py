"""Sessions' homes shared by every replica through Redis, and kept across restarts.

The decision core keeps each session's home in its
:class:`~routing.sessions.SessionTable` and makes no I/O; with ``state.url`` set, two
background loops (each a :class:`~gateway.store.background_sync.BackgroundSync`) share
it:

- :class:`SessionSync` publishes. The table wakes it at every placement (and it runs
  every ``staleness_s / 2`` anyway): in one pipelined round trip the sessions placed
  here since its last round (:attr:`SessionTable.changed`) are written to a hash
  (session id -> home, blocks, last block's hash, last seen, turns, the last turn's
  uncached tokens), with their
  last-seen time in a sorted set, and appended, as one entry, to a capped stream. Now
  and then, sessions not seen for ``sessions.ttl_s`` (the cap of every replica's
  learned expiry) leave the hash and the set.
- :class:`SessionFeed` learns. Before the replica reports ready it reads every session
  seen within ``sessions.ttl_s`` from the hash (so a gateway restart keeps the homes, as
  long as Redis keeps its data); then it waits on the stream (``XREAD BLOCK``) and gives
  the other replicas' placements to the table as they are written (the most recent
  placement of a session wins).

Why a wake-up and a blocking read rather than the routing state's fixed pace: an agent
loop's next turn may reach another replica a few milliseconds after this one answered
the last; the placement must be there first. Both happen off the request path. Every key
is under ``tg:{namespace}:``, one Redis Cluster slot. Times cross replicas as
wall-clock milliseconds and become the table's monotonic seconds on arrival. When
Redis fails, placements wait for the next round (up to
:data:`routing.sessions.CHANGED_MAX`) and routing goes on with what this replica knows.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.store.background_sync import BackgroundSync
from gateway.store.redis_client import redis_client, safe_url
from gateway.store.redis_client import replica_id as new_replica_id
from routing.core import SessionTable

log = logging.getLogger("gateway.store.sessions")

BATCH = 5000  # placements published, and stream entries read, per round at most
PRUNE_EVERY_S = 10.0  # how often expired sessions are removed from Redis


@dataclass(slots=True)
class SessionSyncStats:
    """Counters of the session loops, read by the metrics and the tests."""

    published: int = 0  # placements written
    learned: int = 0  # other replicas' placements taken (at start: the sessions loaded)
    pruned: int = 0  # expired sessions removed from Redis


def _wall_ms() -> int:
    return int(time.time() * 1000)


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else v


class _Keys:
    def __init__(self, namespace: str) -> None:
        tag = "{" + namespace + "}"
        self.homes = f"tg:{tag}:sessions"
        self.seen = f"tg:{tag}:sessions:seen"
        self.log = f"tg:{tag}:sessions:log"


class SessionFeed(BackgroundSync):
    """Loads the live sessions into ``table``, then learns the other replicas'
    placements from the stream as they come (see the module docstring). ``client``: a
    redis-py asyncio client; ``replica``: this replica's id (its own entries are
    skipped); ``block_ms``: how long one read waits for an entry (below the client's
    read timeout)."""

    def __init__(self, table: SessionTable, client: Any, keys: _Keys, replica: str, stats: SessionSyncStats, *,
                 block_ms: int, round_timeout_s: float) -> None:
        super().__init__("session-feed", interval_s=0.0, round_timeout_s=round_timeout_s, logger=log)
        self.table, self.client, self.keys, self.replica, self.stats = table, client, keys, replica, stats
        self.block_ms = block_ms
        self.cursor: str | None = None  # the last stream entry read; None: the table is not loaded yet
        self.loaded = asyncio.Event()

    def _learn(self, sid: str, rec: Any, now: float, wall_ms: int) -> None:
        if not (isinstance(rec, list) and len(rec) == 6 and isinstance(rec[0], str)
                and all(type(v) is int for v in rec[1:])):
            return
        home, blocks, tail, seen_ms, turns, queued = rec
        age_s = max(wall_ms - seen_ms, 0) / 1000.0
        if age_s > self.table.expiry_s:  # forgotten here already
            return
        if self.table.learn(sid, home, blocks, tail, now - age_s, turns, queued):
            self.stats.learned += 1

    async def _load(self) -> None:
        """Read the live sessions into the table, and start the cursor at the stream's
        end (entries written meanwhile are read again: the table keeps the latest)."""
        client, keys = self.client, self.keys
        last = await client.xrevrange(keys.log, count=1)
        cursor = _text(last[0][0]) if last else "0-0"
        wall_ms = _wall_ms()
        live = await client.zrangebyscore(keys.seen, wall_ms - int(self.table.ttl_s * 1000), "+inf")
        now = asyncio.get_running_loop().time()
        for i in range(0, len(live), BATCH):
            chunk = live[i:i + BATCH]
            for sid, raw in zip(chunk, await client.hmget(keys.homes, chunk), strict=True):
                if not raw:
                    continue
                try:
                    self._learn(_text(sid), orjson.loads(raw), now, wall_ms)
                except orjson.JSONDecodeError:
                    continue
        self.cursor = cursor

    async def sync_once(self) -> None:
        """Load (once), then wait up to ``block_ms`` for new entries and learn them.
        Raises the client's errors."""
        if self.cursor is None:
            await self._load()
            self.loaded.set()
        assert self.cursor is not None
        found = await self.client.xread({self.keys.log: self.cursor}, count=BATCH, block=self.block_ms)
        if not found:
            return
        now, wall_ms = asyncio.get_running_loop().time(), _wall_ms()
        for entry_id, entry in found[0][1]:
            self.cursor = _text(entry_id)
            f = {_text(k): v for k, v in entry.items()}
            if _text(f.get("r", b"")) == self.replica:
                continue
            try:
                theirs = orjson.loads(f.get("d", b"{}"))
            except orjson.JSONDecodeError:
                continue
            for sid, rec in theirs.items() if isinstance(theirs, dict) else ():
                self._learn(sid, rec, now, wall_ms)

    def down_message(self, e: BaseException) -> tuple[Any, ...]:
        msg = "sessions: reading the other replicas' placements failed (%s: %s); placing sessions on this replica's own"
        return (msg, type(e).__name__, e)

    def back_message(self) -> tuple[Any, ...]:
        return ("sessions: the other replicas' placements are read again",)


class SessionSync(BackgroundSync):
    """Shares ``table`` with the other replicas through the Redis at ``url`` (see the
    module docstring): publishes this replica's placements and runs the
    :class:`SessionFeed` that learns theirs. ``namespace``, ``timeout_s`` and
    ``cluster`` as :class:`~gateway.store.routing_state.RedisStore`'s; ``interval_s``:
    the pace of rounds between wake-ups; ``stream_maxlen``: placements kept in the
    stream."""

    def __init__(self, table: SessionTable, url: str, *, namespace: str = "turbo-gateway", interval_s: float = 0.025,
                 timeout_s: float = 0.25, cluster: bool = False, stream_maxlen: int = 20000,
                 replica_id: str | None = None) -> None:
        super().__init__("session-sync", interval_s=interval_s, round_timeout_s=timeout_s * 4, logger=log)
        self.table = table
        self.url = url
        self.cluster = cluster
        self.timeout_s = timeout_s
        self.maxlen = stream_maxlen
        self.replica = replica_id or new_replica_id()
        self.keys = _Keys(namespace)
        self.stats = SessionSyncStats()
        self.client: Any = None
        self.feed: SessionFeed | None = None
        self._next_prune = 0.0

    # ---- lifecycle -----------------------------------------------------------------

    async def start(self, initial_sync_timeout_s: float | None = None) -> None:
        """Connect, load the sessions (waiting at most ``initial_sync_timeout_s``,
        default ``max(1, 4 * timeout_s)`` seconds) and start both loops; from now on
        every placement wakes this one. Never raises: a Redis that does not answer
        leaves this replica on its own sessions."""
        if initial_sync_timeout_s is None:
            initial_sync_timeout_s = max(1.0, 4 * self.timeout_s)
        self.client = redis_client(self.url, timeout_s=self.timeout_s, cluster=self.cluster)
        # one read waits at most half the read timeout, so that an idle stream is no outage
        self.feed = SessionFeed(self.table, self.client, self.keys, self.replica, self.stats,
                                block_ms=max(int(self.timeout_s * 500), 1), round_timeout_s=self.timeout_s * 4)
        self.feed.start_loop()
        self.start_loop()
        self.table.notify = self.wake
        try:
            await asyncio.wait_for(self.feed.loaded.wait(), initial_sync_timeout_s)
        except TimeoutError:
            log.warning("sessions: not loaded from Redis within %.1f s; serving on this replica's sessions",
                        initial_sync_timeout_s)

    async def stop(self) -> None:
        self.table.notify = None
        await self.stop_loop(max(self.timeout_s, 1.0))
        if self.feed is not None:
            await self.feed.stop_loop(max(self.timeout_s, 1.0))
        if self.client is not None:
            try:
                async with asyncio.timeout(max(self.timeout_s, 1.0)):
                    await self.client.aclose()
            except Exception:  # noqa: BLE001 - best effort on shutdown
                pass

    # ---- rounds --------------------------------------------------------------------

    async def sync_once(self) -> None:
        """Publish the placements made since the last round, and prune now and then.
        Raises the client's errors."""
        client, table, keys = self.client, self.table, self.keys
        pending: dict[str, None] = {}
        while table.changed and len(pending) < BATCH:
            pending[table.changed.popleft()] = None
        now, wall_ms = asyncio.get_running_loop().time(), _wall_ms()
        placed: dict[str, list[Any]] = {}
        seen: dict[str, int] = {}
        for sid in pending:
            s = table.sessions.get(sid)
            if s is None:
                continue
            seen[sid] = wall_ms - int((now - s.seen) * 1000)
            placed[sid] = [s.home, s.blocks, s.tail, seen[sid], s.turns, s.queued]
        prune = now >= self._next_prune
        if not placed and not prune:
            return
        try:
            pipe = client.pipeline(transaction=False)
            if placed:
                pipe.hset(keys.homes, mapping={sid: orjson.dumps(rec) for sid, rec in placed.items()})
                pipe.zadd(keys.seen, seen)
                pipe.xadd(keys.log, {"r": self.replica, "d": orjson.dumps(placed)}, maxlen=self.maxlen,
                          approximate=True)
            if prune:
                pipe.zrangebyscore(keys.seen, "-inf", wall_ms - int(table.ttl_s * 1000), start=0, num=BATCH)
            res = await pipe.execute()
        except BaseException:
            table.changed.extendleft(reversed(pending))  # published next round
            raise
        self.stats.published += len(placed)
        if prune:
            self._next_prune = now + PRUNE_EVERY_S
            expired = res[-1]
            if expired:
                pipe = client.pipeline(transaction=False)
                pipe.hdel(keys.homes, *expired)
                pipe.zrem(keys.seen, *expired)
                await pipe.execute()
                self.stats.pruned += len(expired)

    # ---- outage and recovery (BackgroundSync) ---------------------------------------

    def down_message(self, e: BaseException) -> tuple[Any, ...]:
        return ("sessions: Redis at %s failed (%s: %s); placing sessions on this replica's view",
                safe_url(self.url), type(e).__name__, e)

    def back_message(self) -> tuple[Any, ...]:
        return ("sessions: Redis at %s is back; sessions shared again", safe_url(self.url))
