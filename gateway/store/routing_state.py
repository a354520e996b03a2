"""Where the routing state lives: this process only, or shared through Redis.

The request path never waits for Redis (DESIGN.md section 4). Each replica decides on
its local view; a background task of the :class:`RedisStore` (a
:class:`~gateway.store.background_sync.BackgroundSync`), every ``sync_interval_s``
(half the staleness bound, 25 ms by default), in one pipelined round trip:

1. publishes this replica's **load snapshot** per backend (queued prefill tokens,
   queued / running requests, expected remaining decode tokens, KV tokens, in-flight
   count, learned speeds) as one key with a lease (``PX lease_s``): a replica that
   stops renewing it (killed, partitioned) stops counting when the lease expires, so a
   crash leaks no load; snapshots are absolute, so a lost update is repaired by the
   next one;
2. appends the prefix blocks it dispatched since the last sync to a capped stream
   (``XADD ... MAXLEN ~ prefix_stream_maxlen``), one entry per sync carrying every
   dispatch since the previous one (so Redis commands per request fall as load rises);
3. reads every live replica's snapshot (a registry sorted set scored by lease expiry;
   the snapshots of the replicas the previous round listed come back in the same
   pipeline, and a second ``MGET`` follows only when a replica came or went) and the
   stream entries it has not seen (``XRANGE`` from its cursor),
   and folds them into the local view: other replicas' load becomes
   ``load.remote`` and ``remote_in_flight`` of each backend (:func:`routing.store.fold_remote_loads`),
   their blocks enter the local :class:`~routing.prefix_index.PrefixIndex`.

A replica that starts late reads the capped stream back to the prefix index's TTL (older
blocks would be dropped on arrival) and the live snapshots before it reports ready. Every
key lives under ``{namespace}`` in braces, a Redis Cluster hash tag, so the multi-key
commands above stay on one slot.

When Redis fails (down, refusing, frozen, slow: every call has ``timeout_s``), the
store is *degraded*: one log line, ``turbo_gateway_state_store_up`` 0, the remote view
is dropped once it is older than the lease (stale load is worse than none), requests
keep flowing on local state, and the loop keeps retrying; when Redis answers again the
replica republishes and re-reads the stream from its cursor (or from the start when
the stream was trimmed past it).

Token-exact prefix entries (backends with KV events) are not shared: every replica
subscribes to the engines' events itself (a ZMQ PUB socket serves any number of
subscribers), so each holds the same engine-confirmed view with no Redis round trip;
dispatches reach the other replicas as approximate blocks through the stream above.

Why a snapshot per replica and a stream, rather than per-request deltas: snapshots
make crash-safety a key expiry and need no reconciliation; the stream gives late
starters the recent prefix placement and every replica the blocks in arrival order.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.store.background_sync import BackgroundSync
from gateway.store.redis_client import close_client, redis_client, safe_url
from gateway.store.redis_client import replica_id as new_replica_id
from routing.core import (
    Fleet,
    PrefixIndex,
    clear_remote_loads,
    fold_remote_loads,
    load_snapshot,
)

log = logging.getLogger("gateway.store.routing_state")


@dataclass(slots=True)
class StoreStats:
    """Counters and gauges of a store, read by the gateway's metrics."""

    up: bool = True
    last_sync_at: float | None = None  # monotonic seconds of the last successful sync
    calls: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    replicas: int = 1
    remote_blocks_applied: int = 0
    published_dispatches: int = 0


class InProcessStore:
    """The default: the state is this process's memory and nothing is shared (the
    decision core gets no store; this one only answers the lifecycle and metrics)."""

    kind = "memory"

    def __init__(self) -> None:
        self.stats = StoreStats()

    def record_dispatch(self, backend: str, hashes: tuple[int, ...]) -> None:
        return None

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None


_PACK = struct.Struct("<q")


def _pack_hashes(hashes: tuple[int, ...]) -> bytes:
    # hashes are unsigned 64-bit; store them as signed little-endian int64
    return b"".join(_PACK.pack(h - (1 << 64) if h >= (1 << 63) else h) for h in hashes)


def _unpack_hashes(data: bytes) -> tuple[int, ...]:
    return tuple(h + (1 << 64) if h < 0 else h for (h,) in _PACK.iter_unpack(data))


def _decode_snapshots(raws: list) -> list[dict[str, list[float]]]:
    out = []
    for raw in raws:
        if not raw:
            continue
        try:
            out.append(orjson.loads(raw))
        except orjson.JSONDecodeError:
            continue
    return out


class RedisStore(BackgroundSync):
    """Shares load and prefix placement with the other replicas through Redis.

    - ``fleet``, ``index``: the decision core's (``core.fleet``, ``core.index``), into
      which the other replicas' view is folded; hand the store to the core with
      ``core.attach_store`` so that it learns this replica's dispatches.
    - ``url``: ``redis://``, ``rediss://`` (TLS) or ``unix://``, a password in the URL;
      or ``redis+sentinel://[:password@]h1:26379,h2:26379/service[/db]`` to find the
      master through Redis Sentinel.
    - ``namespace``: key prefix; keys are ``tg:{namespace}:...``.
    - ``staleness_s``: bound on how old the other replicas' view may be; the sync
      interval is half of it.
    - ``lease_s``: a replica's load counts this long after its last successful sync.
    - ``timeout_s``: every Redis call's connect and read timeout (a sync round gets four).
    - ``prefix_stream_maxlen``: dispatches kept in the shared prefix stream.
    - ``cluster``: connect with redis-py's ``RedisCluster`` (the hash tag keeps
      every key of a namespace on one slot).
    """

    kind = "redis"

    def __init__(self, fleet: Fleet, index: PrefixIndex, url: str, *, namespace: str = "turbo-gateway",
                 staleness_s: float = 0.05, lease_s: float = 2.0, timeout_s: float = 0.25,
                 prefix_stream_maxlen: int = 20000, cluster: bool = False, replica_id: str | None = None) -> None:
        super().__init__("state-store-sync", interval_s=staleness_s / 2, round_timeout_s=timeout_s * 4, logger=log)
        self.fleet = fleet
        self.index = index
        self.url = url
        self.cluster = cluster
        self.replica = replica_id or new_replica_id()
        tag = "{" + namespace + "}"
        self.k_registry = f"tg:{tag}:replicas"
        self.k_stream = f"tg:{tag}:prefix"
        self.k_load_prefix = f"tg:{tag}:load:"
        self.lease_ms = int(lease_s * 1000)
        self.lease_s = lease_s
        self.timeout_s = timeout_s
        self.maxlen = prefix_stream_maxlen
        self.stats = StoreStats(up=False)
        self.outbox: deque[tuple[str, tuple[int, ...]]] = deque(maxlen=100_000)
        self.cursor = "0-0"
        self._others: list[str] = []  # the other live replicas, as the last sync listed them
        self.client: Any = None
        self._synced = asyncio.Event()

    # ---- the hot path --------------------------------------------------------------

    def record_dispatch(self, backend: str, hashes: tuple[int, ...]) -> None:
        """Queue ``backend``'s new prefix blocks for publication (no I/O)."""
        if hashes:
            self.outbox.append((backend, hashes))

    # ---- lifecycle -----------------------------------------------------------------

    async def start(self, initial_sync_timeout_s: float | None = None) -> None:
        """Connect, load the shared view (waiting at most ``initial_sync_timeout_s``,
        default ``max(1, 4 * timeout_s)`` seconds) and start the sync loop. A Redis
        that does not answer leaves the store degraded; it never raises."""
        if initial_sync_timeout_s is None:
            initial_sync_timeout_s = max(1.0, 4 * self.timeout_s)
        self.client = redis_client(self.url, timeout_s=self.timeout_s, cluster=self.cluster)
        self.start_loop()
        try:
            await asyncio.wait_for(self._synced.wait(), initial_sync_timeout_s)
        except TimeoutError:
            log.warning("state store: no initial sync with Redis within %.1f s; serving on local state",
                        initial_sync_timeout_s)

    async def stop(self) -> None:
        await self.stop_loop(max(self.timeout_s, 1.0))
        # deleting the snapshot lets the others stop counting this replica's load now
        await close_client(self.client, self.k_load_prefix + self.replica, self.timeout_s)

    # ---- sync ----------------------------------------------------------------------

    def _count(self, op: str, n: int = 1) -> None:
        self.stats.calls[op] = self.stats.calls.get(op, 0) + n

    async def sync_once(self) -> None:
        """One publish-and-fold round trip. Raises the client's errors."""
        loop = asyncio.get_running_loop()
        client = self.client
        now_ms = int(time.time() * 1000)
        expires = now_ms + self.lease_ms
        pending: list[tuple[str, tuple[int, ...]]] = []
        while self.outbox and len(pending) < 2000:
            pending.append(self.outbox.popleft())
        try:
            pipe = client.pipeline(transaction=False)
            pipe.set(self.k_load_prefix + self.replica, orjson.dumps(load_snapshot(self.fleet)),
                     px=self.lease_ms)
            pipe.zadd(self.k_registry, {self.replica: expires})
            pipe.zremrangebyscore(self.k_registry, "-inf", now_ms)
            if pending:  # one entry per sync, however many dispatches it carries
                fields: dict[str, Any] = {"r": self.replica}
                for i, (backend, hashes) in enumerate(pending):
                    fields[f"b{i}"] = backend
                    fields[f"h{i}"] = _pack_hashes(hashes)
                pipe.xadd(self.k_stream, fields, maxlen=self.maxlen, approximate=True)
            pipe.zrangebyscore(self.k_registry, now_ms, "+inf")
            # a new replica starts at the oldest entry the prefix index would still keep
            # (stream ids are Redis's ms clock): older blocks would be dropped on arrival
            if self.cursor != "0-0":
                start = f"({self.cursor}"
            else:
                ttl_ms = self.index.ttl_s * 1000  # may be infinite (prefix_ttl_s: .inf): read it all
                start = f"{now_ms - int(ttl_ms)}" if ttl_ms < now_ms else "-"
            pipe.xrange(self.k_stream, min=start, count=5000)
            pipe.time()
            # the other replicas' loads, as last round listed them: one round trip per sync
            others = self._others
            if others:
                pipe.mget([self.k_load_prefix + r for r in others])
            self._count("pipeline")
            res = await pipe.execute()
        except BaseException:
            # nothing was acknowledged: keep the blocks for the next attempt
            self.outbox.extendleft(reversed(pending))
            raise
        self.stats.published_dispatches += len(pending)
        snaps = res.pop() if others else []
        replicas = [r.decode() if isinstance(r, bytes) else r for r in res[-3]]
        entries = res[-2]
        redis_now_ms = res[-1][0] * 1000 + res[-1][1] // 1000
        listed = sorted(r for r in replicas if r != self.replica)
        if listed != others:  # a replica came or went: read the loads of those listed now
            snaps = []
            if listed:
                snaps = await client.mget([self.k_load_prefix + r for r in listed])
                self._count("mget")
            self._others = listed
        fold_remote_loads(self.fleet, _decode_snapshots(snaps))
        self.stats.replicas = 1 + sum(1 for s in snaps if s)
        now = loop.time()
        me = self.replica.encode()
        for entry_id, entry in entries:
            eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            self.cursor = eid
            rep = entry.get(b"r", entry.get("r"))
            if rep == me or rep == self.replica:  # this replica's own entry: nothing to learn
                continue
            f = {(k.decode() if isinstance(k, bytes) else k): v for k, v in entry.items()}
            age_s = max(redis_now_ms - int(eid.split("-")[0]), 0) / 1000.0
            i = 0
            while f"b{i}" in f:
                backend = f[f"b{i}"]
                backend = backend.decode() if isinstance(backend, bytes) else backend
                if backend in self.fleet.backends:
                    hashes = _unpack_hashes(f[f"h{i}"])
                    self.index.record(backend, hashes, now - age_s)
                    self.stats.remote_blocks_applied += len(hashes)
                i += 1
        self.stats.last_sync_at = now

    # ---- outage and recovery (BackgroundSync) ---------------------------------------

    def down_message(self, e: BaseException) -> tuple[Any, ...]:
        return ("state store degraded: Redis at %s failed (%s: %s); serving on local state", safe_url(self.url),
                type(e).__name__, e)

    def back_message(self) -> tuple[Any, ...]:
        return ("state store: Redis at %s is back; shared view resynchronized", safe_url(self.url))

    def on_down(self, e: BaseException) -> None:
        op = type(e).__name__
        self.stats.errors[op] = self.stats.errors.get(op, 0) + 1
        self.stats.up = False
        last = self.stats.last_sync_at
        if last is None or asyncio.get_running_loop().time() - last > self.lease_s:
            clear_remote_loads(self.fleet)
            self.stats.replicas = 1

    def on_up(self) -> None:
        self.stats.up = True
        self._synced.set()
