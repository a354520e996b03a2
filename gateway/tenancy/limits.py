"""Per-key limits: requests per minute, tokens per minute, concurrent requests.

Rates use the sliding-window approximation (Cloudflare, 2017): with per-minute
counters ``prev`` and ``cur`` and a fraction ``f`` of the current minute elapsed, the
rate is ``prev * (1 - f) + cur``. A request is admitted when one more request keeps
the rate within ``requests_per_minute``, when the token rate is still below
``tokens_per_minute`` (the request is charged its estimated prompt tokens plus
``max_tokens`` up front; the charge is corrected to the ``usage`` the backend reports
when it completes, and refunded when the request never reached a backend), and when
the key's in-flight requests are below ``max_concurrent``. Otherwise: 429 with
``Retry-After`` (seconds until the limit would admit it) and an OpenAI error body.

**Many replicas** (``state.url`` set): the check never waits for Redis (DESIGN.md
section 4). Each replica decides on its local view of the key's counters and, in the
background every ``staleness_s / 2``, adds its own new charges to shared per-minute
counters (``HINCRBY``), publishes its in-flight count per key under a lease, and reads
back the totals and the other replicas' in-flight counts. A key can overshoot its
limit by what the other replicas admitted within one sync interval. When Redis is down
the replica enforces the limits on its own counts (the shared totals it last saw age
out with their minute) and resynchronizes when Redis returns; another replica's
in-flight counts stop counting once their lease expires.

Slots: a :class:`Permit` is released exactly once, from the handler's ``finally``, so
a cancelled or timed-out request returns its concurrency slot.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from gateway.config import ClientKey
from gateway.errors import ClientError, retry_later_headers
from gateway.store.background_sync import BackgroundSync
from gateway.store.redis_client import close_client, redis_client, replica_id

if TYPE_CHECKING:
    from gateway.tenancy.fair_queue import TokenCounters

log = logging.getLogger("gateway.tenancy.limits")

WINDOW_S = 60.0
SERVICE_TTL_S = 3600  # the shared service counters expire when no replica synced them for an hour


@dataclass(slots=True)
class KeyUsage:
    """One key's counters as this replica sees them."""

    concurrent: int = 0  # this replica's in-flight requests
    remote_concurrent: int = 0  # the other replicas' (shared store)
    known: dict[int, list[float]] = field(default_factory=dict)  # minute -> [requests, tokens] (shared totals)
    pending: dict[int, list[float]] = field(default_factory=dict)  # local charges not yet published
    publishing: dict[int, list[float]] = field(default_factory=dict)  # charges in the sync round trip

    def count(self, w: int) -> tuple[float, float]:
        r = t = 0.0
        for d in (self.known, self.pending, self.publishing):
            v = d.get(w)
            if v is not None:
                r += v[0]
                t += v[1]
        return r, t

    def add(self, w: int, requests: float, tokens: float, shared: bool) -> None:
        d = self.pending if shared else self.known
        v = d.get(w)
        if v is None:
            d[w] = [requests, tokens]
        else:
            v[0] += requests
            v[1] += tokens

    def prune(self, w: int) -> None:
        for d in (self.known, self.pending):
            for old in [k for k in d if k < w - 1]:
                del d[old]


def _wait_s(prev: float, cur: float, frac: float, excess: float) -> float:
    """Seconds until the sliding-window rate ``prev*(1-frac) + cur`` has dropped by
    ``excess``."""
    decaying = prev * (1.0 - frac)
    if prev > 0 and decaying >= excess:
        return excess * WINDOW_S / prev
    # wait for the next minute, where the rate is cur * (1 - f2)
    rest = excess - decaying
    f2 = min(rest / cur, 1.0) if cur > 0 else 0.0
    return (1.0 - frac) * WINDOW_S + f2 * WINDOW_S


class Permit:
    """One admitted request's hold on its key's limits; :meth:`release` once."""

    __slots__ = ("limiter", "usage", "window", "charged", "released")

    def __init__(self, limiter: Limiter | None, usage: KeyUsage | None, window: int, charged: float) -> None:
        self.limiter = limiter
        self.usage = usage
        self.window = window
        self.charged = charged
        self.released = limiter is None

    def release(self, tokens: int | None = None, dispatched: bool = True) -> None:
        """Return the concurrency slot; correct the token charge to ``tokens`` (the
        reported usage) or refund it when the request never reached a backend."""
        if self.released:
            return
        self.released = True
        u = self.usage
        assert u is not None and self.limiter is not None
        u.concurrent -= 1
        if tokens is not None:
            delta = tokens - self.charged
        elif not dispatched:
            delta = -self.charged
        else:
            delta = 0.0
        if delta:
            w = self.limiter.window()
            target = self.window if self.window >= w - 1 else w
            u.add(target, 0.0, delta, self.limiter.shared)


NO_LIMIT = Permit(None, None, 0, 0.0)


class Limiter:
    """Per-key counters and the admission check. ``clock`` is wall-clock seconds (the
    minute boundaries must agree across replicas)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.usage: dict[str, KeyUsage] = {}
        self.shared = False  # a LimiterSync publishes pending charges
        self.rejected: dict[tuple[str, str], int] = {}

    def window(self) -> int:
        return int(self.clock() // WINDOW_S)

    def configure(self, keys: list[ClientKey]) -> None:
        """The configured keys (at start and on reload): every limited key gets its
        counters now, so that the shared view covers keys this replica has not served."""
        for k in keys:
            if self.has_limits(k) and k.name not in self.usage:
                self.usage[k.name] = KeyUsage()

    def has_limits(self, key: ClientKey | None) -> bool:
        return key is not None and (key.requests_per_minute is not None or key.tokens_per_minute is not None
                                    or key.max_concurrent is not None)

    def acquire(self, key: ClientKey | None, est_tokens: float) -> Permit:
        """Admit one request of ``key`` or raise :class:`ClientError` 429."""
        if key is None or not self.has_limits(key):
            return NO_LIMIT
        u = self.usage.get(key.name)
        if u is None:
            u = self.usage[key.name] = KeyUsage()
        now = self.clock()
        w = int(now // WINDOW_S)
        frac = (now % WINDOW_S) / WINDOW_S
        if key.max_concurrent is not None and u.concurrent + u.remote_concurrent >= key.max_concurrent:
            self._reject(key, "concurrent", 1.0,
                         f"Too many concurrent requests for this API key (limit {key.max_concurrent}).")
        if key.requests_per_minute is not None or key.tokens_per_minute is not None:
            (pr, pt), (cr, ct) = u.count(w - 1), u.count(w)
            if key.requests_per_minute is not None:
                rate = pr * (1 - frac) + cr
                if rate + 1 > key.requests_per_minute:
                    self._reject(key, "requests", _wait_s(pr, cr, frac, rate + 1 - key.requests_per_minute),
                                 f"Rate limit reached: {key.requests_per_minute} requests per minute for this API key.")
            if key.tokens_per_minute is not None:
                rate = pt * (1 - frac) + ct
                if rate >= key.tokens_per_minute:
                    self._reject(key, "tokens", _wait_s(pt, ct, frac, rate - key.tokens_per_minute + 1),
                                 f"Rate limit reached: {key.tokens_per_minute} tokens per minute for this API key.")
        if len(u.known) + len(u.pending) > 4:
            u.prune(w)
        u.concurrent += 1
        charged = float(est_tokens) if key.tokens_per_minute is not None else 0.0
        u.add(w, 1.0, charged, self.shared)
        return Permit(self, u, w, charged)

    def _reject(self, key: ClientKey, limit: str, wait_s: float, message: str) -> None:
        k = (key.name, limit)
        self.rejected[k] = self.rejected.get(k, 0) + 1
        raise ClientError(429, message, code="rate_limit_exceeded", headers=retry_later_headers(wait_s))

    def in_flight(self) -> int:
        """This replica's requests holding a slot (every key)."""
        return sum(u.concurrent for u in self.usage.values())


class LimiterSync(BackgroundSync):
    """Shares a :class:`Limiter`'s counters through Redis in the background (see the
    module docstring), and the admission queue's per-key service ``counters``
    (:class:`gateway.tenancy.fair_queue.TokenCounters`, weighted tokens: each replica adds its
    charges to one hash, ``HINCRBYFLOAT``, and reads back the totals), a round every
    ``interval_s`` bounded by four ``timeout_s``. Never raises into the request path."""

    def __init__(self, limiter: Limiter, url: str, *, namespace: str, interval_s: float, lease_s: float,
                 timeout_s: float, cluster: bool = False, counters: TokenCounters | None = None) -> None:
        super().__init__("limits-sync", interval_s=interval_s, round_timeout_s=timeout_s * 4, logger=log)
        self.limiter = limiter
        self.counters = counters
        self.url = url
        self.cluster = cluster
        tag = "{" + namespace + "}"
        self.prefix = f"tg:{tag}:lim:"
        self.k_registry = f"tg:{tag}:lim:replicas"
        self.k_service = f"tg:{tag}:adm:service"
        self.replica = replica_id()
        self.lease_s = lease_s
        self.timeout_s = timeout_s
        self.client: Any = None

    async def start(self) -> None:
        self.client = redis_client(self.url, timeout_s=self.timeout_s, cluster=self.cluster)
        self.limiter.shared = True
        if self.counters is not None:
            self.counters.shared = True
        self.start_loop()

    async def stop(self) -> None:
        await self.stop_loop(max(self.timeout_s, 1.0))
        await close_client(self.client, self.prefix + "conc:" + self.replica, self.timeout_s)
        self.limiter.shared = False
        if self.counters is not None:
            c = self.counters
            for d in (c.pending, c.publishing):  # not published: keep them in this replica's view
                for k, v in d.items():
                    c.known[k] = c.known.get(k, 0.0) + v
                d.clear()
            c.shared = False

    async def sync_once(self) -> None:
        lim = self.limiter
        client = self.client
        w = lim.window()
        now_ms = int(time.time() * 1000)
        names = list(lim.usage)
        moved: list[tuple[KeyUsage, int, list[float]]] = []
        for name in names:
            u = lim.usage[name]
            for win, v in list(u.pending.items()):
                u.publishing[win] = v
                moved.append((u, win, v))
            u.pending = {}
        svc = self.counters
        if svc is not None:
            for k, amount in svc.pending.items():
                svc.publishing[k] = svc.publishing.get(k, 0.0) + amount
            svc.pending = {}
        try:
            pipe = client.pipeline(transaction=False)
            if svc is not None:  # first, so that the reads below keep their places from the end
                for k, amount in svc.publishing.items():
                    pipe.hincrbyfloat(self.k_service, k, amount)
                pipe.expire(self.k_service, SERVICE_TTL_S)
                pipe.hgetall(self.k_service)
            for name in names:
                u = lim.usage[name]
                for win, v in u.publishing.items():
                    k = f"{self.prefix}{name}:{win}"
                    if v[0]:
                        pipe.hincrby(k, "r", round(v[0]))
                    if v[1]:
                        pipe.hincrby(k, "t", round(v[1]))
                    pipe.expire(k, int(3 * WINDOW_S))
            conc = {n: lim.usage[n].concurrent for n in names if lim.usage[n].concurrent}
            pipe.set(self.prefix + "conc:" + self.replica, orjson.dumps(conc), px=int(self.lease_s * 1000))
            pipe.zadd(self.k_registry, {self.replica: now_ms + int(self.lease_s * 1000)})
            pipe.zremrangebyscore(self.k_registry, "-inf", now_ms)
            for name in names:
                pipe.hmget(f"{self.prefix}{name}:{w - 1}", "r", "t")
                pipe.hmget(f"{self.prefix}{name}:{w}", "r", "t")
            pipe.zrangebyscore(self.k_registry, now_ms, "+inf")
            res = await pipe.execute()
        except BaseException:
            for u, win, v in moved:  # not acknowledged: publish again next time
                u.publishing.pop(win, None)
                u.add(win, v[0], v[1], True)
            if svc is not None:
                for k, amount in svc.publishing.items():
                    svc.pending[k] = svc.pending.get(k, 0.0) + amount
                svc.publishing = {}
            raise
        if svc is not None:
            totals = res[len(svc.publishing) + 1]
            svc.publishing = {}
            svc.known = {(k.decode() if isinstance(k, bytes) else k): float(v) for k, v in totals.items()}
        replicas = [r.decode() if isinstance(r, bytes) else r for r in res[-1]]
        reads = res[-1 - 2 * len(names):-1]
        for i, name in enumerate(names):
            u = lim.usage[name]
            u.publishing = {}
            for j, win in enumerate((w - 1, w)):
                r, t = reads[2 * i + j]
                u.known[win] = [float(r or 0), float(t or 0)]
            for old in [k for k in u.known if k < w - 1]:
                del u.known[old]
        others = [r for r in replicas if r != self.replica]
        remote: dict[str, int] = {}
        if others:
            for raw in await client.mget([self.prefix + "conc:" + r for r in others]):
                if raw:
                    try:
                        for n, c in orjson.loads(raw).items():
                            remote[n] = remote.get(n, 0) + int(c)
                    except (orjson.JSONDecodeError, AttributeError, ValueError, TypeError):
                        continue
        for name, u in lim.usage.items():
            u.remote_concurrent = remote.get(name, 0)

    def down_message(self, e: BaseException) -> tuple[Any, ...]:
        return ("limits: shared store unreachable (%s); enforcing per-key limits locally", type(e).__name__)

    def back_message(self) -> tuple[Any, ...]:
        return ("limits: shared store is back; per-key limits shared again",)

    def on_down(self, e: BaseException) -> None:
        if self.last_ok is None or asyncio.get_running_loop().time() - self.last_ok > self.lease_s:
            for u in self.limiter.usage.values():
                u.remote_concurrent = 0
