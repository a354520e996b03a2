"""Approximate prefix entries: which backends recently received which blocks of
canonical prompt bytes (every backend, every model, no tokenizer needed).

Blocks are recorded when a request is *dispatched* (so a burst of siblings co-locates
before any cache is warm). Each backend's set is an LRU bounded by its KV capacity in
blocks, approximating the engine's own LRU of free cached blocks; entries older than
``ttl_s`` are ignored and dropped, or older than a backend's learned retention when its
engine was seen keeping idle prefixes longer (:meth:`ApproximateEntries.set_retention`);
the whole index holds at most ``max_blocks`` entries.

A request's blocks are touched from last to first, so that a prefix's first blocks
are the most recently used and are evicted last, as in vLLM, which frees a finished
request's blocks in reverse order so that the tail of a prefix goes first (vLLM docs,
"Automatic Prefix Caching": "evict the block ... at the end of the longest prefix").
Evicted blocks become ghosts (:mod:`routing.prefix_index.turnover`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from routing.prefix_index.turnover import Evictions

_NEVER = float("-inf")


@dataclass(slots=True)
class BackendBlocks:
    """A backend's approximate entries: block hashes, least recently used first, bounded
    by ``capacity_blocks``, and the counters of its evictions. ``changes`` grows
    whenever any of them may have changed, so that a value derived from them (the
    router's turnover of this backend) is kept until it does."""

    capacity_blocks: int
    lru: OrderedDict[int, float] = field(default_factory=OrderedDict)  # hash -> last use (s)
    evictions: Evictions = field(default_factory=Evictions)
    changes: int = 0


class ApproximateEntries:
    """The approximate entries of :class:`~routing.prefix_index.PrefixIndex` (its base):
    ``record(backend, hashes, now)`` and ``match(hashes, now) -> {backend: blocks}``.
    ``ttl_s``, ``max_blocks`` and ``default_capacity_blocks`` as there; after
    :meth:`set_retention`, ``ttl_s`` is the longest time any backend's entries are kept
    (``base_ttl_s``: the configured one)."""

    def __init__(self, *, ttl_s: float, max_blocks: int, default_capacity_blocks: int) -> None:
        self.ttl_s = ttl_s
        self.base_ttl_s = ttl_s
        self.retention: dict[str, float] = {}  # backend -> seconds its idle entries are kept, when over base_ttl_s
        self.max_blocks = max_blocks
        self.default_capacity_blocks = default_capacity_blocks
        self.backends: dict[str, BackendBlocks] = {}
        self.owners: dict[int, dict[str, float]] = {}  # hash -> {backend: last use}
        self.size = 0
        # evicted blocks, oldest first: hash -> the backend that evicted it
        self.ghosts: OrderedDict[int, str] = OrderedDict()
        self.capacity_total = 0  # blocks over all backends' approximate entries: the ghosts' bound

    def _blocks(self, backend: str) -> BackendBlocks:
        b = self.backends.get(backend)
        if b is None:
            b = self.backends[backend] = BackendBlocks(self.default_capacity_blocks)
            b.evictions.window = b.capacity_blocks
            self.capacity_total += b.capacity_blocks
        return b

    def set_capacity(self, backend: str, capacity_blocks: int) -> None:
        """Bound ``backend``'s entries to its KV capacity in (index) blocks."""
        b = self._blocks(backend)
        capacity_blocks = max(1, capacity_blocks)
        self.capacity_total += capacity_blocks - b.capacity_blocks
        b.capacity_blocks = b.evictions.window = capacity_blocks
        b.changes += 1
        self._evict(backend, b)

    def record(self, backend: str, hashes: tuple[int, ...], now: float) -> None:
        """Note that ``backend`` received a prompt made of ``hashes`` at time ``now`` (s).
        Only the first ``capacity_blocks`` of them: a cache that takes in a longer prompt
        keeps its prefix and evicts the rest (whatever the order of eviction, its blocks
        past the capacity go), so the work per request is bounded by the cache's size,
        not by the prompt's."""
        if not hashes:
            return
        b = self._blocks(backend)
        b.changes += 1
        if len(hashes) > b.capacity_blocks:
            hashes = hashes[:b.capacity_blocks]
        lru = b.lru
        owners = self.owners
        ghosts = self.ghosts
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                self.size += 1
                if ghosts:  # :func:`.turnover.refetched`, inlined: this runs for every block a cache takes in
                    by = ghosts.pop(h, None)
                    if by is not None:
                        c = self.backends.get(by)
                        if c is not None:
                            c.evictions.refetched += 1.0
                            c.changes += 1
            lru[h] = now
            o = owners.get(h)
            if o is None:
                owners[h] = {backend: now}
            else:
                o[backend] = now
        self._evict(backend, b)
        if self.size > self.max_blocks:
            self._evict_global()

    @staticmethod
    def _disown(owners: dict[int, dict[str, float]], key: int, backend: str) -> None:
        o = owners.get(key)
        if o is not None:
            o.pop(backend, None)
            if not o:
                del owners[key]

    def _drop(self, backend: str, h: int) -> None:
        self._disown(self.owners, h, backend)
        self.size -= 1

    def _evict(self, backend: str, b: BackendBlocks) -> None:
        lru = b.lru
        capacity = b.capacity_blocks
        if len(lru) <= capacity:
            return
        ghosts = self.ghosts
        ev = b.evictions
        twice = 2 * ev.window
        evicted, refetched = ev.evicted, ev.refetched
        while len(lru) > capacity:
            h, _ = lru.popitem(last=False)
            self._drop(backend, h)
            # :func:`~routing.prefix_index.turnover.ghost` and :meth:`Evictions.evict`, inlined: this runs for every
            # block a full cache takes in
            if h in ghosts:
                del ghosts[h]
            ghosts[h] = backend
            evicted += 1.0
            if evicted > twice:
                evicted *= 0.5
                refetched *= 0.5
        ev.evicted, ev.refetched = evicted, refetched
        bound = min(self.capacity_total, self.max_blocks)
        while len(ghosts) > bound:
            ghosts.popitem(last=False)

    def _evict_global(self) -> None:
        # shed the oldest entries of the largest backends until under the bound
        while self.size > self.max_blocks:
            name, b = max(self.backends.items(), key=lambda kv: len(kv[1].lru))
            b.changes += 1
            for _ in range(min(len(b.lru), self.size - self.max_blocks)):
                h, _ = b.lru.popitem(last=False)
                self._drop(name, h)

    def set_retention(self, backend: str, retention_s: float) -> None:
        """``backend``'s engine was seen keeping a prefix idle for ``retention_s``
        seconds (:class:`routing.gaps.RetentionFit`): its entries are kept that long
        when it is longer than the configured ``ttl_s`` (never shorter: the index still
        forgets by capacity). Entries of other backends older than their own time to
        live may be matched until the next :meth:`expire` (once a second in a router)."""
        if retention_s > self.base_ttl_s:
            self.retention[backend] = retention_s
        else:
            self.retention.pop(backend, None)
        self.ttl_s = max(self.retention.values(), default=self.base_ttl_s)

    def expire(self, now: float) -> int:
        """Drop entries unused for their backend's time to live; returns how many were
        dropped."""
        base = now - self.base_ttl_s
        retention = self.retention
        dropped = 0
        for name, b in self.backends.items():
            cutoff = now - retention[name] if name in retention else base
            b.changes += 1
            lru = b.lru
            while lru:
                h, t = next(iter(lru.items()))
                if t >= cutoff:
                    break
                lru.popitem(last=False)
                self._drop(name, h)
                dropped += 1
        return dropped

    def match(self, hashes: tuple[int, ...], now: float) -> dict[str, int]:
        """Per backend, the number of leading blocks of ``hashes`` it probably holds
        (backends holding none are absent). Cost: O(matched blocks x backends)."""
        if not hashes:
            return {}
        cutoff = now - self.ttl_s
        first = self.owners.get(hashes[0])
        if not first:
            return {}
        alive = {b for b, t in first.items() if t >= cutoff}
        result: dict[str, int] = {}
        i = 1
        n = len(hashes)
        owners = self.owners
        while alive and i < n:
            o = owners.get(hashes[i])
            if o is None:
                break
            gone = [b for b in alive if o.get(b, _NEVER) < cutoff]
            for b in gone:
                result[b] = i
                alive.discard(b)
            i += 1
        for b in alive:
            result[b] = i
        return result
