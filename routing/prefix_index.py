"""Which backends hold which prefix blocks in their KV cache: one index, three kinds
of evidence.

*Approximate* (every backend, every model): blocks of canonical prompt bytes.
Blocks are recorded when a request is *dispatched* (so a burst of siblings co-locates
before any cache is warm). Each backend's set is an LRU bounded by its KV capacity in
blocks, approximating the engine's own LRU of free cached blocks; entries older than
``ttl_s`` are ignored and dropped; the whole index holds at most ``max_blocks`` entries.

A request's blocks are touched from last to first, so that a prefix's first blocks
are the most recently used and are evicted last, as in vLLM, which frees a finished
request's blocks in reverse order so that the tail of a prefix goes first (vLLM docs,
"Automatic Prefix Caching": "evict the block ... at the end of the longest prefix").

*Speculative* and *precise* (backends that publish KV-cache events, requests whose
token ids are known): blocks keyed by :func:`routing.estimate.token_block_keys` in the
engine's own block size. Dispatch records a *speculative* entry at once (the engine
reports a block only after prefilling it); the engine's ``BlockStored`` makes it
*precise*; ``BlockRemoved`` removes it; a speculative entry that no event confirms
within ``speculative_s`` decays. An engine's block hashes are mapped to our keys per
backend and data-parallel rank (for ``BlockRemoved`` and for the ``parent_block_hash``
that chains a new block to its prefix); a block held by several ranks is held until
the last of them removes it. :meth:`PrefixIndex.clear_precise` drops a backend's
engine-confirmed entries (``AllBlocksCleared``, an engine restart, a gap in its
events that replay could not fill); until events flow again (:meth:`PrefixIndex.set_live`)
its lookups fall back to the approximate entries, which are recorded for every
backend regardless.

*Turnover* (:meth:`PrefixIndex.turnover`): per backend, the KV tokens its cache can
still take without evicting, and the probability that a block it evicts is asked for
again, the weight of the eviction cost in :mod:`routing.policies.estimated_ttft`. Each
evicted block is remembered as a *ghost* (its hash and the backend that evicted it)
until as many blocks as the caches hold (at most ``max_blocks``) were evicted after it,
the ghost list of ARC
(Megiddo and Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache", FAST 2003);
a ghost that a later request brings back into a cache (anywhere: the prefix was
recomputed) counts as *refetched* for the backend that evicted it. The probability is
refetched / evicted over about the backend's last two cache-fulls of evictions; the
blocks still remembered count as not asked for (yet), so the estimate errs low, and
most where few evictions have had time to be asked for (a cache that just filled). A backend whose
events are live is measured from its engine's own ``BlockRemoved`` and ``BlockStored``
(what it evicted and what it computed again); the others from the approximate LRU.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import repeat, takewhile

_NEVER = float("-inf")
PRECISE = math.inf  # a token entry's value: engine-confirmed (else: when its speculation decays, s)


@dataclass(slots=True)
class _Evictions:
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


@dataclass(slots=True)
class _BackendBlocks:
    capacity_blocks: int
    lru: OrderedDict[int, float] = field(default_factory=OrderedDict)  # hash -> last use (s)
    evictions: _Evictions = field(default_factory=_Evictions)


@dataclass(slots=True)
class _EngineBlocks:
    """A backend that publishes KV events: its token-exact entries."""

    block_size: int
    base_model: str  # the name a block without a LoRA adapter is keyed under
    live: bool = False  # events flow and the entries are trusted
    tokens: dict[int, float] = field(default_factory=dict)  # key -> PRECISE, or when its speculation decays (s)
    # every speculative record, oldest first: (when it decays (s), the keys it recorded); a
    # key decays with its latest record (its value in tokens), the earlier ones are stale
    speculative: deque[tuple[float, tuple[int, ...]]] = field(default_factory=deque)
    n_speculative: int = 0  # keys held speculatively
    holders: dict[int, int] = field(default_factory=dict)  # precise key -> ranks holding it
    engine_keys: dict[int, dict[int | bytes, int]] = field(default_factory=dict)  # rank -> engine hash -> key
    evictions: _Evictions = field(default_factory=_Evictions)  # from BlockRemoved and BlockStored


class TokenOwners(Mapping[int, dict[str, float]]):
    """A read-only view of the token-exact entries by key: ``key -> {backend:
    PRECISE or when its speculation decays (s)}`` over every backend with events
    (the index keeps them per backend; this view gathers them per key on access)."""

    def __init__(self, engines: dict[str, _EngineBlocks]) -> None:
        self._engines = engines

    def __getitem__(self, key: int) -> dict[str, float]:
        held = {name: e.tokens[key] for name, e in self._engines.items() if key in e.tokens}
        if not held:
            raise KeyError(key)
        return held

    def __contains__(self, key: object) -> bool:
        return any(key in e.tokens for e in self._engines.values())

    def __iter__(self) -> Iterator[int]:
        seen: set[int] = set()
        for e in self._engines.values():
            for key in e.tokens:
                if key not in seen:
                    seen.add(key)
                    yield key

    def __len__(self) -> int:
        return sum(1 for _ in self)


class PrefixIndex:
    """``record(backend, hashes, now)`` and ``match(hashes, now) -> {backend: blocks}``
    for approximate entries; ``record_speculative``, ``store``, ``remove``,
    ``clear_precise`` and ``match_tokens`` for token-exact ones; ``turnover`` for
    the eviction cost.

    - ``ttl_s``: seconds after which an unused block is considered evicted.
    - ``max_blocks``: bound on entries over all backends (memory: about 100 bytes
      each), for each kind; a backend whose precise entries pass it (its engine's
      removals are lost) has them cleared; it bounds the ghosts of evicted blocks
      of each kind as well.
    - ``default_capacity_blocks``: per-backend bound until :meth:`set_capacity` says more.
    - ``speculative_s``: seconds a speculative entry waits for the engine's event
      (0: no speculative entries).

    Token-exact entries are kept per backend (``key -> PRECISE or decay time``), so
    that a lookup walks one dict per backend in C; :attr:`token_owners` shows them by
    key (``key -> {backend: ...}``).
    """

    def __init__(self, *, ttl_s: float = 600.0, max_blocks: int = 2_000_000,
                 default_capacity_blocks: int = 8192, speculative_s: float = 5.0) -> None:
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self.default_capacity_blocks = default_capacity_blocks
        self.speculative_s = speculative_s
        self.backends: dict[str, _BackendBlocks] = {}
        self.owners: dict[int, dict[str, float]] = {}  # hash -> {backend: last use}
        self.size = 0
        self.engines: dict[str, _EngineBlocks] = {}  # backends with KV events
        self.token_owners = TokenOwners(self.engines)
        # evicted blocks, oldest first: hash (or token key) -> the backend that evicted it
        self.ghosts: OrderedDict[int, str] = OrderedDict()
        self.token_ghosts: OrderedDict[int, str] = OrderedDict()
        self.capacity_total = 0  # blocks over all backends' approximate entries: the ghosts' bound

    def _blocks(self, backend: str) -> _BackendBlocks:
        b = self.backends.get(backend)
        if b is None:
            b = self.backends[backend] = _BackendBlocks(self.default_capacity_blocks)
            b.evictions.window = b.capacity_blocks
            self.capacity_total += b.capacity_blocks
        return b

    def set_capacity(self, backend: str, capacity_blocks: int) -> None:
        """Bound ``backend``'s entries to its KV capacity in (index) blocks."""
        b = self._blocks(backend)
        capacity_blocks = max(1, capacity_blocks)
        self.capacity_total += capacity_blocks - b.capacity_blocks
        b.capacity_blocks = b.evictions.window = capacity_blocks
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
                if ghosts:  # :meth:`_refetched`, inlined: this runs for every block a cache takes in
                    by = ghosts.pop(h, None)
                    if by is not None:
                        c = self.backends.get(by)
                        if c is not None:
                            c.evictions.refetched += 1.0
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

    @staticmethod
    def _refetched(ghosts: OrderedDict[int, str], key: int, caches: dict) -> None:
        # ``key`` enters a cache again: if a cache evicted it, that eviction cost a recompute
        by = ghosts.pop(key, None)
        if by is not None:
            c = caches.get(by)
            if c is not None:
                c.evictions.refetched += 1.0

    @staticmethod
    def _ghost(ghosts: OrderedDict[int, str], key: int, evictions: _Evictions, backend: str, bound: int) -> None:
        # ``backend`` evicted ``key``: remembered as the newest ghost, the oldest beyond ``bound`` forgotten
        ghosts.pop(key, None)
        ghosts[key] = backend
        evictions.evict()
        while len(ghosts) > bound:
            ghosts.popitem(last=False)

    def _evict(self, backend: str, b: _BackendBlocks) -> None:
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
            # :meth:`_ghost` and :meth:`_Evictions.evict`, inlined: this runs for every
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
        """Drop everything known about ``backend`` (it restarted: its cache is empty).
        Its KV-event settings stay (:meth:`set_engine`), its token entries go."""
        e = self.engines.get(backend)
        if e is not None:
            self._forget_tokens(backend, e)
        b = self.backends.pop(backend, None)
        if b is None:
            return
        self.capacity_total -= b.capacity_blocks
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

    # ---- token-exact entries (backends with KV events) ------------------------------------

    def set_engine(self, backend: str, block_size: int | None, base_model: str = "") -> None:
        """Declare that ``backend`` publishes KV events in blocks of ``block_size``
        tokens, its blocks without a LoRA adapter keyed under ``base_model``
        (``block_size`` ``None``: it publishes none; its token entries go). A changed
        block size drops its token entries."""
        e = self.engines.get(backend)
        if e is not None and (block_size is None or e.block_size != block_size):
            self._forget_tokens(backend, e)
            del self.engines[backend]
            e = None
        if block_size is None:
            return
        if e is None:
            self.engines[backend] = _EngineBlocks(block_size, base_model)
        else:
            e.base_model = base_model

    def set_live(self, backend: str, live: bool) -> None:
        """Whether ``backend``'s events are flowing (its token entries decide its
        lookups) or not (its approximate entries do)."""
        e = self.engines.get(backend)
        if e is not None:
            e.live = live

    def engine(self, backend: str) -> _EngineBlocks | None:
        """``backend``'s KV-event state, or ``None`` when it publishes none."""
        return self.engines.get(backend)

    def _forget_tokens(self, backend: str, e: _EngineBlocks) -> None:
        self.clear_precise(backend)
        e.tokens.clear()  # only speculative entries were left
        e.speculative.clear()
        e.n_speculative = 0

    def record_speculative(self, backend: str, keys: tuple[int, ...], now: float) -> None:
        """``backend`` was sent a prompt whose blocks are ``keys`` at ``now`` (s): each
        block it does not hold precisely is held speculatively until ``now +
        speculative_s``."""
        e = self.engines.get(backend)
        if e is None or not keys or self.speculative_s <= 0:
            return
        until = now + self.speculative_s
        tokens = e.tokens
        added = 0
        for k in keys:
            v = tokens.get(k)
            if v is None:
                added += 1
            elif v == PRECISE:
                continue
            tokens[k] = until
        e.n_speculative += added
        e.speculative.append((until, keys))
        if e.n_speculative > self.max_blocks:
            self._decay(backend, e, math.inf, e.n_speculative - self.max_blocks)

    def _decay(self, backend: str, e: _EngineBlocks, now: float, most: int | None = None) -> int:
        """Drop ``backend``'s speculative entries due at ``now`` (s), oldest first, or
        (``most``) that many of the oldest; returns how many were dropped."""
        spec = e.speculative
        tokens = e.tokens
        n = 0
        while spec and spec[0][0] <= now:
            until, keys = spec.popleft()
            for i, k in enumerate(keys):
                if tokens.get(k) == until:  # else: recorded again since, confirmed, or gone
                    del tokens[k]
                    n += 1
                    if most is not None and n >= most:
                        if i + 1 < len(keys):
                            spec.appendleft((until, keys[i + 1:]))
                        e.n_speculative -= n
                        return n
        e.n_speculative -= n
        return n

    def expire_speculative(self, now: float) -> int:
        """Drop speculative entries that no event confirmed in time; returns how many."""
        return sum(self._decay(name, e, now) for name, e in self.engines.items() if e.speculative)

    def store(self, backend: str, rank: int, engine_hashes: Iterable[int | bytes], keys: Iterable[int]) -> int:
        """The engine of ``backend`` (data-parallel ``rank``) stored the blocks
        ``engine_hashes``, whose token keys are ``keys``: they become precise (a
        speculative entry is confirmed). Returns the blocks newly held."""
        e = self.engines.get(backend)
        if e is None:
            return 0
        emap = e.engine_keys.setdefault(rank, {})
        holders = e.holders
        tokens = e.tokens
        n = 0
        for h, k in zip(engine_hashes, keys):
            old = emap.get(h)
            if old is not None:
                if old == k:
                    continue
                self._release(backend, e, (old,))
            emap[h] = k
            c = holders.get(k, 0)
            holders[k] = c + 1
            if c == 0:
                if self.token_ghosts:
                    self._refetched(self.token_ghosts, k, self.engines)
                if tokens.get(k) is not None:
                    e.n_speculative -= 1  # a speculative entry, confirmed
                tokens[k] = PRECISE
                n += 1
        if len(holders) > self.max_blocks:
            self.clear_precise(backend)
        return n

    def _release(self, backend: str, e: _EngineBlocks, keys: Iterable[int]) -> list[int]:
        """One engine block of each of ``keys`` (ranks' holds) is gone: a key no rank
        holds any more leaves ``backend``'s precise entries. Returns those keys, in order."""
        holders = e.holders
        tokens = e.tokens
        gone = []
        for key in keys:
            c = holders.get(key, 0) - 1
            if c > 0:
                holders[key] = c
                continue
            holders.pop(key, None)
            gone.append(key)
            tokens.pop(key, None)
        return gone

    def remove(self, backend: str, rank: int, engine_hashes: Iterable[int | bytes]) -> int:
        """The engine of ``backend`` (``rank``) evicted ``engine_hashes`` (one
        ``BlockRemoved``). Returns how many of them were known."""
        return self.remove_events(backend, rank, (engine_hashes,))

    def remove_events(self, backend: str, rank: int, events: Iterable[Iterable[int | bytes]]) -> int:
        """:meth:`remove` for each of a run of ``BlockRemoved`` events (each one's block
        hashes), in one call; the turnover's window and ghost bound are taken per event,
        as :meth:`remove` takes them. Returns how many blocks were known."""
        e = self.engines.get(backend)
        if e is None:
            return 0
        emap = e.engine_keys.get(rank)
        if emap is None:
            return 0
        holders = e.holders
        others = sum(len(x.holders) for x in self.engines.values()) - len(holders)
        ghosts = self.token_ghosts
        n = 0
        for engine_hashes in events:
            if not emap:
                continue
            bound = min(others + len(holders) + 1, self.max_blocks)
            e.evictions.window = len(holders) + 1
            keys = [k for k in map(emap.pop, engine_hashes, repeat(None)) if k is not None]
            for k in self._release(backend, e, keys):  # the blocks it no longer holds, evicted
                self._ghost(ghosts, k, e.evictions, backend, bound)
            n += len(keys)
        return n

    def key_of(self, backend: str, rank: int, engine_hash: int | bytes) -> int | None:
        """Our key of the block ``engine_hash`` of ``backend``'s ``rank``, if known."""
        e = self.engines.get(backend)
        if e is None:
            return None
        emap = e.engine_keys.get(rank)
        return None if emap is None else emap.get(engine_hash)

    def clear_precise(self, backend: str, rank: int | None = None) -> int:
        """Drop ``backend``'s engine-confirmed entries (of one data-parallel ``rank``,
        or of all). Returns how many blocks it no longer holds."""
        e = self.engines.get(backend)
        if e is None:
            return 0
        before = len(e.holders)
        ranks = list(e.engine_keys) if rank is None else [rank]
        for r in ranks:
            emap = e.engine_keys.pop(r, None)
            if emap:
                self._release(backend, e, emap.values())
        return before - len(e.holders)

    def counts(self, backend: str) -> tuple[int, int]:
        """(precise, speculative) blocks ``backend`` holds (0, 0 without events)."""
        e = self.engines.get(backend)
        if e is None:
            return 0, 0
        return len(e.holders), e.n_speculative

    def match_tokens(self, keys: tuple[int, ...], backends: Iterable[str], now: float) -> dict[str, int]:
        """For each of ``backends`` (with events, whose block size ``keys`` were cut
        in), the number of leading blocks of ``keys`` it holds, precisely or
        speculatively; a backend holding none is absent. Speculative entries past their
        bound are dropped first (they are kept in expiry order: this costs what decays).
        Cost: per backend, one dict lookup per matched block (run in C)."""
        if not keys:
            return {}
        result: dict[str, int] = {}
        for name in backends:
            e = self.engines.get(name)
            if e is None:
                continue
            if e.speculative and e.speculative[0][0] <= now:
                self._decay(name, e, now)
            tokens = e.tokens
            if keys[0] in tokens:
                result[name] = len(list(takewhile(tokens.__contains__, keys)))
        return result

    def all_precise(self, backend: str, keys: tuple[int, ...]) -> bool:
        """Whether ``backend``'s engine confirmed every block of ``keys``."""
        e = self.engines.get(backend)
        if e is None:
            return False
        return all(map(e.holders.__contains__, keys))

    # ---- turnover ----------------------------------------------------------------------------

    def turnover(self, backend: str, block_tokens: int, capacity_tokens: float) -> tuple[float, float]:
        """(KV tokens ``backend``'s cache can still take without evicting, probability
        that a block it evicts is asked for again in [0, 1]) for a backend of
        ``capacity_tokens`` whose approximate entries are blocks of ``block_tokens``.
        From its engine's events while they are live (the blocks it holds, precisely
        or speculatively), else from its approximate entries. O(1)."""
        e = self.engines.get(backend) if self.engines else None
        if e is not None and e.live:
            held = (len(e.holders) + e.n_speculative) * e.block_size
            return max(capacity_tokens - held, 0.0), e.evictions.reuse()
        b = self.backends.get(backend)
        if b is None:
            return capacity_tokens, 0.0
        ev = b.evictions
        reuse = ev.refetched / ev.evicted if ev.evicted else 0.0  # :meth:`_Evictions.reuse`, inlined
        return float((b.capacity_blocks - len(b.lru)) * block_tokens), reuse if reuse < 1.0 else 1.0
