"""The router: candidates for a model, eligibility, then the policy's choice."""

from __future__ import annotations

from routing.fleet import BackendState, Fleet, NoBackendAvailable, Reservation
from routing.policies import Decision, Policy, RouteRequest


class Router:
    """Turns a :class:`RouteRequest` into a :class:`Decision` and a :class:`Reservation`.

    Eligible candidates are the healthy backends serving the model (all of them when
    none is healthy), minus ``request.exclude`` and minus backends cooling down. When exclusion leaves nothing, the excluded
    backends come back (a retry may return to a backend that failed once); when only
    cooling backends remain, :class:`NoBackendAvailable` carries the wait until the
    first one is eligible.
    """

    def __init__(self, fleet: Fleet, policy: Policy) -> None:
        self.fleet = fleet
        self.policy = policy

    def eligible(self, request: RouteRequest, now: float) -> list[BackendState]:
        """Backends the policy may choose from at monotonic time ``now`` (seconds).

        Raises :class:`~routing.fleet.UnknownModel` and :class:`NoBackendAvailable`.
        """
        all_candidates = self.fleet.candidates(request.model)
        healthy = [b for b in all_candidates if b.healthy]
        # When every health check failed, the checks may be wrong: try them all.
        all_candidates = healthy or all_candidates
        warm = [b for b in all_candidates if b.cooldown_until <= now]
        if not warm:
            wait = min(b.cooldown_until for b in all_candidates) - now
            raise NoBackendAvailable(request.model, retry_after_s=max(wait, 0.0))
        if request.exclude:
            fresh = [b for b in warm if b.name not in request.exclude]
            if fresh:
                return fresh
        return warm

    def route(self, request: RouteRequest, now: float) -> tuple[Decision, Reservation]:
        """Choose a backend and reserve its load. Raises what :meth:`eligible` raises."""
        decision = self.policy.choose(request, self.eligible(request, now))
        reservation = self.fleet.reserve(decision.backend)
        self.policy.on_dispatch(request, decision)
        return decision, reservation
