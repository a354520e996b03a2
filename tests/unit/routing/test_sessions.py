"""routing/sessions.py and the router's use of it: a session's turn goes home unless
moving is cheaper, without sockets."""

from __future__ import annotations

import math
import random

import pytest

from routing import BackendSpec, Fleet, Router, RouteRequest, make_policy
from routing.estimate import TokenEstimator
from routing.policies.estimated_ttft import EstimatedTTFT, curse, estimate_ttft
from routing.prefix_index import PrefixIndex
from routing.sessions import SessionTable
from routing.store import fold_remote_loads

EST = TokenEstimator()
SYSTEM = "You are an agent with tools. " * 200  # a long shared context, many blocks


def turn(text: str, session: str | None = "s1") -> RouteRequest:
    e = EST.estimate("m", text, 16)
    return RouteRequest("m", prompt_text=text, prompt_bytes=e.size_bytes, block_hashes=e.hashes,
                        prompt_tokens=e.prompt_tokens, output_tokens=e.output_tokens,
                        tokens_per_block=EST.block_bytes / EST.stats("m").bytes_per_token, session=session)


def router(policy: str = "estimated_ttft", seed: int = 1) -> Router:
    fleet = Fleet([BackendSpec(n, frozenset({"m"})) for n in ("a", "b", "c", "d")])
    p = EstimatedTTFT(random.Random(seed)) if policy == "estimated_ttft" else make_policy(policy)
    return Router(fleet, p, PrefixIndex())


def route(r: Router, req: RouteRequest, now: float):
    d, res = r.route(req, now)
    res.release(now)
    return d


def test_a_turn_goes_home_when_the_prefix_index_knows_nothing_of_it():
    # a replica whose prefix index never saw the first turn (not synced yet) but knows the session
    first, second = router(seed=1), router(seed=2)
    d1 = route(first, turn(SYSTEM + "turn one"), 1.0)
    assert d1.placement == "new" and d1.session == "s1"
    s = first.sessions.get("s1", 1.0)
    assert s is not None
    second.sessions.learn("s1", s.home, s.blocks, s.tail, s.seen, s.turns)
    for i in range(5):  # every turn extends the last one's prompt
        d = route(second, turn(SYSTEM + "turn one" + " and more" * (i + 1)), 2.0 + i)
        assert d.backend.name == d1.backend.name and d.placement == "home"
        assert d.detail["matched_tokens"] > 0
    assert second.sessions.get("s1", 7.0).turns == s.turns + 5
    assert second.sessions.placements == {"home": 5, "moved": 0, "new": 0}


def test_without_the_session_the_other_replica_sees_no_hit_anywhere():
    # the control: what the second replica knows of the same turn without the session
    first, second = router(seed=1), router(seed=2)
    route(first, turn(SYSTEM + "turn one"), 1.0)
    m = second.match(turn(SYSTEM + "turn one and more"), 2.0)
    assert m.home is None and all(m.cached_tokens(n) == 0 for n in second.fleet.backends)


def test_an_overloaded_home_is_left_once_and_the_new_home_kept():
    r = router()
    d1 = route(r, turn(SYSTEM + "turn one"), 1.0)
    home = r.fleet.backends[d1.backend.name]
    held = r.reserve(RouteRequest("m", prompt_tokens=2_000_000, output_tokens=1), home, 1.5)  # a long queue
    d2 = route(r, turn(SYSTEM + "turn one, turn two"), 2.0)
    assert d2.backend is not home and d2.placement == "moved"
    assert r.sessions.get("s1", 2.0).home == d2.backend.name
    d3 = route(r, turn(SYSTEM + "turn one, turn two, turn three"), 3.0)
    assert d3.backend is d2.backend and d3.placement == "home"
    held.release(3.0)
    assert r.sessions.placements == {"home": 1, "moved": 1, "new": 1}


def test_a_prompt_that_does_not_extend_the_last_turn_claims_nothing_at_home():
    t = SessionTable()
    t.place("s", "a", turn(SYSTEM + "one").block_hashes, 0.0)
    s = t.get("s", 0.0)
    assert s is not None
    assert t.held_blocks(s, turn(SYSTEM + "one and two").block_hashes) == s.blocks > 0
    assert t.held_blocks(s, turn("something else entirely " + SYSTEM).block_hashes) == 0
    assert t.held_blocks(s, turn(SYSTEM[:100]).block_hashes) == 0  # shorter: not the same context


def test_sessions_expire_after_their_ttl():
    t = SessionTable(ttl_s=10.0)
    assert t.place("s", "a", (1, 2), 0.0) == "new"
    assert t.place("s", "a", (1, 2, 3), 9.0) == "home"
    assert t.get("s", 18.0) is not None
    assert t.place("t", "b", (4,), 18.0) == "new"
    assert t.expire(30.0) == 2 and len(t) == 0
    assert t.place("s", "a", (1,), 31.0) == "new"


def test_the_table_is_bounded_least_recently_seen_first():
    t = SessionTable(max_sessions=2)
    for i, sid in enumerate("xyz"):
        t.place(sid, "a", (i,), float(i))
    assert list(t.sessions) == ["y", "z"]


def test_learn_keeps_the_most_recent_placement_and_share_records_changes():
    t = SessionTable(share=True)
    t.place("s", "a", (1,), 5.0)
    assert not t.learn("s", "b", 1, 1, 4.0, 3)  # older than what is held
    assert t.get("s", 5.0).home == "a"
    assert t.learn("s", "b", 2, 9, 6.0, 3)
    assert t.get("s", 6.0).home == "b" and t.get("s", 6.0).turns == 3
    assert list(t.changed) == ["s"]  # learned placements are not shared again
    assert SessionTable().place("s", "a", (1,), 0.0) == "new"


def test_a_restarted_home_holds_nothing_of_its_sessions():
    r = router()
    d1 = route(r, turn(SYSTEM + "turn one"), 1.0)
    r.forget_backend(d1.backend.name)
    s = r.sessions.get("s1", 1.0)
    assert s.home == d1.backend.name and s.blocks == 0
    m = r.match(turn(SYSTEM + "turn one, two"), 2.0)
    assert m.home == d1.backend.name and m.cached_tokens(d1.backend.name) == 0


@pytest.mark.parametrize("policy", ["cache_aware", "cache_aware_min_load"])
def test_cache_aware_sends_a_session_home_unless_the_load_is_imbalanced(policy):
    r = router(policy)
    d1 = route(r, turn(SYSTEM + "turn one"), 1.0)
    r.index.forget_backend(d1.backend.name)
    r.policy.trees.clear()  # its own tree forgot the prompt too
    d2 = route(r, turn("a different prompt altogether, same session"), 2.0)
    assert d2.backend is d1.backend and d2.reason == "session_home" and d2.placement == "home"
    home = d1.backend
    held = [r.reserve(RouteRequest("m"), home, 2.5) for _ in range(100)]  # far more in flight at home
    d3 = route(r, turn("a third prompt"), 3.0)
    assert d3.reason == "imbalance" and d3.backend is not home and d3.placement == "moved"
    for h in held:
        h.release(3.0)


def test_the_last_turns_own_load_in_another_replicas_view_is_not_held_against_its_home():
    """Replica A placed turn one at home a and answered it; replica B's view of A's load
    may still show it queued there. B discounts exactly that turn, not other load."""
    one, two = turn(SYSTEM + "turn one"), turn(SYSTEM + "turn one, turn two")
    picks = {}
    for other_load in (0, one.prompt_tokens):  # what else A has queued at a, besides turn one
        r = Router(Fleet([BackendSpec(n, frozenset({"m"})) for n in ("a", "b")]), EstimatedTTFT(random.Random(1)))
        r.sessions.learn("s1", "a", len(one.block_hashes), one.block_hashes[-1], 1.0, 1, one.prompt_tokens)
        fold_remote_loads(r.fleet, [{"a": [1, one.prompt_tokens + other_load, 0, 0, 0, 1, 0, 0, 0, 0, 0]}])
        d = route(r, two, 1.5)
        picks[other_load] = (d.backend.name, d.placement)
    assert picks == {0: ("a", "home"), one.prompt_tokens: ("b", "moved")}


def learn_error(r: Router, sigma: float, n: int = 200) -> None:
    """Teach every backend of ``r`` TTFT estimates that erred by a factor e**sigma
    either way, alternately (a spread of about ``sigma`` in the logarithm)."""
    for b in r.fleet.backends.values():
        for i in range(n):
            b.load.estimate_error.add(1.0, math.exp(sigma if i % 2 else -sigma))


@pytest.mark.parametrize(("queued", "sigma", "placement"), [
    (2000, 0.0, "moved"),   # exact estimates: the home's 2.5x longer estimate moves the turn
    (2000, 1.2, "home"),    # estimates that err by e**1.2: a lead of 2.5x over it is within chance
    (8000, 1.2, "moved"),   # a lead of 5x is not
])
def test_a_session_leaves_its_home_only_for_a_lead_beyond_the_estimates_error(queued, sigma, placement):
    r = router()
    d1 = route(r, turn(SYSTEM + "turn one"), 1.0)
    home = r.fleet.backends[d1.backend.name]
    learn_error(r, sigma)
    assert home.load.estimate_error.sigma == pytest.approx(sigma, rel=0.05)
    held = r.reserve(RouteRequest("m", prompt_tokens=queued, output_tokens=1), home, 1.5)
    second = turn(SYSTEM + "turn one, turn two")
    m = r.match(second, 2.0)
    ests = {b.name: estimate_ttft(b, second, m)[0] for b in r.fleet.backends.values()}
    lead = ests[home.name] / min(e for n, e in ests.items() if n != home.name)
    assert lead > 2.0  # the home is not a tie: the others are estimated sooner
    assert (lead <= math.exp(curse(3) * sigma)) == (placement == "home")  # the rule's two sides
    d2 = route(r, second, 2.0)
    assert d2.placement == placement
    assert (d2.backend is home) == (placement == "home")
    assert (d2.reason == "session_home") == (placement == "home")
    held.release(2.0)


def test_the_curse_is_the_expected_maximum_of_standard_normals():
    # E[max of k N(0,1)]: 0, 0.5642, 0.8463, 1.0294, 1.5388 (k = 1, 2, 3, 4, 10; exact values)
    for k, exact in ((1, 0.0), (2, 0.5642), (3, 0.8463), (4, 1.0294), (10, 1.5388)):
        assert curse(k) == pytest.approx(exact, abs=0.03)
