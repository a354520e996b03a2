"""``round_robin``: the simplest baseline."""

from __future__ import annotations

from collections.abc import Sequence

from routing.backend import BackendState
from routing.policies.base import BasePolicy, Decision, Match, RouteRequest


class RoundRobin(BasePolicy):
    """Cycle through the eligible candidates in config order (one cursor per model)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._cursor: dict[str, int] = {}

    def choose(self, request: RouteRequest, candidates: Sequence[BackendState], match: Match) -> Decision:
        i = self._cursor.get(request.model, 0)
        self._cursor[request.model] = i + 1
        return Decision(candidates[i % len(candidates)], self.name, "round_robin")
