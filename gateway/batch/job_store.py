"""Batch job state and the line queue in Redis; file contents on disk.

Past 400 lines on purpose: the key layout, the Lua scripts and the store's methods that
run them are one design, explained below, and change together.

Why Redis Streams with a consumer group (rather than lists or sorted sets)
--------------------------------------------------------------------------
Every input line is one stream entry (``XADD``). Consumers on any machine read with
``XREADGROUP``: the group hands each entry to exactly one consumer and keeps it in that
consumer's *pending entries list* until ``XACK``. A consumer that dies (SIGKILL, machine
lost) leaves its entries pending; they are not lost. Live consumers refresh the idle
time of the entries they hold (``XCLAIM ... JUSTID``, a heartbeat every third of the
visibility timeout), so a line may run for minutes; entries whose idle time exceeds
``visibility_timeout_s`` belong to a consumer that stopped heartbeating and are taken
over by another with ``XAUTOCLAIM``. That is at-least-once delivery with crash
recovery built into the server, without a lease bookkeeping of our own (a ``BRPOPLPUSH``
list pattern needs a reaper that scans processing lists; a sorted-set queue needs
polling and a claim protocol).

At-least-once becomes exactly-once in the output: a line's result is written with
``HSETNX`` on the batch's results hash, keyed by the line's index (custom_ids are
unique in a valid file), inside one Lua script that also acknowledges the entry, counts
the result (``request_counts`` stay exact: the counter moves only when ``HSETNX``
wrote) and moves the batch to ``finalizing`` when every line has a result. A line run
twice (a reclaimed entry whose first consumer was slow, not dead) writes once. The
output and error files are assembled from that hash at the end, ordered by line.

A consumer that stops (SIGTERM, gateway shutdown) hands back the entries it could not
finish instead of leaving them to the visibility timeout: one script moves each entry
that is still pending *with that consumer* to a delivery time at the epoch, so the next
``XAUTOCLAIM`` of any consumer takes it (``BatchStore.hand_back``). The entry keeps its
id and its place in the queue. An entry another consumer already reclaimed, or whose
result was recorded (``_RECORD`` acknowledged it), is left alone, and a line whose
request was cut mid-way has no result to leave behind: its output is written only by
``_RECORD``, whole, and at most once, whoever runs the line again.

Keys (all under the ``{namespace}`` hash tag, so the scripts stay on one Cluster slot)::

    tg:{ns}:batch:queue            stream of lines, group ``consumers``
    tg:{ns}:batch:files            hash file id -> file record (JSON: the file object + ``owner``)
    tg:{ns}:batch:files:z          zset file id by creation
    tg:{ns}:batch:b:<batch id>     hash: the batch object's fields and counters
    tg:{ns}:batch:batches:z        zset batch id by creation
    tg:{ns}:batch:res:<batch id>   hash line index -> "o"|"e" + output/error line
    tg:{ns}:batch:fly:<batch id>   zset line index -> lease deadline (lines in flight)
    tg:{ns}:batch:active           set of batches not yet in a final state
    tg:{ns}:batch:lock:<batch id>  who validates / finalizes a batch now
    tg:{ns}:batch:files:o:<owner>  zset file id by creation, one owner's (its listing)
    tg:{ns}:batch:batches:o:<owner> zset batch id by creation, one owner's (its listing)
    tg:{ns}:batch:active:o:<owner> set of one owner's batches not yet in a final state
    tg:{ns}:batch:quota:<owner>    hash ``files``, ``bytes``: what one owner's files hold
    tg:{ns}:batch:files:exp        zset file id by ``expires_at`` (the files that expire)
    tg:{ns}:batch:idx              set once the per-owner keys cover every record

Quotas (``batch.max_files_per_key``, ``max_bytes_per_key``, ``max_active_batches_per_key``)
are checked and charged in the same script that records a file or a batch, so concurrent
uploads of one key on several replicas cannot pass them together. A key's listings read its
own index, never every record.

Files (uploads, output and error files) live in ``files_dir`` as ``<file id>``, written
to a temporary name then renamed, so a reader never sees half a file.

Owners: a batch hash and a file record hold ``owner``, the name of the client key that
created it (``anonymous`` without keys); a batch's output and error files get the
batch's. Records written before owners were kept have none (``None``); an output or
error file of that time takes its batch's (:meth:`BatchStore.get_file`). Who may see
what is decided in :mod:`gateway.batch.api_common` (:func:`~gateway.batch.api_common.visible`).
"""

from __future__ import annotations

import math
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any, overload

import orjson

GROUP = "consumers"
FINAL = frozenset({"completed", "failed", "expired", "cancelled"})
RUNNING = frozenset({"validating", "in_progress", "finalizing", "cancelling"})
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings")
# the id the manager gives a batch's output / error file: ``file-<batch hex>out|err``
_RESULT_FILE = re.compile(r"^file-([0-9a-f]{24})(?:out|err)$")
_TIMESTAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
               "cancelled_at")

# Record one line's result exactly once, with its usage; acknowledge its queue entry.
# KEYS: batch, results, in-flight, queue. ARGV: index, value, counter field, entry id or "", group, now,
# then the line's input, cached input, output and reasoning tokens.
# Returns 1 written, 0 already there, -1 unknown batch, -2 batch closed (result dropped).
_RECORD = """
if ARGV[4] ~= '' then
  redis.call('XACK', KEYS[4], ARGV[5], ARGV[4])
  redis.call('XDEL', KEYS[4], ARGV[4])
end
redis.call('ZREM', KEYS[3], ARGV[1])
local st = redis.call('HMGET', KEYS[1], 'status', 'closing', 'total')
local status = st[1]
if not status then return -1 end
if st[2] then return -2 end
if status ~= 'validating' and status ~= 'in_progress' and status ~= 'cancelling' then return -2 end
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
for i, f in ipairs({'input_tokens', 'cached_tokens', 'output_tokens', 'reasoning_tokens'}) do
  if ARGV[6 + i] and ARGV[6 + i] ~= '0' then redis.call('HINCRBY', KEYS[1], f, ARGV[6 + i]) end
end
if status == 'in_progress' and st[3] and redis.call('HLEN', KEYS[2]) >= tonumber(st[3]) then
  redis.call('HSET', KEYS[1], 'status', 'finalizing', 'finalizing_at', ARGV[6])
end
return 1
"""

# Record the error lines of malformed input lines, many per call (each at most once).
# KEYS: batch, results. ARGV: now, then index, value pairs. Returns how many were written,
# -1 unknown batch, -2 batch closed.
_RECORD_INVALID = """
local st = redis.call('HMGET', KEYS[1], 'status', 'closing', 'total')
local status = st[1]
if not status then return -1 end
if st[2] then return -2 end
if status ~= 'validating' and status ~= 'in_progress' and status ~= 'cancelling' then return -2 end
local n = 0
for i = 2, #ARGV, 2 do
  n = n + redis.call('HSETNX', KEYS[2], ARGV[i], ARGV[i + 1])
end
if n > 0 then redis.call('HINCRBY', KEYS[1], 'failed', n) end
if status == 'in_progress' and st[3] and redis.call('HLEN', KEYS[2]) >= tonumber(st[3]) then
  redis.call('HSET', KEYS[1], 'status', 'finalizing', 'finalizing_at', ARGV[1])
end
return n
"""

INVALID_CHUNK = 1000  # malformed lines recorded per script call

# Record a file within its owner's quota. KEYS: files, files:z, files:o:<owner>, quota:<owner>,
# files:exp. ARGV: id, record, created_at, bytes, expires_at or "", max files or "", max bytes
# or "". Returns 1, or -1 over the file count, -2 over the bytes.
_ADD_FILE = """
local q = redis.call('HMGET', KEYS[4], 'files', 'bytes')
local n, b = tonumber(q[1] or '0'), tonumber(q[2] or '0')
if ARGV[6] ~= '' and n + 1 > tonumber(ARGV[6]) then return -1 end
if ARGV[7] ~= '' and b + tonumber(ARGV[4]) > tonumber(ARGV[7]) then return -2 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[1])
redis.call('HINCRBY', KEYS[4], 'files', 1)
redis.call('HINCRBY', KEYS[4], 'bytes', ARGV[4])
if ARGV[5] ~= '' then redis.call('ZADD', KEYS[5], ARGV[5], ARGV[1]) end
return 1
"""

# Forget a file, giving its owner's quota back once. KEYS: files, files:z, files:o:<owner>,
# quota:<owner>, files:exp. ARGV: id, bytes. Returns 1 deleted, 0 unknown.
_DELETE_FILE = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[5], ARGV[1])
if redis.call('ZREM', KEYS[3], ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[4], 'files', -1)
  redis.call('HINCRBY', KEYS[4], 'bytes', -tonumber(ARGV[2]))
end
return 1
"""

# Record a batch within its owner's quota of unfinished batches. KEYS: batch, batches:z,
# active, batches:o:<owner>, active:o:<owner>. ARGV: id, created_at, max active or "", then
# field, value pairs. Returns 1, or -1 over the quota.
_CREATE_BATCH = """
if ARGV[3] ~= '' and redis.call('SCARD', KEYS[5]) >= tonumber(ARGV[3]) then return -1 end
for i = 4, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[1])
redis.call('ZADD', KEYS[4], ARGV[2], ARGV[1])
redis.call('SADD', KEYS[5], ARGV[1])
return 1
"""

# Hand entries back: each one still pending with this consumer becomes claimable at once
# (delivery time the epoch, so it is idle longer than any visibility timeout); the
# consumer stays its owner until another's XAUTOCLAIM takes it. KEYS: queue.
# ARGV: group, consumer, entry ids. Returns how many were handed back.
_HAND_BACK = """
local n = 0
for i = 3, #ARGV do
  if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2]) > 0 then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'TIME', 0, 'JUSTID')
    n = n + 1
  end
end
return n
"""

# validating -> in_progress once the file is parsed. KEYS: batch, results. ARGV: total, now.
_START = """
local st = redis.call('HMGET', KEYS[1], 'status', 'closing')
if st[1] ~= 'validating' or st[2] then return 0 end
redis.call('HSET', KEYS[1], 'status', 'in_progress', 'in_progress_at', ARGV[2], 'total', ARGV[1])
if redis.call('HLEN', KEYS[2]) >= tonumber(ARGV[1]) then
  redis.call('HSET', KEYS[1], 'status', 'finalizing', 'finalizing_at', ARGV[2])
end
return 1
"""

# validating|in_progress -> cancelling. KEYS: batch. ARGV: now. Returns the status after.
_CANCEL = """
local st = redis.call('HMGET', KEYS[1], 'status', 'closing')
if not st[1] then return false end
if (st[1] == 'validating' or st[1] == 'in_progress') and not st[2] then
  redis.call('HSET', KEYS[1], 'status', 'cancelling', 'cancelling_at', ARGV[1])
  return 'cancelling'
end
return st[1]
"""

# Freeze a batch before its files are written (no result is recorded after this).
# KEYS: batch. ARGV: expired|cancelled. Returns the closing kind, or "" if not allowed.
_CLOSE = """
local st = redis.call('HMGET', KEYS[1], 'status', 'closing')
if st[2] then return st[2] end
local s = st[1]
if ARGV[1] == 'expired' and (s == 'validating' or s == 'in_progress') then
  redis.call('HSET', KEYS[1], 'closing', 'expired') return 'expired' end
if ARGV[1] == 'cancelled' and s == 'cancelling' then
  redis.call('HSET', KEYS[1], 'closing', 'cancelled') return 'cancelled' end
return ''
"""


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


MAX_WINDOW_S = 30 * 86400  # the longest completion window accepted


def parse_window(window: str) -> float | None:
    """``"24h"`` -> seconds, or ``None`` when it is no window. Accepts ``<n>s|m|h|d``
    with a finite positive ``n`` (``"infh"`` and ``"nanh"`` are not) of at most
    :data:`MAX_WINDOW_S`; OpenAI itself accepts only ``24h``."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if not isinstance(window, str) or len(window) < 2 or window[-1] not in units:
        return None
    try:
        n = float(window[:-1])
    except ValueError:
        return None
    seconds = n * units[window[-1]]
    return seconds if math.isfinite(seconds) and 0 < seconds <= MAX_WINDOW_S else None


@overload
def _s(v: bytes | str | int | float) -> str: ...
@overload
def _s(v: None) -> None: ...
def _s(v: Any) -> str | None:
    if v is None:
        return None
    return v.decode() if isinstance(v, bytes) else str(v)


def _i(v: Any) -> int | None:
    return None if v is None else int(v)


class QuotaExceeded(Exception):
    """A key would hold more files, bytes or unfinished batches than its quota;
    ``what`` says which (``files``, ``bytes``, ``batches``)."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


class BatchStore:
    """Batch objects, file records, the queue and results (one Redis client)."""

    def __init__(self, redis, namespace: str, files_dir: str | os.PathLike[str]) -> None:
        self.r = redis
        self.p = f"tg:{{{namespace}}}:batch:"
        self.queue = self.p + "queue"
        self.active = self.p + "active"
        self.files_dir = Path(files_dir)
        self._record = redis.register_script(_RECORD)
        self._record_invalid = redis.register_script(_RECORD_INVALID)
        self._start = redis.register_script(_START)
        self._cancel = redis.register_script(_CANCEL)
        self._close = redis.register_script(_CLOSE)
        self._hand_back = redis.register_script(_HAND_BACK)
        self._add_file = redis.register_script(_ADD_FILE)
        self._delete_file = redis.register_script(_DELETE_FILE)
        self._create_batch = redis.register_script(_CREATE_BATCH)

    @classmethod
    def from_url(cls, url: str, namespace: str, files_dir: str | os.PathLike[str]) -> BatchStore:
        from gateway.store.redis_client import redis_client  # redis://, rediss://, unix:// and redis+sentinel://

        return cls(redis_client(url, timeout_s=10.0), namespace, files_dir)

    async def close(self) -> None:
        await self.r.aclose()

    def key(self, kind: str, batch_id: str) -> str:
        return f"{self.p}{kind}:{batch_id}"

    async def ensure_group(self) -> None:
        import redis.exceptions

        try:
            await self.r.xgroup_create(self.queue, GROUP, id="0", mkstream=True)
        except redis.exceptions.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    # ---- files -------------------------------------------------------------------

    def path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def _file_keys(self, owner: str | None) -> list[str]:
        o = owner if owner is not None else ""  # an owner-less record (written before owners) is nobody's
        return [self.p + "files", self.p + "files:z", f"{self.p}files:o:{o}", f"{self.p}quota:{o}",
                self.p + "files:exp"]

    async def add_file(self, obj: dict[str, Any], owner: str | None, *, max_files: int | None = None,
                       max_bytes: int | None = None) -> None:
        """Record a file: the OpenAI file object ``obj`` (its ``expires_at``, if any, is
        when :meth:`expire_files` deletes it) and its ``owner`` (a key name), counted
        against that owner's quota. Raises :class:`QuotaExceeded` (nothing recorded) when
        the owner would hold more than ``max_files`` files or ``max_bytes`` bytes."""
        exp = obj.get("expires_at")
        n = int(await self._add_file(keys=self._file_keys(owner), args=[
            obj["id"], orjson.dumps({**obj, "owner": owner}), obj["created_at"], int(obj["bytes"]),
            "" if exp is None else int(exp), "" if max_files is None else max_files,
            "" if max_bytes is None else max_bytes]))
        if n < 0:
            raise QuotaExceeded("files" if n == -1 else "bytes")

    async def quota_used(self, owner: str) -> tuple[int, int]:
        """(files, bytes) that ``owner``'s files hold."""
        files, size = await self.r.hmget(f"{self.p}quota:{owner}", "files", "bytes")
        return int(files or 0), int(size or 0)

    async def get_file(self, file_id: str) -> dict[str, Any] | None:
        """The file's record: the file object plus ``owner`` (see :func:`file_object`)."""
        raw = await self.r.hget(self.p + "files", file_id)
        return (await self._with_owners([orjson.loads(raw)]))[0] if raw else None

    async def list_files(self) -> list[dict[str, Any]]:
        """Every file's record, newest first."""
        ids = await self.r.zrevrange(self.p + "files:z", 0, -1)
        if not ids:
            return []
        raws = await self.r.hmget(self.p + "files", ids)
        return await self._with_owners([orjson.loads(x) for x in raws if x])

    async def file_page(self, *, owner: str | None, after: str | None, limit: int, ascending: bool = False,
                        purpose: str | None = None, chunk: int = 500) -> tuple[list[dict[str, Any]], bool]:
        """Up to ``limit`` file records after the one with id ``after`` (``None``: from
        the start; an id not in the listing: none), newest first unless ``ascending``, of
        ``purpose`` if given, and whether more follow. With ``owner``, that key's files
        only, read from its own index; ``None``: every file."""
        z = self.p + "files:z" if owner is None else f"{self.p}files:o:{owner}"
        start = 0
        if after:
            rank = await (self.r.zrank(z, after) if ascending else self.r.zrevrank(z, after))
            if rank is None:
                return [], False
            start = rank + 1
        out: list[dict[str, Any]] = []
        while True:
            ids = await (self.r.zrange(z, start, start + chunk - 1) if ascending
                         else self.r.zrevrange(z, start, start + chunk - 1))
            if not ids:
                return out, False
            raws = await self.r.hmget(self.p + "files", ids)
            recs = await self._with_owners([orjson.loads(x) for x in raws if x])
            for rec in recs:
                if purpose is not None and rec.get("purpose") != purpose:
                    continue
                if len(out) == limit:
                    return out, True
                out.append(rec)
            start += len(ids)

    async def _with_owners(self, recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Give records written before files kept an owner one: an output or error file
        takes its batch's owner; any other stays ``None``."""
        legacy = [(r, m[1]) for r in recs if "owner" not in r and (m := _RESULT_FILE.match(r.get("id", "")))]
        for r in recs:
            r.setdefault("owner", None)
        if legacy:
            async with self.r.pipeline(transaction=False) as p:
                for _, hexid in legacy:
                    p.hget(self.key("b", "batch_" + hexid), "owner")
                owners = await p.execute()
            for (r, _), o in zip(legacy, owners):
                r["owner"] = _s(o)
        return recs

    async def delete_file(self, file_id: str) -> bool:
        """Forget a file and delete its content, giving its owner's quota back."""
        rec = await self.get_file(file_id)
        if rec is None:
            return False
        n = int(await self._delete_file(keys=self._file_keys(rec.get("owner")),
                                        args=[file_id, int(rec.get("bytes") or 0)]))
        if n:
            try:
                self.path(file_id).unlink()
            except FileNotFoundError:
                pass
        return bool(n)

    async def expire_files(self, now: float, limit: int = 100) -> int:
        """Delete up to ``limit`` files whose ``expires_at`` passed; returns how many."""
        ids = await self.r.zrangebyscore(self.p + "files:exp", "-inf", now, start=0, num=limit)
        n = 0
        for fid in ids:
            fid = _s(fid)
            if await self.delete_file(fid):
                n += 1
            else:  # its record is gone already
                await self.r.zrem(self.p + "files:exp", fid)
        return n

    async def ensure_indexes(self) -> bool:
        """Build the per-owner keys (listings, quotas, expiry) from the records written
        before they existed; once per namespace (the ``idx`` marker), by one replica.
        Returns whether they are built (``False``: another replica is building them)."""
        marker = self.p + "idx"
        if await self.r.exists(marker):
            return True
        if not await self.r.set(marker + ":lock", "1", nx=True, ex=300):
            return False
        files: dict[str, tuple[int, int]] = {}
        async with self.r.pipeline(transaction=False) as p:
            async for fid, raw in self.r.hscan_iter(self.p + "files", count=1000):
                recs = await self._with_owners([orjson.loads(raw)])
                rec = recs[0]
                owner = rec.get("owner")
                if owner is None:
                    continue
                p.zadd(f"{self.p}files:o:{owner}", {_s(fid): rec.get("created_at") or 0})
                if rec.get("expires_at"):
                    p.zadd(self.p + "files:exp", {_s(fid): rec["expires_at"]})
                n, b = files.get(owner, (0, 0))
                files[owner] = (n + 1, b + int(rec.get("bytes") or 0))
            for owner, (n, b) in files.items():
                p.hset(f"{self.p}quota:{owner}", mapping={"files": n, "bytes": b})
            for bid in await self.r.zrange(self.p + "batches:z", 0, -1, withscores=True):
                batch_id, created = _s(bid[0]), bid[1]
                owner, status = await self.r.hmget(self.key("b", batch_id), "owner", "status")
                if owner is None:
                    continue
                p.zadd(f"{self.p}batches:o:{_s(owner)}", {batch_id: created})
                if _s(status) not in FINAL:
                    p.sadd(f"{self.p}active:o:{_s(owner)}", batch_id)
            p.set(marker, "1")
            await p.execute()
        return True

    def write_file_bytes(self, file_id: str, chunks: list[bytes]) -> int:
        """Write a file atomically (temporary name, then rename); returns its size."""
        self.files_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.files_dir / f".{file_id}.tmp{os.getpid()}"
        n = 0
        with open(tmp, "wb") as f:
            for c in chunks:
                f.write(c)
                n += len(c)
        os.replace(tmp, self.path(file_id))
        return n

    # ---- batches -----------------------------------------------------------------

    async def create_batch(self, fields: dict[str, Any], *, max_active: int | None = None) -> None:
        """Record a batch for its ``owner``; raises :class:`QuotaExceeded` (nothing
        recorded) when that owner already has ``max_active`` unfinished batches."""
        bid, o = fields["id"], fields.get("owner") or ""
        args: list[Any] = [bid, fields["created_at"], "" if max_active is None else max_active]
        for k, v in fields.items():
            if v is not None:
                args += (k, v)
        n = int(await self._create_batch(keys=[self.key("b", bid), self.p + "batches:z", self.active,
                                               f"{self.p}batches:o:{o}", f"{self.p}active:o:{o}"], args=args))
        if n < 0:
            raise QuotaExceeded("batches")

    async def batch_fields(self, batch_id: str) -> dict[str, str] | None:
        raw = await self.r.hgetall(self.key("b", batch_id))
        if not raw:
            return None
        return {_s(k): _s(v) for k, v in raw.items()}

    async def list_batch_ids(self) -> list[str]:
        return [_s(x) for x in await self.r.zrevrange(self.p + "batches:z", 0, -1)]

    async def batch_page(self, *, after: str | None, limit: int, statuses: frozenset[str] | None = None,
                         owner: str | None = None, chunk: int = 200) -> tuple[list[dict[str, str]], bool]:
        """Batches, newest first: the fields of up to ``limit`` batches after the one
        with id ``after`` (``None``: from the newest) whose status is in ``statuses``
        (``None``: any) and, with ``owner``, created by that key name (``None``: every
        caller's), and whether more follow. Reads ``chunk`` batch hashes per round trip
        until the page is full. Raises ``KeyError`` when ``after`` names no batch."""
        z = self.p + "batches:z" if owner is None else f"{self.p}batches:o:{owner}"  # a key's own index
        start = 0
        if after:
            rank = await self.r.zrevrank(z, after)
            if rank is None:
                raise KeyError(after)
            start = rank + 1
        out: list[dict[str, str]] = []
        while True:
            ids = await self.r.zrevrange(z, start, start + chunk - 1)
            if not ids:
                return out, False
            async with self.r.pipeline(transaction=False) as p:
                for bid in ids:
                    p.hgetall(self.key("b", _s(bid)))
                raws = await p.execute()
            for raw in raws:
                if not raw:
                    continue
                f = {_s(k): _s(v) for k, v in raw.items()}
                if statuses is not None and f.get("status") not in statuses:
                    continue
                if owner is not None and f.get("owner") != owner:
                    continue
                if len(out) == limit:
                    return out, True
                out.append(f)
            start += len(ids)

    async def progress(self, batch_id: str) -> dict[str, Any]:
        """What the manager and the consumers hold of one batch: results recorded,
        lines in flight (live leases), lines enqueued so far."""
        now = time.time()
        async with self.r.pipeline(transaction=False) as p:
            p.hlen(self.key("res", batch_id))
            p.zcount(self.key("fly", batch_id), now, "+inf")
            p.hmget(self.key("b", batch_id), "enqueued", "to_enqueue", "closing")
            results, in_flight, (enqueued, to_enqueue, closing) = await p.execute()
        return {"results_recorded": int(results), "in_flight": int(in_flight), "enqueued": int(enqueued or 0),
                "to_enqueue": _i(to_enqueue), "closing": _s(closing)}

    async def queue_info(self) -> dict[str, Any]:
        """The line queue shared by every batch: stream length, the consumer group's
        pending (delivered, not acknowledged) and undelivered (``lag``) entries, and its
        consumers with their pending lines and idle time. Zeros and no consumers before
        the group exists."""
        import redis.exceptions

        out: dict[str, Any] = {"length": 0, "pending": 0, "lag": None, "consumers": []}
        try:
            out["length"] = int(await self.r.xlen(self.queue))
            for g in await self.r.xinfo_groups(self.queue):
                g = {_s(k): v for k, v in g.items()}
                if _s(g.get("name")) == GROUP:
                    out["pending"] = int(g.get("pending") or 0)
                    out["lag"] = _i(g.get("lag"))
            consumers = await self.r.xinfo_consumers(self.queue, GROUP)
        except redis.exceptions.ResponseError:  # no stream or no group yet
            return out
        for c in consumers:
            c = {_s(k): v for k, v in c.items()}
            out["consumers"].append({"name": _s(c.get("name")), "pending": int(c.get("pending") or 0),
                                     "idle_ms": int(c.get("idle") or 0)})
        return out

    async def active_ids(self) -> list[str]:
        return sorted(_s(x) for x in await self.r.smembers(self.active))

    async def status_of(self, batch_id: str) -> tuple[str | None, str | None, float | None]:
        """(status, closing, expires_at) of a batch; what consumers check before a line."""
        st, closing, exp = await self.r.hmget(self.key("b", batch_id), "status", "closing", "expires_at")
        return _s(st), _s(closing), (float(exp) if exp is not None else None)

    async def start(self, batch_id: str, total: int) -> bool:
        return bool(await self._start(keys=[self.key("b", batch_id), self.key("res", batch_id)],
                                      args=[total, int(time.time())]))

    async def cancel(self, batch_id: str) -> str | None:
        return _s(await self._cancel(keys=[self.key("b", batch_id)], args=[int(time.time())]))

    async def close_batch(self, batch_id: str, kind: str) -> str:
        return _s(await self._close(keys=[self.key("b", batch_id)], args=[kind])) or ""

    async def record(self, batch_id: str, index: int, line: bytes, ok: bool, entry_id: str = "",
                     usage: tuple[int, int, int, int] | None = None) -> int:
        """Store line ``index``'s output (``ok``) or error line exactly once, and add its
        ``usage`` (input, cached input, output, reasoning tokens) to the batch's then."""
        return int(await self._record(
            keys=[self.key("b", batch_id), self.key("res", batch_id), self.key("fly", batch_id), self.queue],
            args=[index, (b"o" if ok else b"e") + line, "completed" if ok else "failed", entry_id, GROUP,
                  int(time.time()), *(usage or (0, 0, 0, 0))]))

    async def record_invalid(self, batch_id: str, lines: list[tuple[int, bytes]]) -> int:
        """Store the error lines of malformed input lines (``(index, error line)``),
        each at most once, :data:`INVALID_CHUNK` per round trip; returns how many were
        written."""
        written = 0
        key, res, now = self.key("b", batch_id), self.key("res", batch_id), int(time.time())
        for lo in range(0, len(lines), INVALID_CHUNK):
            args: list[Any] = [now]
            for index, line in lines[lo:lo + INVALID_CHUNK]:
                args += (index, b"e" + line)
            n = int(await self._record_invalid(keys=[key, res], args=args))
            if n < 0:
                break
            written += n
        return written

    async def owner_of(self, batch_id: str) -> str | None:
        """The key name that created the batch (``None``: unknown batch, or made before
        owners were kept)."""
        return _s(await self.r.hget(self.key("b", batch_id), "owner"))

    async def has_result(self, batch_id: str, index: int) -> bool:
        return bool(await self.r.hexists(self.key("res", batch_id), index))

    async def ack(self, entry_id: str) -> None:
        async with self.r.pipeline(transaction=True) as p:
            p.xack(self.queue, GROUP, entry_id)
            p.xdel(self.queue, entry_id)
            await p.execute()

    async def hand_back(self, consumer: str, entry_ids: list[str]) -> int:
        """Make ``consumer``'s unfinished entries claimable by any consumer now (see
        ``_HAND_BACK``); returns how many were still its own."""
        if not entry_ids:
            return 0
        return int(await self._hand_back(keys=[self.queue], args=[GROUP, consumer, *entry_ids]))

    async def mark_in_flight(self, batch_id: str, index: int, lease_s: float) -> None:
        await self.r.zadd(self.key("fly", batch_id), {str(index): time.time() + lease_s})

    async def in_flight(self, batch_id: str) -> int:
        return int(await self.r.zcount(self.key("fly", batch_id), time.time(), "+inf"))

    async def results(self, batch_id: str) -> dict[int, bytes]:
        out: dict[int, bytes] = {}
        async for k, v in self.r.hscan_iter(self.key("res", batch_id), count=1000):
            out[int(k)] = v
        return out

    async def finish(self, batch_id: str, status: str, output_file_id: str | None, error_file_id: str | None,
                     errors: dict[str, Any] | None = None) -> None:
        fields: dict[str, Any] = {"status": status, f"{status}_at": int(time.time())}
        if output_file_id:
            fields["output_file_id"] = output_file_id
        if error_file_id:
            fields["error_file_id"] = error_file_id
        if errors is not None:
            fields["errors"] = orjson.dumps(errors)
        owner = await self.owner_of(batch_id)
        async with self.r.pipeline(transaction=True) as p:
            p.hset(self.key("b", batch_id), mapping=fields)
            p.srem(self.active, batch_id)
            p.srem(f"{self.p}active:o:{owner or ''}", batch_id)
            p.delete(self.key("fly", batch_id))
            await p.execute()

    async def deactivate(self, batch_id: str, owner: str | None) -> None:
        """Take a batch in a final state (or gone) off the active sets."""
        async with self.r.pipeline(transaction=True) as p:
            p.srem(self.active, batch_id)
            p.srem(f"{self.p}active:o:{owner or ''}", batch_id)
            await p.execute()

    async def lock(self, batch_id: str, owner: str, ttl_s: float) -> bool:
        return bool(await self.r.set(self.key("lock", batch_id), owner, nx=True, px=int(ttl_s * 1000)))

    async def unlock(self, batch_id: str, owner: str) -> None:
        key = self.key("lock", batch_id)
        if _s(await self.r.get(key)) == owner:
            await self.r.delete(key)


def file_object(rec: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI ``file`` object of a stored file record (without ``owner``)."""
    return {k: v for k, v in rec.items() if k != "owner"}


def batch_object(f: dict[str, str]) -> dict[str, Any]:
    """The OpenAI ``batch`` object from the stored fields."""
    meta = f.get("metadata")
    errors = f.get("errors")
    total = int(f.get("total") or 0)
    obj: dict[str, Any] = {
        "id": f["id"], "object": "batch", "endpoint": f["endpoint"],
        "errors": orjson.loads(errors) if errors else None,
        "input_file_id": f["input_file_id"], "completion_window": f["completion_window"],
        "status": f["status"], "output_file_id": f.get("output_file_id"), "error_file_id": f.get("error_file_id"),
        "created_at": int(f["created_at"]), "expires_at": _i(f.get("expires_at")),
    }
    for k in _TIMESTAMPS:
        obj[k] = _i(f.get(k))
    obj["request_counts"] = {"total": total, "completed": int(f.get("completed") or 0),
                             "failed": int(f.get("failed") or 0)}
    tokens_in, tokens_out = int(f.get("input_tokens") or 0), int(f.get("output_tokens") or 0)
    obj["usage"] = {"input_tokens": tokens_in,
                    "input_tokens_details": {"cached_tokens": int(f.get("cached_tokens") or 0)},
                    "output_tokens": tokens_out,
                    "output_tokens_details": {"reasoning_tokens": int(f.get("reasoning_tokens") or 0)},
                    "total_tokens": tokens_in + tokens_out}
    obj["metadata"] = orjson.loads(meta) if meta else None
    return obj
