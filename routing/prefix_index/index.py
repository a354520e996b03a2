"""The prefix index: :class:`PrefixIndex`, its approximate and token-exact entries and
the turnover of each backend's cache in one object (see :mod:`routing.prefix_index`)."""

from __future__ import annotations

from routing.prefix_index.approximate import ApproximateEntries
from routing.prefix_index.token_exact import TokenExactEntries


class PrefixIndex(ApproximateEntries, TokenExactEntries):
    """``record(backend, hashes, now)`` and ``match(hashes, now) -> {backend: blocks}``
    for approximate entries; ``record_speculative``, ``store``, ``remove``,
    ``clear_precise`` and ``match_tokens`` for token-exact ones; ``turnover`` for
    the eviction cost.

    - ``ttl_s``: seconds after which an unused block is considered evicted (longer for
      a backend whose engine was seen keeping idle prefixes longer: :meth:`set_retention`).
    - ``max_blocks``: bound on entries over all backends (memory: about 100 bytes
      each), for each kind; a backend whose precise entries pass it (its engine's
      removals are lost) has them cleared; it bounds the ghosts of evicted blocks
      of each kind as well.
    - ``default_capacity_blocks``: per-backend bound until :meth:`set_capacity` says more.
    - ``speculative_s``: seconds a speculative entry waits for the engine's event
      (0: no speculative entries).

    Token-exact entries are kept per backend (``key -> PRECISE or decay time``), so
    that a lookup walks one dict per backend in C; :attr:`token_owners` shows them by
    key (``key -> {backend: ...}``). One object, not one per kind of evidence: a
    routing decision reads both kinds and the turnover for every candidate.
    """

    def __init__(self, *, ttl_s: float = 600.0, max_blocks: int = 2_000_000,
                 default_capacity_blocks: int = 8192, speculative_s: float = 5.0) -> None:
        ApproximateEntries.__init__(self, ttl_s=ttl_s, max_blocks=max_blocks,
                                    default_capacity_blocks=default_capacity_blocks)
        TokenExactEntries.__init__(self, max_blocks=max_blocks, speculative_s=speculative_s)

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
        reuse = ev.refetched / ev.evicted if ev.evicted else 0.0  # :meth:`Evictions.reuse`, inlined
        return float((b.capacity_blocks - len(b.lru)) * block_tokens), reuse if reuse < 1.0 else 1.0
