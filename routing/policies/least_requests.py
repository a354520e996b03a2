"""``least_requests``: fewest in-flight requests per unit of weight."""

from __future__ import annotations

import random
from collections.abc import Sequence

from routing.backend import BackendState
from routing.policies.base import BasePolicy, Decision, Match, RouteRequest


class LeastRequests(BasePolicy):
    """Pick the candidate with the fewest in-flight requests per unit of weight;
    ties are broken at random so that several gateway replicas do not herd.

    This is the ``least_request`` balancer of Envoy and the vLLM/SGLang routers'
    ``shortest_queue`` idea, applied to the gateway's own in-flight counts.
    """

    name = "least_requests"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, request: RouteRequest, candidates: Sequence[BackendState], match: Match) -> Decision:
        best: list[BackendState] = []
        best_load = float("inf")
        for b in candidates:
            load = b.requests / b.spec.weight
            if load < best_load:
                best, best_load = [b], load
            elif load == best_load:
                best.append(b)
        chosen = best[0] if len(best) == 1 else self._rng.choice(best)
        return Decision(chosen, self.name, "least_requests" if len(best) == 1 else "tie",
                        {"in_flight": float(chosen.requests)})
