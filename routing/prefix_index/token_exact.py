"""Token-exact prefix entries, *speculative* and *precise*: the blocks of backends that
publish KV-cache events, for requests whose token ids are known.

Blocks are keyed by :func:`routing.estimate.token_block_keys` in the engine's own block
size. Dispatch records a *speculative* entry at once (the engine reports a block only
after prefilling it); the engine's ``BlockStored`` makes it *precise*; ``BlockRemoved``
removes it; a speculative entry that no event confirms within ``speculative_s`` decays.
An engine's block hashes are mapped to our keys per backend and data-parallel rank
(for ``BlockRemoved`` and for the ``parent_block_hash`` that chains a new block to its
prefix); a block held by several ranks is held until the last of them removes it.
:meth:`TokenExactEntries.clear_precise` drops a backend's engine-confirmed entries
(``AllBlocksCleared``, an engine restart, a gap in its events that replay could not
fill); until events flow again (:meth:`TokenExactEntries.set_live`) its lookups fall
back to the approximate entries (:mod:`routing.prefix_index.approximate`), which are
recorded for every backend regardless. Blocks an engine removes become ghosts
(:mod:`routing.prefix_index.turnover`).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import repeat, takewhile

from routing.prefix_index.turnover import Evictions, ghost, refetched

PRECISE = math.inf  # a token entry's value: engine-confirmed (else: when its speculation decays, s)


@dataclass(slots=True)
class EngineBlocks:
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
    evictions: Evictions = field(default_factory=Evictions)  # from BlockRemoved and BlockStored


class TokenOwners(Mapping[int, dict[str, float]]):
    """A read-only view of the token-exact entries by key: ``key -> {backend:
    PRECISE or when its speculation decays (s)}`` over every backend with events
    (the index keeps them per backend; this view gathers them per key on access)."""

    def __init__(self, engines: dict[str, EngineBlocks]) -> None:
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


class TokenExactEntries:
    """The token-exact entries of :class:`~routing.prefix_index.PrefixIndex` (its base):
    ``record_speculative``, ``store``, ``remove``, ``clear_precise`` and
    ``match_tokens``. ``max_blocks`` and ``speculative_s`` as there.

    They are kept per backend (``key -> PRECISE or decay time``), so that a lookup walks
    one dict per backend in C; :attr:`token_owners` shows them by key (``key ->
    {backend: ...}``).
    """

    def __init__(self, *, max_blocks: int, speculative_s: float) -> None:
        self.max_blocks = max_blocks
        self.speculative_s = speculative_s
        self.engines: dict[str, EngineBlocks] = {}  # backends with KV events
        self.token_owners = TokenOwners(self.engines)
        # evicted blocks, oldest first: token key -> the backend that evicted it
        self.token_ghosts: OrderedDict[int, str] = OrderedDict()
        # told (no I/O) of the keys a backend's engine no longer holds: (backend, keys)
        self.on_gone: Callable[[str, list[int]], None] | None = None

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
            self.engines[backend] = EngineBlocks(block_size, base_model)
        else:
            e.base_model = base_model

    def set_live(self, backend: str, live: bool) -> None:
        """Whether ``backend``'s events are flowing (its token entries decide its
        lookups) or not (its approximate entries do)."""
        e = self.engines.get(backend)
        if e is not None:
            e.live = live

    def engine(self, backend: str) -> EngineBlocks | None:
        """``backend``'s KV-event state, or ``None`` when it publishes none."""
        return self.engines.get(backend)

    def _forget_tokens(self, backend: str, e: EngineBlocks) -> None:
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

    def _decay(self, backend: str, e: EngineBlocks, now: float, most: int | None = None) -> int:
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
                    refetched(self.token_ghosts, k, self.engines)
                if tokens.get(k) is not None:
                    e.n_speculative -= 1  # a speculative entry, confirmed
                tokens[k] = PRECISE
                n += 1
        if len(holders) > self.max_blocks:
            self.clear_precise(backend)
        return n

    def _release(self, backend: str, e: EngineBlocks, keys: Iterable[int]) -> list[int]:
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
            gone = self._release(backend, e, keys)
            for k in gone:  # the blocks it no longer holds, evicted
                ghost(ghosts, k, e.evictions, backend, bound)
            if gone and self.on_gone is not None:
                self.on_gone(backend, gone)
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
                gone = self._release(backend, e, emap.values())
                if gone and self.on_gone is not None:
                    self.on_gone(backend, gone)
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
