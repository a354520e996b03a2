"""Routing policies behind one interface.

A policy is a pure function of (request, candidate backends) to a :class:`Decision`:
it does no I/O and changes no state except its own cursor. Learning from what was
observed flows back through the :class:`~routing.router.Router`, not through the policy.

Adding a policy means one class here (or in its own module) and one line in
:data:`POLICIES`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from routing.fleet import BackendState


@dataclass(slots=True)
class RouteRequest:
    """What a policy may know about a request.

    ``model`` is the requested model name; ``exclude`` holds backend names that must not
    be chosen (backends that already failed this request); ``prompt_bytes`` is the size
    of the canonical prompt in bytes (0 when unknown).
    """

    model: str
    exclude: frozenset[str] = frozenset()
    prompt_bytes: int = 0


@dataclass(slots=True)
class Decision:
    """A policy's choice and why it was made.

    ``reason`` is a short token for metrics (``round_robin``, ``least_requests``,
    ``tie``...); ``detail`` carries numbers for the explanation header.
    """

    backend: BackendState
    policy: str
    reason: str
    detail: dict[str, float] = field(default_factory=dict)


class Policy(Protocol):
    """The policy interface: ``choose`` gets a non-empty list of eligible candidates."""

    name: str

    def choose(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Decision: ...


class RoundRobin:
    """Cycle through the eligible candidates in config order (one cursor per model)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._cursor: dict[str, int] = {}

    def choose(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Decision:
        i = self._cursor.get(request.model, 0)
        self._cursor[request.model] = i + 1
        return Decision(candidates[i % len(candidates)], self.name, "round_robin")


class LeastRequests:
    """Pick the candidate with the fewest in-flight requests per unit of weight;
    ties are broken at random so that several gateway replicas do not herd.

    This is the ``least_request`` balancer of Envoy and the vLLM/SGLang routers'
    ``shortest_queue`` idea, applied to the gateway's own in-flight counts.
    """

    name = "least_requests"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Decision:
        best: list[BackendState] = []
        best_load = float("inf")
        for b in candidates:
            load = b.in_flight / b.spec.weight
            if load < best_load:
                best, best_load = [b], load
            elif load == best_load:
                best.append(b)
        chosen = best[0] if len(best) == 1 else self._rng.choice(best)
        return Decision(chosen, self.name, "least_requests" if len(best) == 1 else "tie",
                        {"in_flight": float(chosen.in_flight)})


POLICIES: dict[str, Callable[[], Policy]] = {
    RoundRobin.name: RoundRobin,
    LeastRequests.name: LeastRequests,
}


def make_policy(name: str) -> Policy:
    """Build the policy registered under ``name``. Raises :class:`KeyError` with the
    known names when ``name`` is not registered."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise KeyError(f"unknown routing policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
