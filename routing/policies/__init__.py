"""Routing policies behind one interface, one module per policy.

A policy's :meth:`Policy.choose` is a pure function of (request, eligible candidates)
to a :class:`Decision`: it does no I/O. State a policy keeps for itself (a cursor, a
radix tree) is updated only in the :meth:`Policy.on_dispatch` hook, which the router
calls once the choice is made; what the fleet learns from responses flows through
:mod:`routing.load`, not through policies (the llm-d scheduler's split between
scorers and lifecycle hooks).

Adding a policy means one module in this package and one line in :data:`POLICIES`.
"""

from __future__ import annotations

from collections.abc import Callable

from routing.policies.base import BasePolicy, Decision, Match, Policy, RouteRequest
from routing.policies.cache_aware import CacheAware, CacheAwareMinLoad
from routing.policies.estimated_ttft import EstimatedTTFT
from routing.policies.least_requests import LeastRequests
from routing.policies.power_of_two import PowerOfTwo
from routing.policies.prefix_hash import PrefixHash
from routing.policies.round_robin import RoundRobin

__all__ = ["POLICIES", "BasePolicy", "Decision", "Match", "Policy", "RouteRequest", "make_policy"]

POLICIES: dict[str, Callable[[], Policy]] = {
    p.name: p for p in (RoundRobin, LeastRequests, PowerOfTwo, PrefixHash, CacheAware, CacheAwareMinLoad,
                        EstimatedTTFT)}


def make_policy(name: str) -> Policy:
    """Build the policy registered under ``name``. Raises :class:`KeyError` with the
    known names when ``name`` is not registered."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise KeyError(f"unknown routing policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
