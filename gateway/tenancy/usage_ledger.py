"""The usage ledger: requests, tokens, errors and cost per client key and model, in
hourly buckets.

**What is counted.** Every request that passed admission and settled
(:func:`gateway.pipeline.settlement.finish`), interactive or a batch line, under the name of
the key that sent it (``anonymous`` without keys; a batch line under its batch's
owner): one request; its prompt tokens, cached prompt tokens
(``usage.prompt_tokens_details.cached_tokens``) and completion tokens as the backend's
``usage`` reported them (without ``usage``: the gateway's prompt estimate and the
streamed content events, as the per-key token limit counts them); an error when its
final status was not 200; and its cost, when ``usage.prices`` prices the model, at the
prices in force when it settled: ``((prompt - cached) * input + cached * cached_input +
completion * output) / 1e6``. Costs are summed as integers of 1e-9 currency units, so
sums are exact and do not depend on the order of additions.

**Where it is kept.** Without ``state.url``, in this process (pruned after
``usage.retention_days``). With ``state.url``, in Redis, so that every replica's traffic
adds up: one hash per hour, ``tg:{ns}:usage:h:<hour>`` (``<hour>`` = Unix time // 3600),
field ``<key>\\t<model>\\t<counter>``, expiring ``retention_days`` after the hour ended.
The request path makes no Redis call: it adds to this replica's buffer, and
:class:`UsageSync` adds the buffer to Redis every ``usage.flush_interval_s``.

**Accuracy under Redis outages.** A flush is one Lua script that first sets a marker
``tg:{ns}:usage:flush:<replica>:<seq>`` (``SET NX``) and applies its increments only
when it set it. A flush that failed, or whose reply was lost (Redis applied it but the
answer never came), is retried with the same sequence number and the same counts, never
merged with newer ones, so it is applied exactly once. Counts made meanwhile wait in the
buffer. The buffer is bounded by ``usage.max_buffered_buckets`` (key, model, hour)
entries; once full, a request of a (key, model, hour) not yet buffered is not recorded
and counts in ``turbo_gateway_usage_dropped_requests_total`` (requests of one already
buffered still count: a key and model that keep sending through an outage lose nothing
until the next hour starts). A graceful shutdown flushes once more (bounded by ``state.timeout_s``);
a killed replica loses what it had not flushed (at most one flush interval's counts
while Redis is up). Redis itself must persist (RDB or AOF) for counts to survive its
own restart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from gateway.config import Price
from gateway.store.background_sync import BackgroundSync
from gateway.store.redis_client import close_client, redis_client, replica_id

log = logging.getLogger("gateway.tenancy.usage_ledger")

HOUR_S = 3600
# the counters of one bucket, in this order in every list below
COUNTERS = ("requests", "prompt_tokens", "cached_prompt_tokens", "completion_tokens", "errors", "cost_nanos")
_N = len(COUNTERS)
_MARKER_TTL_S = 7 * 24 * HOUR_S  # a flush retried after an outage longer than this could apply twice

Bucket = tuple[str, str, int]  # (key name, model, hour)

# Apply one flush exactly once. KEYS[1]: the flush's marker; KEYS[2..]: hour hashes.
# ARGV[1]: marker TTL (s); then per hour hash: its EXPIREAT, the number of fields n,
# then n (field, increment) pairs. Returns 1 applied, 0 applied before.
_FLUSH = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then return 0 end
local a = 2
for i = 2, #KEYS do
  local expire_at, n = ARGV[a], tonumber(ARGV[a + 1])
  a = a + 2
  for j = 1, n do
    redis.call('HINCRBY', KEYS[i], ARGV[a], ARGV[a + 1])
    a = a + 2
  end
  redis.call('EXPIREAT', KEYS[i], expire_at)
end
return 1
"""


def cost_nanos(price: Price | None, prompt: int, cached: int, completion: int) -> int:
    """The cost of one request in 1e-9 currency units (0 without a ``price``): prompt
    tokens not cached at ``input``, cached ones at ``cached_input`` (else ``input``),
    completion tokens at ``output``, each price per million tokens."""
    if price is None:
        return 0
    cached_price = price.cached_input if price.cached_input is not None else price.input
    per_million = (max(prompt - cached, 0) * price.input + cached * cached_price + completion * price.output)
    return round(per_million * 1000)


def _add(into: dict[Bucket, list[int]], b: Bucket, v: list[int]) -> None:
    cur = into.get(b)
    if cur is None:
        into[b] = list(v)
    else:
        for i in range(_N):
            cur[i] += v[i]


class UsageLedger:
    """This replica's counts: in-process buckets (no shared store), or the buffer a
    :class:`UsageSync` flushes to Redis. ``clock`` is wall-clock seconds (hours must
    agree across replicas)."""

    def __init__(self, *, retention_days: int = 90, max_buffered: int = 100_000,
                 clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.retention_s = retention_days * 24 * HOUR_S
        self.max_buffered = max_buffered
        self.buckets: dict[Bucket, list[int]] = {}  # in-process store (not shared)
        self.pending: dict[Bucket, list[int]] = {}  # counts waiting for a flush (shared)
        self.flushing: dict[Bucket, list[int]] = {}  # the flush in the round trip, or failed and to retry
        self.shared = False
        self.dropped_requests = 0
        self._pruned_hour = 0

    def configure(self, retention_days: int, max_buffered: int) -> None:
        self.retention_s = retention_days * 24 * HOUR_S
        self.max_buffered = max_buffered

    def record(self, key: str, model: str, prompt: int, cached: int, completion: int, error: bool,
               cost: int) -> None:
        """Count one settled request of ``key`` on ``model`` in the current hour (token
        counts as integers, ``cost`` in 1e-9 currency units)."""
        hour = int(self.clock() // HOUR_S)
        b = (key, model, hour)
        if self.shared:
            into = self.pending
            if b not in into and b not in self.flushing and len(into) + len(self.flushing) >= self.max_buffered:
                self.dropped_requests += 1
                return
        else:
            into = self.buckets
            if hour != self._pruned_hour:
                self._pruned_hour = hour
                self.prune(hour)
        v = into.get(b)
        if v is None:
            into[b] = [1, prompt, cached, completion, 1 if error else 0, cost]
        else:
            v[0] += 1
            v[1] += prompt
            v[2] += cached
            v[3] += completion
            v[4] += 1 if error else 0
            v[5] += cost

    def prune(self, hour: int) -> None:
        """Drop in-process buckets whose hour ended more than the retention ago."""
        oldest = hour - self.retention_s // HOUR_S
        for b in [b for b in self.buckets if b[2] < oldest]:
            del self.buckets[b]

    def buffered(self) -> int:
        """(key, model, hour) entries waiting for a flush."""
        return len(self.pending) + len(self.flushing)

    def local_query(self, key: str | None, model: str | None, since_hour: int, until_hour: int
                    ) -> dict[Bucket, list[int]]:
        """The in-process buckets of hours ``since_hour <= hour < until_hour``, of
        ``key`` and ``model`` when given."""
        return {b: list(v) for b, v in self.buckets.items()
                if since_hour <= b[2] < until_hour and (key is None or b[0] == key)
                and (model is None or b[1] == model)}


def _field(key: str, model: str, counter: str) -> str:
    return f"{key}\t{model}\t{counter}"


def _parse_field(f: str) -> tuple[str, str, str] | None:
    """``key\\tmodel\\tcounter`` (key names hold no tab; a model name might)."""
    key, sep, rest = f.partition("\t")
    model, sep2, counter = rest.rpartition("\t")
    if not sep or not sep2 or counter not in COUNTERS:
        return None
    return key, model, counter


class UsageSync(BackgroundSync):
    """Flushes a :class:`UsageLedger`'s buffer to Redis in the background, every
    ``interval_s`` bounded by four ``timeout_s``, and reads the shared buckets (see the
    module docstring). Never raises into the request path."""

    def __init__(self, ledger: UsageLedger, url: str, *, namespace: str, interval_s: float, timeout_s: float,
                 cluster: bool = False) -> None:
        super().__init__("usage-sync", interval_s=interval_s, round_timeout_s=timeout_s * 4, logger=log)
        self.ledger = ledger
        self.url = url
        self.cluster = cluster
        self.prefix = "tg:{" + namespace + "}:usage:"
        self.replica = replica_id()
        self.timeout_s = timeout_s
        self.client: Any = None
        self.seq = 0  # the sequence number of the flush in ``ledger.flushing``
        self._script: Any = None
        self._lock = asyncio.Lock()  # one flush at a time: the loop's, or a caller's (shutdown)

    def hour_key(self, hour: int) -> str:
        return f"{self.prefix}h:{hour}"

    async def start(self) -> None:
        self.client = redis_client(self.url, timeout_s=self.timeout_s, cluster=self.cluster)
        self._script = self.client.register_script(_FLUSH)
        self.ledger.shared = True
        self.start_loop()

    async def stop(self) -> None:
        """Stop the loop, flush once more (bounded by ``timeout_s``; what fails stays
        unflushed and is lost with the process), close the client."""
        await self.stop_loop(max(self.timeout_s, 1.0))
        try:
            async with asyncio.timeout(max(self.timeout_s, 0.1) * 4):
                await self.flush_once()
                if self.ledger.pending:
                    await self.flush_once()
        except Exception as e:  # noqa: BLE001 - best effort on shutdown
            lost = self.ledger.buffered()
            if lost:
                log.warning("usage: %d unflushed (key, model, hour) entries lost at shutdown (%s)", lost,
                            type(e).__name__)
        await close_client(self.client, self.prefix + "flush:" + self.replica, self.timeout_s)
        self.ledger.shared = False

    async def sync_once(self) -> None:
        await self.flush_once()

    async def flush_once(self) -> None:
        """Apply the failed flush again if there is one, else the buffer as a new
        flush; raises on a Redis error (the counts stay buffered)."""
        async with self._lock:
            await self._flush()

    async def _flush(self) -> None:
        led = self.ledger
        if not led.flushing:
            if not led.pending:
                return
            led.flushing, led.pending = led.pending, {}
            self.seq += 1
        keys = [f"{self.prefix}flush:{self.replica}:{self.seq}"]
        args: list[Any] = [_MARKER_TTL_S]
        by_hour: dict[int, list[tuple[str, int]]] = {}
        for (key, model, hour), v in led.flushing.items():
            fields = by_hour.setdefault(hour, [])
            for counter, n in zip(COUNTERS, v):
                if n:
                    fields.append((_field(key, model, counter), n))
        for hour, fields in by_hour.items():
            keys.append(self.hour_key(hour))
            args += [(hour + 1) * HOUR_S + led.retention_s, len(fields)]
            for f, n in fields:
                args += [f, n]
        await self._script(keys=keys, args=args)
        led.flushing = {}

    async def read(self, key: str | None, model: str | None, since_hour: int, until_hour: int
                   ) -> dict[Bucket, list[int]]:
        """The shared buckets of hours ``since_hour <= hour < until_hour``, of ``key``
        and ``model`` when given. Raises on a Redis error."""
        hours = list(range(since_hour, until_hour))
        out: dict[Bucket, list[int]] = {}
        for lo in range(0, len(hours), 500):
            chunk = hours[lo:lo + 500]
            pipe = self.client.pipeline(transaction=False)
            for h in chunk:
                pipe.hgetall(self.hour_key(h))
            for hour, fields in zip(chunk, await pipe.execute()):
                for raw, n in fields.items():
                    parsed = _parse_field(raw.decode() if isinstance(raw, bytes) else raw)
                    if parsed is None:
                        continue
                    k, m, counter = parsed
                    if (key is not None and k != key) or (model is not None and m != model):
                        continue
                    v = out.get((k, m, hour))
                    if v is None:
                        v = out[(k, m, hour)] = [0] * _N
                    v[COUNTERS.index(counter)] += int(n)
        return out

    def down_message(self, e: BaseException) -> tuple[Any, ...]:
        return ("usage: shared store unreachable (%s); %d (key, model, hour) entries buffered", type(e).__name__,
                self.ledger.buffered())

    def back_message(self) -> tuple[Any, ...]:
        return ("usage: shared store is back; buffered usage flushed",)


def summarize(buckets: dict[Bucket, list[int]], *, since: int, until: int) -> dict[str, Any]:
    """The JSON answer of ``GET /admin/usage`` and ``GET /v1/usage``: every bucket
    (oldest first; ``hour`` its start, Unix seconds), totals per (key, model) and in
    all, over ``since <= t < until`` (Unix seconds, whole hours)."""
    def row(v: list[int]) -> dict[str, Any]:
        d: dict[str, Any] = dict(zip(COUNTERS[:5], v[:5]))
        d["total_tokens"] = v[1] + v[3]
        d["cost"] = round(v[5] / 1e9, 9)
        return d

    per: dict[tuple[str, str], list[int]] = {}
    total = [0] * _N
    data = []
    for (key, model, hour), v in sorted(buckets.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1])):
        data.append({"hour": hour * HOUR_S, "key": key, "model": model, **row(v)})
        acc = per.setdefault((key, model), [0] * _N)
        for i in range(_N):
            acc[i] += v[i]
            total[i] += v[i]
    return {"object": "usage", "since": since, "until": until, "data": data,
            "by_key_model": [{"key": k, "model": m, **row(v)} for (k, m), v in sorted(per.items())],
            "totals": row(total)}
