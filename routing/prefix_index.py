"""Which backends probably hold which prefix blocks in their KV cache.

Blocks are recorded when a request is *dispatched* (so a burst of siblings co-locates
before any cache is warm). Each backend's set is an LRU bounded by its KV capacity in
blocks, approximating the engine's own LRU of free cached blocks; entries older than
``ttl_s`` are ignored and dropped; the whole index holds at most ``max_blocks`` entries.

A request's blocks are touched from last to first, so that a prefix's first blocks
are the most recently used and are evicted last, as in vLLM, which frees a finished
request's blocks in reverse order so that the tail of a prefix goes first (vLLM docs,
"Automatic Prefix Caching": "evict the block ... at the end of the longest prefix").
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

_NEVER = float("-inf")


@dataclass(slots=True)
class _BackendBlocks:
    capacity_blocks: int
    lru: OrderedDict[int, float] = field(default_factory=OrderedDict)  # hash -> last use (s)


class PrefixIndex:
    """``record(backend, hashes, now)`` and ``match(hashes, now) -> {backend: blocks}``.

    - ``ttl_s``: seconds after which an unused block is considered evicted.
    - ``max_blocks``: bound on entries over all backends (memory: about 100 bytes each).
    - ``default_capacity_blocks``: per-backend bound until :meth:`set_capacity` says more.
    """

    def __init__(self, *, ttl_s: float = 600.0, max_blocks: int = 2_000_000,
                 default_capacity_blocks: int = 8192) -> None:
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self.default_capacity_blocks = default_capacity_blocks
        self.backends: dict[str, _BackendBlocks] = {}
        self.owners: dict[int, dict[str, float]] = {}  # hash -> {backend: last use}
        self.size = 0

    def _blocks(self, backend: str) -> _BackendBlocks:
        b = self.backends.get(backend)
        if b is None:
            b = self.backends[backend] = _BackendBlocks(self.default_capacity_blocks)
        return b

    def set_capacity(self, backend: str, capacity_blocks: int) -> None:
        """Bound ``backend``'s entries to its KV capacity in (index) blocks."""
        b = self._blocks(backend)
        b.capacity_blocks = max(1, capacity_blocks)
        self._evict(backend, b)

    def record(self, backend: str, hashes: tuple[int, ...], now: float) -> None:
        """Note that ``backend`` received a prompt made of ``hashes`` at time ``now`` (s)."""
        if not hashes:
            return
        b = self._blocks(backend)
        lru = b.lru
        owners = self.owners
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                self.size += 1
            lru[h] = now
            o = owners.get(h)
            if o is None:
                owners[h] = {backend: now}
            else:
                o[backend] = now
        self._evict(backend, b)
        if self.size > self.max_blocks:
            self._evict_global()

    def _drop(self, backend: str, h: int) -> None:
        o = self.owners.get(h)
        if o is not None:
            o.pop(backend, None)
            if not o:
                del self.owners[h]
        self.size -= 1

    def _evict(self, backend: str, b: _BackendBlocks) -> None:
        lru = b.lru
        while len(lru) > b.capacity_blocks:
            h, _ = lru.popitem(last=False)
            self._drop(backend, h)

    def _evict_global(self) -> None:
        # shed the oldest entries of the largest backends until under the bound
        while self.size > self.max_blocks:
            name, b = max(self.backends.items(), key=lambda kv: len(kv[1].lru))
            for _ in range(min(len(b.lru), self.size - self.max_blocks)):
                h, _ = b.lru.popitem(last=False)
                self._drop(name, h)

    def expire(self, now: float) -> int:
        """Drop entries unused for ``ttl_s``; returns how many were dropped."""
        cutoff = now - self.ttl_s
        dropped = 0
        for name, b in self.backends.items():
            lru = b.lru
            while lru:
                h, t = next(iter(lru.items()))
                if t >= cutoff:
                    break
                lru.popitem(last=False)
                self._drop(name, h)
                dropped += 1
        return dropped

    def forget_backend(self, backend: str) -> None:
        """Drop everything known about ``backend`` (it restarted: its cache is empty)."""
        b = self.backends.pop(backend, None)
        if b is None:
            return
        for h in b.lru:
            self._drop(backend, h)

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
