"""Routing: fleet view, load accounting, prefix index, policies and the decision core.

Nothing here imports aiohttp or ``gateway``, and nothing on a request's path does I/O:
every decision is testable without a socket (docs/architecture.md). The one exception
is :mod:`routing.state`, whose background sync shares the fleet view with other
replicas through Redis. The data planes enter through :mod:`routing.core`.
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
