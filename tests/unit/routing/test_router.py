"""routing/: policies, eligibility and reservations, without sockets."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from routing import BackendSpec, Fleet, NoBackendAvailable, Router, RouteRequest, UnknownModel, make_policy
from routing.policies import Match


def choose(policy, request, candidates):
    """``policy``'s choice for ``request`` outside a router: nothing cached anywhere."""
    return policy.choose(request, candidates, Match.of(request))


def fleet(*names: str, model: str = "m", weights: dict[str, float] | None = None) -> Fleet:
    weights = weights or {}
    return Fleet([BackendSpec(n, frozenset({model}), weight=weights.get(n, 1.0)) for n in names])


def test_round_robin_cycles_in_config_order():
    r = Router(fleet("a", "b", "c"), make_policy("round_robin"))
    picks = []
    for _ in range(6):
        d, res = r.route(RouteRequest("m"), now=0)
        picks.append(d.backend.name)
        res.release()
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_least_requests_follows_in_flight_and_weight():
    f = fleet("a", "b", weights={"b": 2.0})
    r = Router(f, make_policy("least_requests"))
    held = [r.route(RouteRequest("m"), now=0)[1] for _ in range(30)]
    counts = Counter(res.backend.name for res in held)
    # in flight per unit of weight stays balanced: b holds twice what a holds
    assert counts == {"a": 10, "b": 20}
    for res in held:
        res.release()
    assert f.backends["a"].in_flight == f.backends["b"].in_flight == 0


def test_least_requests_breaks_ties_at_random():
    from routing.policies.least_requests import LeastRequests
    f = fleet("a", "b", "c")
    p = LeastRequests(random.Random(7))
    picks = Counter(choose(p, RouteRequest("m"), list(f.backends.values())).backend.name for _ in range(300))
    assert set(picks) == {"a", "b", "c"} and min(picks.values()) > 60


def test_unknown_model_and_exclusion():
    f = Fleet([BackendSpec("a", frozenset({"m"})), BackendSpec("b", frozenset({"m", "n"}))])
    r = Router(f, make_policy("round_robin"))
    with pytest.raises(UnknownModel):
        r.route(RouteRequest("zzz"), now=0)
    assert r.eligible(RouteRequest("n"), now=0)[0].name == "b"
    assert [b.name for b in r.eligible(RouteRequest("m", exclude=frozenset({"a"})), now=0)] == ["b"]
    # when exclusion leaves nothing, the excluded backends come back
    assert [b.name for b in r.eligible(RouteRequest("n", exclude=frozenset({"b"})), now=0)] == ["b"]


def test_cooldown_and_health():
    f = fleet("a", "b")
    r = Router(f, make_policy("round_robin"))
    f.cool_down(f.backends["a"], until=10.0)
    assert [b.name for b in r.eligible(RouteRequest("m"), now=5.0)] == ["b"]
    assert [b.name for b in r.eligible(RouteRequest("m"), now=10.0)] == ["a", "b"]
    f.cool_down(f.backends["b"], until=12.0)
    with pytest.raises(NoBackendAvailable) as e:
        r.eligible(RouteRequest("m"), now=9.0)
    assert e.value.retry_after_s == pytest.approx(1.0)
    f.backends["a"].healthy = False
    assert [b.name for b in r.eligible(RouteRequest("m"), now=20.0)] == ["b"]
    f.backends["b"].healthy = False  # all down: the checks may be wrong, try them all
    assert [b.name for b in r.eligible(RouteRequest("m"), now=20.0)] == ["a", "b"]


def test_reservation_releases_exactly_once():
    f = fleet("a")
    res = f.reserve(f.backends["a"])
    assert f.backends["a"].in_flight == 1
    assert res.release() is True
    assert res.release() is False
    assert f.backends["a"].in_flight == 0


def test_unknown_policy_lists_known():
    with pytest.raises(KeyError, match="least_requests"):
        make_policy("nope")
