"""``power_of_two``: the better of two random candidates (power of two choices).

Source: the SGLang router's ``power_of_two`` policy (sgl-project/sglang,
``sgl-router/src/policies/power_of_two.rs``, now
``sgl-model-gateway/src/policies/power_of_two.rs``; the same file in lightseekorg/smg
``model_gateway/src/policies/power_of_two.rs``). It samples two *distinct* healthy
workers uniformly (the second as ``(i + 1 + U[0, n-1)) mod n``), compares their load
and keeps the first one on a tie (``load1 <= load2``). Its load is the token load
reported by the workers' ``/get_load`` endpoint when both of the pair have one, and
otherwise the router's own count of in-flight requests per worker. The idea is
Mitzenmacher's "power of two choices" (IEEE TPDS 2001): two random probes cut the
maximum load from ``Θ(log n / log log n)`` to ``Θ(log log n)``.

Here the load is the gateway's own in-flight count divided by the backend's
``weight`` (the request-count fallback above, normalised for heterogeneous
backends); token-level load is the business of ``estimated_ttft``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from routing.backend import BackendState
from routing.policies.base import BasePolicy, Decision, Match, RouteRequest


class PowerOfTwo(BasePolicy):
    """Sample two distinct candidates at random; choose the one with the lower
    ``in_flight / weight`` (requests per unit of weight), the first sampled on a tie.

    ``rng`` makes the sampling reproducible in tests and replays.
    """

    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, request: RouteRequest, candidates: Sequence[BackendState], match: Match) -> Decision:
        n = len(candidates)
        if n == 1:
            only = candidates[0]
            return Decision(only, self.name, "single", {"in_flight": float(only.requests)})
        i = self._rng.randrange(n)
        j = (i + 1 + self._rng.randrange(n - 1)) % n
        a, b = candidates[i], candidates[j]
        load_a = a.requests / a.spec.weight
        load_b = b.requests / b.spec.weight
        chosen, other = (a, load_b) if load_a <= load_b else (b, load_a)
        return Decision(chosen, self.name, "power_of_two",
                        {"load": min(load_a, load_b), "other_load": other,
                         "in_flight": float(chosen.requests)})
