"""Which backends hold which prefix blocks in their KV cache: one index, three kinds
of evidence (DESIGN.md section 3, "Prefix-cache affinity").

- :mod:`routing.prefix_index.approximate`: *approximate* entries, blocks of canonical
  prompt bytes recorded at dispatch for every backend, bounded by its KV capacity and
  aged out by time;
- :mod:`routing.prefix_index.token_exact`: *speculative* entries (token-exact blocks
  recorded at dispatch, before the engine prefilled them) and *precise* ones (the
  engine's own KV-cache events: stored, removed, cleared);
- :mod:`routing.prefix_index.turnover`: how often a block a backend's cache evicts is
  asked for again (the ghosts of evicted blocks), the weight of the eviction cost;
- :mod:`routing.prefix_index.index`: :class:`PrefixIndex`, the three in one object.

A lookup gives, per backend, how many leading blocks of a prompt it (probably) holds;
token-exact entries decide for backends whose events are live, approximate ones
elsewhere.
"""

from routing.prefix_index.index import PrefixIndex
from routing.prefix_index.token_exact import PRECISE, TokenOwners

__all__ = ["PRECISE", "PrefixIndex", "TokenOwners"]
