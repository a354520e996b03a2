"""Turnover of a backend's prefix cache: how often a block it evicts is asked for again.

Per backend, :meth:`routing.prefix_index.PrefixIndex.turnover` gives the KV tokens its
cache can still take without evicting, and the probability that a block it evicts is
asked for again, the weight of the eviction cost in :mod:`routing.policies.estimated_ttft`.
Each evicted block is remembered as a *ghost* (its hash and the backend that evicted
it) until as many blocks as the caches hold (at most ``max_blocks``) were evicted after
it, the ghost list of ARC (Megiddo and Modha, "ARC: A Self-Tuning, Low Overhead
Replacement Cache", FAST 2003); a ghost that a later request brings back into a cache
(anywhere: the prefix was recomputed) counts as *refetched* for the backend that
evicted it. The probability is refetched / evicted over about the backend's last two
cache-fulls of evictions; the blocks still remembered count as not asked for (yet), so
the estimate errs low, and most where few evictions have had time to be asked for (a
cache that just filled). A backend whose events are live is measured from its engine's
own ``BlockRemoved`` and ``BlockStored`` (what it evicted and what it computed again);
the others from the approximate LRU.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol


@dataclass(slots=True)
class Evictions:
    """Blocks a cache evicted, and of those the ones a later request brought back into
    a cache (``refetched``); both are halved together once ``evicted`` passes twice
    ``window`` (the cache's size in blocks)."""

    evicted: float = 0.0
    refetched: float = 0.0
    window: int = 1

    def evict(self) -> None:
        self.evicted += 1.0
        if self.evicted > 2 * self.window:
            self.evicted *= 0.5
            self.refetched *= 0.5

    def reuse(self) -> float:
        """The share of evicted blocks asked for again, in [0, 1]."""
        n = self.evicted
        r = self.refetched / n if n else 0.0
        return r if r < 1.0 else 1.0


class EvictingCache(Protocol):
    """A backend's cache of one kind of entries, with its eviction counters."""

    @property
    def evictions(self) -> Evictions: ...


def refetched(ghosts: OrderedDict[int, str], key: int, caches: Mapping[str, EvictingCache]) -> None:
    """``key`` enters a cache again: if a cache of ``caches`` (by backend) evicted it,
    that eviction cost a recompute, counted for the backend that evicted it."""
    by = ghosts.pop(key, None)
    if by is not None:
        c = caches.get(by)
        if c is not None:
            c.evictions.refetched += 1.0


def ghost(ghosts: OrderedDict[int, str], key: int, evictions: Evictions, backend: str, bound: int) -> None:
    """``backend`` evicted ``key``: remembered as the newest ghost, the oldest beyond
    ``bound`` forgotten."""
    ghosts.pop(key, None)
    ghosts[key] = backend
    evictions.evict()
    while len(ghosts) > bound:
        ghosts.popitem(last=False)
