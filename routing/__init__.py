"""Routing: fleet view, load accounting, prefix index, policies and the decision core.

Nothing here imports aiohttp, a Redis client, a socket or ``gateway``, starts a
background task, or does I/O: every decision is testable without a socket
(docs/architecture.md; ``tests/unit/routing/test_layers.py`` checks it). Sharing the
fleet view with other replicas is the gateway's (:mod:`gateway.store`), through the
interface in :mod:`routing.store`. The data planes enter through :mod:`routing.core`.
"""

from routing.backend import BackendSpec, BackendState
from routing.fleet import Fleet, NoBackendAvailable, Reservation, UnknownModel
from routing.policies import POLICIES, Decision, Match, Policy, RouteRequest, make_policy
from routing.router import Router

__all__ = [
    "BackendSpec",
    "BackendState",
    "Decision",
    "Fleet",
    "Match",
    "NoBackendAvailable",
    "POLICIES",
    "Policy",
    "Reservation",
    "RouteRequest",
    "Router",
    "UnknownModel",
    "make_policy",
]
