"""Pure routing logic: fleet view, load accounting and policies.

Nothing in this package does network I/O or imports aiohttp or ``gateway``; every
function is testable without a socket (see DESIGN.md section 2).
"""

from routing.fleet import (
    BackendSpec,
    BackendState,
    Fleet,
    NoBackendAvailable,
    Reservation,
    UnknownModel,
)
from routing.policies import POLICIES, Decision, Policy, RouteRequest, make_policy
from routing.router import Router

__all__ = [
    "BackendSpec",
    "BackendState",
    "Decision",
    "Fleet",
    "NoBackendAvailable",
    "POLICIES",
    "Policy",
    "Reservation",
    "RouteRequest",
    "Router",
    "UnknownModel",
    "make_policy",
]
