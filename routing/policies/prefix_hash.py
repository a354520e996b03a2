"""``prefix_hash``: consistent hashing of the prompt prefix with bounded loads (CHWBL).

Algorithm: Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing with Bounded
Loads", SODA 2018 (arXiv:1608.01350). Backends sit on a hash ring; a key goes to the
first backend clockwise from its hash whose load is below its capacity
``ceil(c * m / n)``, where ``m`` counts the balls including the new one and
``c = 1 + ε``. A full backend passes the key on, clockwise, so hot keys spill to a
stable sequence of neighbours while every backend stays within ``c`` times the mean.

Constants and their sources:

- ``load_factor`` ``c = 1.25``: the lower end of the range HAProxy's documentation
  recommends for ``hash-balance-factor`` ("Reasonable values are from 125 to 200"),
  the implementation Andrew Rodland wrote at Vimeo (HAProxy 1.7, Vimeo Engineering
  Blog, "Improving load balancing with a new consistent-hashing algorithm", 2016);
  also the default of the SGLang gateway's ``prefix_hash`` (``load_factor: 1.25``,
  sgl-project/sglang ``sgl-model-gateway/src/policies/prefix_hash.rs``) and of
  brpc's ``c_murmurhash_bl``. Envoy exposes the same knob as ``hash_balance_factor``.
- Weighted capacity, as HAProxy's ``chash_server_is_eligible`` (``src/lb_chash.c``):
  ``ceil(c * (total_in_flight + 1))`` slots shared in proportion to weight, at least
  one per backend; a backend is eligible while ``in_flight < slots``.
- ``vnodes_per_weight = 160`` ring points per unit of weight: libketama's 160 points
  per server (40 MD5 digests x 4 points), the classic memcached ring.
- ``key_blocks = 16``: the key is the chained hash of the first 16 blocks (block
  ``i``'s hash already covers blocks ``0..i``, so that is ``block_hashes[15]``),
  1,024 tokens at the default 64-token block of :mod:`routing.estimate`. Reason:
  in the Mooncake conversation trace every request shares its first 512-token block
  (a system prompt), so a key that stops inside it sends the whole fleet to one
  backend; two 512-token blocks reach past it and give the trace's full 36.6% ideal
  hit ratio at 1.05-1.07 imbalance (``traces/README.md``). SGLang's ``prefix_hash``
  keys on 256 tokens, which would stay inside that system prompt. A prompt with
  fewer full blocks is keyed on all of them; one with none on the first
  ``key_chars = 4096`` characters of its canonical text (16 x 256 bytes).

Unlike SGLang's ``prefix_hash`` (which jumps to the least-loaded worker when the ring's
first pick is overloaded) this walks the ring, as the paper and HAProxy do. The ring
holds every backend the policy has seen and is never rebuilt for an exclusion:
ineligible backends are skipped, so only the keys they held move.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from hashlib import blake2b

from routing.backend import BackendState
from routing.policies.base import BasePolicy, Decision, Match, RouteRequest

_MASK64 = (1 << 64) - 1


def _h64(data: bytes) -> int:
    return int.from_bytes(blake2b(data, digest_size=8).digest(), "little")


class PrefixHash(BasePolicy):
    """Consistent hashing with bounded loads over the request's prefix key.

    - ``key_blocks``: number of leading blocks in the key (blocks).
    - ``load_factor``: ``c``, the maximum load over the weighted mean load (> 1).
    - ``vnodes_per_weight``: ring points per unit of backend weight.
    - ``key_chars``: prefix length in characters used when the request has no block.

    Raises :class:`ValueError` for ``load_factor <= 1`` or non-positive sizes.
    """

    name = "prefix_hash"

    def __init__(self, key_blocks: int = 16, load_factor: float = 1.25,
                 vnodes_per_weight: int = 160, key_chars: int = 4096) -> None:
        if load_factor <= 1.0:
            raise ValueError("load_factor must be > 1")
        if key_blocks < 1 or vnodes_per_weight < 1 or key_chars < 1:
            raise ValueError("key_blocks, vnodes_per_weight and key_chars must be >= 1")
        self.key_blocks = key_blocks
        self.load_factor = load_factor
        self.vnodes_per_weight = vnodes_per_weight
        self.key_chars = key_chars
        self._points: list[int] = []  # sorted ring positions (64-bit)
        self._owners: list[str] = []  # backend name owning each position
        self._members: set[str] = set()

    # -- ring --------------------------------------------------------------------

    def _add(self, backends: Sequence[BackendState]) -> None:
        pairs = list(zip(self._points, self._owners))
        for b in backends:
            self._members.add(b.name)
            n = max(1, round(self.vnodes_per_weight * b.spec.weight))
            pairs.extend((_h64(f"{b.name}\x00{i}".encode()), b.name) for i in range(n))
        pairs.sort()
        self._points = [p for p, _ in pairs]
        self._owners = [o for _, o in pairs]

    def key_position(self, request: RouteRequest) -> int:
        """The request's position on the ring (64-bit int)."""
        hashes = request.block_hashes
        if hashes:
            h = hashes[min(self.key_blocks, len(hashes)) - 1] & _MASK64
            return _h64(h.to_bytes(8, "little"))
        return _h64(request.prompt_text[:self.key_chars].encode("utf-8", "surrogatepass"))

    # -- policy ------------------------------------------------------------------

    def choose(self, request: RouteRequest, candidates: Sequence[BackendState], match: Match) -> Decision:
        missing = [b for b in candidates if b.name not in self._members]
        if missing:
            self._add(missing)
        by_name = {b.name: b for b in candidates}
        total_in_flight = sum(b.requests for b in candidates)
        total_weight = sum(b.spec.weight for b in candidates)
        slots_total = math.ceil(self.load_factor * (total_in_flight + 1))

        owners = self._owners
        n_points = len(owners)
        start = bisect_right(self._points, self.key_position(request))
        seen: set[str] = set()
        first: BackendState | None = None
        for k in range(n_points):
            name = owners[(start + k) % n_points]
            if name in seen:
                continue
            b = by_name.get(name)
            if b is None:  # on the ring, not eligible now: skip, keep the ring
                continue
            seen.add(name)
            if first is None:
                first = b
            slots = max(1, math.ceil(slots_total * b.spec.weight / total_weight))
            if b.requests < slots:
                return Decision(b, self.name, "ring" if b is first else "bounded_spill",
                                {"in_flight": float(b.requests), "capacity": float(slots),
                                 "probes": float(len(seen))})
            if len(seen) == len(by_name):
                break
        # Unreachable while capacities sum to more than the total load; kept as a guard.
        assert first is not None
        return Decision(first, self.name, "all_full", {"in_flight": float(first.requests)})
