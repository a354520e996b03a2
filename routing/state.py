"""Where the routing state lives: this process only, or shared through Redis.

The request path never waits for Redis (DESIGN.md section 4). Each replica decides on
its local view; a background task of the :class:`RedisStore`, every ``sync_interval_s``
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
   :class:`~routing.load.RemoteLoad` and ``BackendState.remote_in_flight``, their
   blocks enter the local :class:`~routing.prefix_index.PrefixIndex`.

A replica that starts late reads the capped stream back to the prefix index's TTL (older
blocks would be dropped on arrival) and the live snapshots before it reports ready. Every key lives under ``{namespace}`` in braces, a Redis Cluster hash
tag, so the multi-key commands above stay on one slot.

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
import os
import socket
import struct
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import orjson

from routing.fleet import Fleet
from routing.load import RemoteLoad
from routing.prefix_index import PrefixIndex

log = logging.getLogger("routing.state")


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


def parse_sentinel_url(url: str) -> tuple[list[tuple[str, int]], str, int, str | None]:
    """``redis+sentinel://[:password@]host:port[,host:port...]/service[/db]`` to
    (sentinel addresses, master service name, db, password). Raises ``ValueError``."""
    from urllib.parse import unquote

    rest = url.removeprefix("redis+sentinel://")
    password = None
    if "@" in rest:
        cred, rest = rest.rsplit("@", 1)
        password = unquote(cred.split(":", 1)[1] if ":" in cred else cred) or None
    hostpart, _, path = rest.partition("/")
    parts = [p for p in path.split("/") if p]
    if not hostpart or not parts:
        raise ValueError("expected redis+sentinel://host:port[,host:port...]/service[/db]")
    hosts = []
    for h in hostpart.split(","):
        host, _, port = h.rpartition(":")
        hosts.append((host or h, int(port) if host else 26379))
    return hosts, parts[0], int(parts[1]) if len(parts) > 1 else 0, password


def redis_client(url: str, *, timeout_s: float, cluster: bool = False) -> Any:
    """A redis-py asyncio client for a ``state.url``: standalone (``redis://``,
    ``rediss://``, ``unix://``), Cluster (``cluster=True``) or Sentinel
    (``redis+sentinel://``). Every call gets ``timeout_s`` to connect and to answer,
    and no automatic retry, so a frozen server costs one timeout, never a hang."""
    import redis.asyncio as aioredis

    kw: dict[str, Any] = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False,
                              health_check_interval=0)
    if url.startswith("redis+sentinel://"):
        from redis.asyncio.sentinel import Sentinel

        hosts, service, db, password = parse_sentinel_url(url)
        sentinel = Sentinel(hosts, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        return sentinel.master_for(service, db=db, password=password, **kw)
    if cluster:
        from redis.asyncio.cluster import RedisCluster

        return RedisCluster.from_url(url, **kw)
    return aioredis.from_url(url, **kw)


async def stop_sync(task: asyncio.Task | None, client: Any, key: str, timeout_s: float) -> None:
    """Stop a background sync loop (:func:`sync_forever`) and its Redis client: cancel
    ``task``, delete this replica's ``key`` (best effort), close ``client``. Each step
    waits at most ``max(timeout_s, 1)`` seconds, so a shutdown never hangs on Redis or
    on a task that missed its cancel; never raises but ``CancelledError`` (of the caller)."""
    bound = max(timeout_s, 1.0)
    if task is not None:
        task.cancel()
        await asyncio.wait({task}, timeout=bound)
        if not task.done():
            log.warning("a Redis sync loop did not stop within %.1f s of its cancel; leaving it", bound)
    if client is None:
        return
    for step in (lambda: client.delete(key), client.aclose):
        try:
            async with asyncio.timeout(bound):
                await step()
        except Exception:  # noqa: BLE001 - best effort on shutdown
            pass


def raise_if_cancel_swallowed() -> None:
    """Raise ``CancelledError`` when the current task was cancelled but the cancel never
    reached it. Background loops that call Redis check this once per round.

    Why a cancel can get lost: redis-py (the clients :func:`redis_client` makes, which
    set ``socket_timeout``) sends every command through ``asyncio.wait_for``, and
    Python 3.11's ``wait_for`` *returns the result* instead of raising when the caller
    is cancelled just as the wrapped send completes (cpython bpo-42130, gh-86296; 3.12 rebuilt
    ``wait_for`` on ``asyncio.timeout``). The task then carries an unanswered cancel
    request (``Task.cancelling()`` stays above 0) and a ``while True`` loop around the
    command runs on, so whoever awaits the cancelled task at shutdown waits forever.
    Call this outside any ``asyncio.timeout`` block (a timeout that is expiring also
    counts as a cancel request until it is handled)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError("cancelled (the cancel was swallowed by a library call)")


async def sync_forever(sync_once: Callable[[], Awaitable[None]], *, interval_s: float, timeout_s: float,
                       on_error: Callable[[Exception], None], on_ok: Callable[[], None]) -> None:
    """Run ``sync_once`` every ``interval_s`` seconds until cancelled, each call bounded
    by ``timeout_s``. A failure (any exception, the timeout included) goes to
    ``on_error`` and the next try comes after ``min(max(interval_s, 0.1), 1)`` s; a
    success goes to ``on_ok``. Never raises but ``CancelledError``, and stops on a
    cancel that a Redis call swallowed (:func:`raise_if_cancel_swallowed`). Uses
    ``asyncio.timeout``, not ``asyncio.wait_for``, whose Python 3.11 version can swallow
    a cancel and keep the loop alive at shutdown."""
    loop = asyncio.get_running_loop()
    while True:
        raise_if_cancel_swallowed()
        started = loop.time()
        try:
            async with asyncio.timeout(timeout_s):
                await sync_once()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any Redis failure degrades, never crashes
            raise_if_cancel_swallowed()
            on_error(e)
            await asyncio.sleep(min(max(interval_s, 0.1), 1.0))
            continue
        raise_if_cancel_swallowed()
        on_ok()
        await asyncio.sleep(max(interval_s - (loop.time() - started), 0.0))


class InProcessStore:
    """The default: the state is this process's memory and nothing is shared."""

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


class RedisStore:
    """Shares load and prefix placement with the other replicas through Redis.

    - ``url``: ``redis://``, ``rediss://`` (TLS) or ``unix://``, a password in the URL;
      or ``redis+sentinel://[:password@]h1:26379,h2:26379/service[/db]`` to find the
      master through Redis Sentinel.
    - ``namespace``: key prefix; keys are ``tg:{namespace}:...``.
    - ``staleness_s``: bound on how old the other replicas' view may be; the sync
      interval is half of it.
    - ``lease_s``: a replica's load counts this long after its last successful sync.
    - ``timeout_s``: every Redis call's connect and read timeout.
    - ``prefix_stream_maxlen``: dispatches kept in the shared prefix stream.
    - ``cluster``: connect with redis-py's ``RedisCluster`` (the hash tag keeps
      every key of a namespace on one slot).
    """

    kind = "redis"

    def __init__(self, fleet: Fleet, index: PrefixIndex, url: str, *, namespace: str = "turbo-gateway",
                 staleness_s: float = 0.05, lease_s: float = 2.0, timeout_s: float = 0.25,
                 prefix_stream_maxlen: int = 20000, cluster: bool = False, replica_id: str | None = None) -> None:
        self.fleet = fleet
        self.index = index
        self.url = url
        self.cluster = cluster
        self.replica = replica_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tag = "{" + namespace + "}"
        self.k_registry = f"tg:{tag}:replicas"
        self.k_stream = f"tg:{tag}:prefix"
        self.k_load_prefix = f"tg:{tag}:load:"
        self.interval_s = staleness_s / 2
        self.lease_ms = int(lease_s * 1000)
        self.lease_s = lease_s
        self.timeout_s = timeout_s
        self.maxlen = prefix_stream_maxlen
        self.stats = StoreStats(up=False)
        self.outbox: deque[tuple[str, tuple[int, ...]]] = deque(maxlen=100_000)
        self.cursor = "0-0"
        self._others: list[str] = []  # the other live replicas, as the last sync listed them
        self.client: Any = None
        self._task: asyncio.Task | None = None
        self._degraded_logged = False
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
        self._task = asyncio.create_task(self._run())
        try:
            await asyncio.wait_for(self._synced.wait(), initial_sync_timeout_s)
        except asyncio.TimeoutError:
            log.warning("state store: no initial sync with Redis within %.1f s; serving on local state",
                        initial_sync_timeout_s)

    async def stop(self) -> None:
        # deleting the snapshot lets the others stop counting this replica's load now
        await stop_sync(self._task, self.client, self.k_load_prefix + self.replica, self.timeout_s)

    # ---- sync ----------------------------------------------------------------------

    def _snapshot(self) -> bytes:
        out = {}
        for name, b in self.fleet.backends.items():
            ld = b.load
            out[name] = [ld.queued, ld.queued_prefill_tokens, ld.running, ld.decode_tokens_remaining, ld.kv_tokens,
                         b.in_flight, *ld.local_speed()]
        return orjson.dumps(out)

    def _count(self, op: str, n: int = 1) -> None:
        self.stats.calls[op] = self.stats.calls.get(op, 0) + n

    async def sync_once(self) -> None:
        """One publish-and-fold round trip. Raises the client's errors."""
        loop = asyncio.get_running_loop()
        client = self.client
        now_ms = int(time.time() * 1000)
        expires = now_ms + self.lease_ms
        pending = []
        while self.outbox and len(pending) < 2000:
            pending.append(self.outbox.popleft())
        try:
            pipe = client.pipeline(transaction=False)
            pipe.set(self.k_load_prefix + self.replica, self._snapshot(), px=self.lease_ms)
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
        self._fold_load(snaps)
        self.stats.replicas = 1 + sum(1 for s in snaps if s)
        now = loop.time()
        me = self.replica.encode()
        for entry_id, fields in entries:
            eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            self.cursor = eid
            rep = fields.get(b"r", fields.get("r"))
            if rep == me or rep == self.replica:  # this replica's own entry: nothing to learn
                continue
            f = {(k.decode() if isinstance(k, bytes) else k): v for k, v in fields.items()}
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

    def _fold_load(self, snaps: list) -> None:
        totals: dict[str, RemoteLoad] = {name: RemoteLoad() for name in self.fleet.backends}
        in_flight: dict[str, int] = dict.fromkeys(self.fleet.backends, 0)
        for raw in snaps:
            if not raw:
                continue
            try:
                snap = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue
            for name, v in snap.items():
                t = totals.get(name)
                if t is None or len(v) < 11:
                    continue
                t.queued += v[0]
                t.queued_prefill_tokens += v[1]
                t.running += v[2]
                t.decode_tokens_remaining += v[3]
                t.kv_tokens += v[4]
                in_flight[name] += int(v[5])
                t.speeds.append((v[6], v[7], v[8], v[9], int(v[10])))
        for name, b in self.fleet.backends.items():
            b.load.remote = totals[name]
            b.remote_in_flight = in_flight[name]

    def _drop_remote(self) -> None:
        for b in self.fleet.backends.values():
            b.load.remote = RemoteLoad()
            b.remote_in_flight = 0
        self.stats.replicas = 1

    def _on_sync_error(self, e: Exception) -> None:
        op = type(e).__name__
        self.stats.errors[op] = self.stats.errors.get(op, 0) + 1
        if self.stats.up or not self._degraded_logged:
            log.warning("state store degraded: Redis at %s failed (%s: %s); serving on local state",
                        self._safe_url(), op, e)
            self._degraded_logged = True
        self.stats.up = False
        last = self.stats.last_sync_at
        if last is None or asyncio.get_running_loop().time() - last > self.lease_s:
            self._drop_remote()

    def _on_sync_ok(self) -> None:
        if self._degraded_logged:
            log.warning("state store: Redis at %s is back; shared view resynchronized", self._safe_url())
            self._degraded_logged = False
        self.stats.up = True
        self._synced.set()

    async def _run(self) -> None:
        await sync_forever(self.sync_once, interval_s=self.interval_s, timeout_s=self.timeout_s * 4,
                           on_error=self._on_sync_error, on_ok=self._on_sync_ok)

    def _safe_url(self) -> str:
        # never log a password
        from urllib.parse import urlsplit
        u = urlsplit(self.url)
        host = u.hostname or u.path
        return f"{u.scheme}://{host}{':' + str(u.port) if u.port else ''}"
