"""Learned expiry, gap-aware retention and moves by reason (routing/gaps.py,
routing/sessions.py, routing/session_kv.py), without sockets."""

from __future__ import annotations

import random

import pytest

from routing import BackendSpec, Fleet, Router, RouteRequest
from routing.estimate import TokenEstimator
from routing.gaps import EDGES, MIN_GAPS, N_BINS, GapEstimator, RetentionFit, bin_of
from routing.policies.estimated_ttft import EstimatedTTFT
from routing.prefix_index import PrefixIndex
from routing.sessions import SessionTable

EST = TokenEstimator()


def turn(text: str, session: str | None = None, subset: frozenset[str] | None = None) -> RouteRequest:
    e = EST.estimate("m", text, 16)
    return RouteRequest("m", prompt_text=text, prompt_bytes=e.size_bytes, block_hashes=e.hashes,
                        prompt_tokens=e.prompt_tokens, output_tokens=e.output_tokens,
                        tokens_per_block=EST.block_bytes / EST.stats("m").bytes_per_token, subset=subset,
                        session=session)


def router(*names: str, capacity: int = 8192, prefix_ttl_s: float = 1.0) -> Router:
    fleet = Fleet([BackendSpec(n, frozenset({"m"}), kv_capacity_tokens=capacity) for n in names])
    return Router(fleet, EstimatedTTFT(random.Random(1)), PrefixIndex(ttl_s=prefix_ttl_s))


def route(r: Router, req: RouteRequest, now: float):
    d, res = r.route(req, now)
    res.release(now)
    return d


def context(i: int, turns: int = 1) -> str:
    return f"session {i}: the agent's context " * 300 + "".join(f" tool output {t}" * 20 for t in range(turns))


# ---- the bins and the estimators -----------------------------------------------------------


def test_bins_are_octaves_with_an_open_last_bin():
    assert [bin_of(x) for x in (-1.0, 0.0, 0.2, 0.25, 0.49, 0.5, 1.0, 3.9, 4.0)] == [0, 0, 0, 1, 1, 2, 3, 4, 5]
    assert bin_of(EDGES[-1]) == bin_of(1e12) == bin_of(float("inf")) == bin_of(float("nan")) == N_BINS - 1


def test_the_horizon_is_the_gaps_99th_percentile_bin_doubled_and_capped():
    g = GapEstimator()
    for _ in range(MIN_GAPS - 1):
        g.observe(3.0)
    assert g.horizon(1800.0) == 1800.0  # too few gaps yet: the cap
    g.observe(3.0)
    assert g.horizon(1800.0) == 8.0  # 3 s lies in [2, 4): its upper edge, doubled
    assert g.horizon(5.0) == 5.0
    for _ in range(100):  # a heavy tail: one gap in 100 of a minute
        g.observe(3.0)
    g.observe(60.0)
    g.observe(60.0)
    assert g.horizon(1800.0) == 128.0


def test_ended_sessions_lower_the_chance_of_a_return():
    g = GapEstimator()
    for _ in range(MIN_GAPS):
        g.observe(1.0)
    assert g.return_values([1.0] * N_BINS)[bin_of(1.0)] == pytest.approx(1.0)
    for _ in range(MIN_GAPS):
        g.ended()
    # waited into the gaps' bin: half of such sessions end, the others come back there
    assert g.return_values([1.0] * N_BINS)[bin_of(1.0)] == pytest.approx(0.5)
    # waited longer than any gap seen: not coming back
    assert g.return_values([1.0] * N_BINS)[bin_of(100.0)] == 0.0
    g.came_back(1.0)  # one of the ended ones came back after all
    assert g.ends == MIN_GAPS - 1 and g.returns == MIN_GAPS + 1


def test_sessions_still_waiting_longer_than_the_gaps_are_not_taken_to_come_back():
    """Sessions that have waited past every gap seen, neither back nor ended yet (their
    horizon is far), are right-censored: counted at risk, they lower the chance of a
    return as ended ones do (Kaplan-Meier); without them every session looks sure to
    come back."""
    g = GapEstimator()
    for _ in range(MIN_GAPS):
        g.observe(1.0)
    held = [1.0] * N_BINS
    waiting = [0.0] * N_BINS
    assert g.return_values(held, waiting)[0] == pytest.approx(1.0)
    waiting[bin_of(100.0)] = 3 * MIN_GAPS  # three times as many, waiting for 100 s
    v = g.return_values(held, waiting)
    assert v[bin_of(1.0)] == pytest.approx(0.25) and v[0] == pytest.approx(0.25)
    assert v[bin_of(100.0)] == 0.0
    waiting[bin_of(100.0)] = 0.0
    waiting[bin_of(0.1)] = 3 * MIN_GAPS  # waiting for less than the gaps: they may yet come back
    v = g.return_values(held, waiting)
    assert v[bin_of(1.0)] == pytest.approx(1.0) and v[0] == pytest.approx(1.0)


def test_return_values_weigh_a_return_by_whether_the_kv_is_still_held_then():
    g = GapEstimator()
    for _ in range(50):
        g.observe(1.0)
        g.observe(100.0)
    held = [1.0 if i <= bin_of(10.0) else 0.0 for i in range(N_BINS)]  # the engine keeps an idle prefix ~10 s
    v = g.return_values(held)
    assert v[0] == pytest.approx(0.5)  # half come back within a second, while held; the others too late
    assert v[bin_of(5.0)] == 0.0  # only the late ones are left


def test_retention_is_the_isotonic_fit_of_the_hits_reported_after_gaps():
    f = RetentionFit()
    assert f.held(1000.0) == 1.0 and f.horizon() == 0.0  # nothing observed: held
    f.observe(1.0, 1.0)
    f.observe(3.0, 1.0)
    f.observe(20.0, 0.0)
    assert f.held(0.5) == f.held(3.0) == 1.0 and f.held(20.0) == f.held(5000.0) == 0.0
    assert f.horizon() == 4.0  # the last observed bin still held, [2, 4)
    f.observe(40.0, 1.0)  # a hit later than a miss: pooled with it (non-increasing)
    assert f.held(20.0) == f.held(40.0) == 0.5
    assert f.horizon() == 64.0
    f.observe(2.0, 1.5)  # a share is clipped to [0, 1]
    assert f.held(2.0) == 1.0


# ---- learned expiry --------------------------------------------------------------------------


def test_sessions_are_kept_as_long_as_the_gaps_they_show_not_the_fixed_ttl():
    t = SessionTable(ttl_s=1800.0)
    now = 0.0
    for i in range(MIN_GAPS):  # sessions whose tool calls take about 3 s
        t.place(f"s{i}", "a", (i,), now)
        t.place(f"s{i}", "a", (i, 1), now + 3.0)
        now += 0.01
    t.expire(now)
    assert t.expiry_s == 8.0
    t.place("w", "a", (7,), 100.0)
    assert t.get("w", 107.0) is not None  # within the horizon
    t.place("late", "a", (8,), 100.0)
    t.expire(109.0)
    assert t.get("late", 109.0) is None and "late" in t.ghosts  # forgotten, remembered as a ghost
    # it comes back after all: a new placement, but its gap is learned
    returns = t.gaps.returns
    assert t.place("late", "a", (8, 9), 150.0) == "new"
    assert t.gaps.returns == returns + 1 and t.gaps.counts[bin_of(50.0)] == 1
    assert "late" not in t.ghosts


def test_a_fixed_ttl_is_the_cap_of_the_learned_expiry():
    t = SessionTable(ttl_s=5.0)
    for i in range(MIN_GAPS):
        t.place(f"s{i}", "a", (i,), 0.0)
        t.place(f"s{i}", "a", (i, 1), 3.0)
    t.expire(3.0)
    assert t.expiry_s == 5.0


def test_learned_placements_teach_gaps_too():
    t = SessionTable()
    t.learn("s", "a", 2, 9, 1.0, 1)
    t.learn("s", "a", 3, 10, 4.0, 2)  # another replica placed the next turn 3 s later
    assert t.gaps.returns == 1 and t.gaps.counts[bin_of(3.0)] == 1


# ---- gap-aware retention ---------------------------------------------------------------------


def waiting_sessions(r: Router, home: str, n: int, now: float) -> None:
    for i in range(n):
        d = route(r, turn(context(i), f"s{i}", subset=frozenset({home})), now)
        assert d.backend.name == home


@pytest.mark.parametrize("queue", [200, 400])
def test_a_one_off_long_prompt_does_not_evict_sessions_waiting_past_prefix_ttl(queue):
    """Three sessions wait at a (their blocks aged out of the approximate index after
    prefix_ttl_s); b is a little busier. A long one-off prompt that would evict most of
    their context goes to b: their KV is worth its recompute, soon."""
    r = router("a", "b")
    waiting_sessions(r, "a", 3, 1.0)
    now = 5.0  # a tool-call gap longer than prefix_ttl_s
    assert not r.index.match(turn(context(0)).block_hashes, now)  # the index forgot them
    held = r.reserve(RouteRequest("m", prompt_tokens=queue, output_tokens=1), r.fleet.backends["b"], now)
    d = route(r, turn("a one-off long prompt " * 1000), now)
    held.release(now)
    assert d.backend.name == "b"
    # and the sessions come back home to their context
    for i in range(3):
        d = route(r, turn(context(i, 2), f"s{i}"), now + 1)
        assert (d.backend.name, d.placement) == ("a", "home") and d.detail["matched_tokens"] > 0


def test_sessions_that_do_not_come_back_are_not_worth_keeping():
    r = router("a", "b")
    g = r.sessions.gaps
    for _ in range(MIN_GAPS):  # every session seen came back within a second, or never
        g.observe(0.5)
        g.ended()
    waiting_sessions(r, "a", 3, 1.0)
    r.match(turn("tick"), 5.0)  # one second on: the waiting ones are past every gap seen
    held = r.reserve(RouteRequest("m", prompt_tokens=400, output_tokens=1), r.fleet.backends["b"], 5.0)
    d = route(r, turn("a one-off long prompt " * 1000), 5.0)
    held.release(5.0)
    assert d.backend.name == "a"


def test_a_home_whose_engine_evicted_after_such_gaps_is_not_counted_as_holding_the_context():
    """Without KV events: the engine reported no cached tokens for sessions that came
    home after 5 s; a session idle that long is no longer counted as held there, one
    back sooner still is."""
    r = router("a", "b", capacity=65536, prefix_ttl_s=1.0)
    for i in range(3):
        route(r, turn(context(i), f"s{i}", subset=frozenset({"a"})), 1.0)
        d = route(r, turn(context(i, 2), f"s{i}"), 6.0)
        assert d.placement == "home" and d.held_tokens > 0 and d.idle_s == 5.0
        if i == 0:  # nothing learned yet: counted as held
            assert d.detail["matched_tokens"] == pytest.approx(d.held_tokens, rel=0.05)
        else:  # the engine had evicted the last one after as long
            assert d.detail["matched_tokens"] == 0
        r.learn_cached(d, 4000, 0)  # the engine had evicted it
    route(r, turn(context(7), "late", subset=frozenset({"a"})), 10.0)
    route(r, turn(context(8), "soon", subset=frozenset({"a"})), 14.5)
    late = r.match(turn(context(7, 2), "late"), 15.5)
    assert late.home == "a" and late.home_held > 0 and late.cached_tokens("a") == 0
    soon = r.match(turn(context(8, 2), "soon"), 15.5)  # idle 1 s: no miss seen that soon
    assert soon.cached_tokens("a") > 0
    assert r.sessions.hit_tokens["home"] == [12000, 0]


def test_hits_after_long_gaps_keep_the_approximate_index_past_prefix_ttl():
    r = router("a", "b", capacity=65536, prefix_ttl_s=1.0)
    route(r, turn(context(0), "s0", subset=frozenset({"a"})), 1.0)
    d = route(r, turn(context(0, 2), "s0"), 21.0)  # 20 s idle, the engine still had it
    r.learn_cached(d, 4000, int(d.held_tokens))
    assert r.index.retention == {"a": 32.0} and r.index.ttl_s == 32.0
    # a sub-agent sharing the context (its own session) finds it at a after 20 s
    r.match(turn("tick"), 41.5)  # expiry ran
    m = r.match(turn(context(0, 2) + " sub-agent task", "sub"), 41.5)
    assert m.matched_blocks.get("a", 0) > 0
    r.match(turn("tick"), 60.0)
    assert not r.match(turn(context(0, 2) + " sub-agent task", "sub2"), 60.0).matched_blocks


def test_a_precise_removal_of_a_sessions_last_block_stops_valuing_it():
    r = router("a", "b")
    r.index.set_engine("a", 16)
    r.index.set_live("a", True)
    req = turn(context(0), "s0", subset=frozenset({"a"}))
    req = RouteRequest(**{f: getattr(req, f) for f in req.__struct_fields__ if f != "token_keys"},
                       token_keys={16: (11, 12, 13)})
    route(r, req, 1.0)
    s = r.sessions.get("s0", 1.0)
    assert s.key_tail == 13 and r.kv_turnover(r.fleet.backends["a"])[0] < 8192 - 1000
    r.index.store("a", 0, [101, 102, 103], [11, 12, 13])
    r.index.remove("a", 0, [103])  # the engine evicted the tail of its context
    assert s.key_tail == 0 and s.bucket == -1
    assert r.kv_turnover(r.fleet.backends["a"]) == r.index.turnover("a", r.block_tokens, 8192.0)


def test_the_waiting_blocks_move_to_the_bins_of_their_waiting_time():
    t = SessionTable()
    t.place("s", "a", (1, 2, 3), 0.0)
    t.place("u", "a", (7,), 0.0)
    assert t.waiting["a"].blocks[0] == 4 and t.waiting_sessions[0] == 2
    t.expire(3.0)
    assert t.waiting["a"].blocks[bin_of(3.0)] == 4 and sum(t.waiting["a"].blocks) == 4
    assert t.waiting_sessions[bin_of(3.0)] == 2 and sum(t.waiting_sessions) == 2
    t.place("s", "b", (1, 2, 3, 4), 3.5)  # it came back, elsewhere
    assert sum(t.waiting["a"].blocks) == 1 and t.waiting["b"].blocks[0] == 4
    assert t.waiting_sessions[0] == 1 and t.waiting_sessions[bin_of(3.0)] == 1
    t.place("s", "b", (1, 2, 3, 4, 5), 4.0)  # and again, home
    assert t.waiting["b"].blocks[0] == 5 and t.waiting_sessions[0] == 1 and sum(t.waiting_sessions) == 2
    t.expire(10.0)
    assert t.waiting["b"].blocks[bin_of(6.0)] == 5 and t.waiting_sessions[bin_of(6.0)] == 1
    t.backend_emptied("b")
    assert "b" not in t.waiting and t.get("s", 10.0).bucket == -1 and sum(t.waiting_sessions) == 1


# ---- moves by reason -------------------------------------------------------------------------


def test_moves_are_counted_by_reason():
    r = router("a", "b", capacity=65536, prefix_ttl_s=600.0)
    route(r, turn(context(0), "s0", subset=frozenset({"a"})), 1.0)
    # the home cannot take it
    r.fleet.backends["a"].draining = True
    d = route(r, turn(context(0, 2), "s0"), 2.0)
    assert (d.backend.name, d.placement) == ("b", "moved")
    r.fleet.backends["a"].draining = False
    # the home holds none of it (a prompt that does not extend the last), the other is idle
    held = r.reserve(RouteRequest("m", prompt_tokens=100, output_tokens=1), r.fleet.backends["b"], 3.0)
    d = route(r, turn("a different prompt " * 100, "s0"), 3.0)
    held.release(3.0)
    assert (d.backend.name, d.placement) == ("a", "moved")
    # the home holds it but its queue costs more than recomputing elsewhere
    held = r.reserve(RouteRequest("m", prompt_tokens=2_000_000, output_tokens=1), r.fleet.backends["a"], 4.0)
    d = route(r, turn("a different prompt " * 100 + " and more", "s0"), 4.0)
    held.release(4.0)
    assert (d.backend.name, d.placement) == ("b", "moved")
    assert r.sessions.moves == {"unavailable": 1, "no_hit": 1, "cheaper": 1}


def test_the_waiting_sessions_take_room_and_lend_their_value_to_the_turnover():
    r = router("a", "b")
    waiting_sessions(r, "a", 2, 1.0)
    r.match(turn("tick"), 3.0)
    a = r.fleet.backends["a"]
    capacity = a.load.kv_capacity_tokens
    w = r.sessions.waiting["a"]
    held, value = w.value or r.value_waiting("a", w)
    assert 0 < value <= held
    free, reuse = r.index.turnover("a", r.block_tokens, capacity)
    used = max(capacity - free, held)
    expected_free = capacity - held if capacity - free < held else free
    assert r.kv_turnover(a) == pytest.approx((expected_free, (value + reuse * (used - held)) / used))
    assert r.kv_turnover(r.fleet.backends["b"]) == r.index.turnover("b", r.block_tokens, 8192.0)


def test_moving_waiting_blocks_is_adding_them_out_of_one_bin_and_into_another():
    from routing.sessions import Waiting

    factors = ([0.5 + k / 7 for k in range(N_BINS)], [0.25 + k / 11 for k in range(N_BINS)])
    for k, m, j, n in ((0, 3.0, 0, 5.0), (2, 4.0, 5, 4.0), (1, 9.0, 0, 2.0), (N_BINS - 1, 1.0, 3, 0.0)):
        one, two = Waiting(), Waiting()
        for w in (one, two):
            w.blocks = [float(i % 4) for i in range(N_BINS)]
            w.factors, w.value = factors, (1.0 / 3, 2.0 / 7)
        one.move(k, m, j, n)
        two.add(k, -m)
        two.add(j, n)
        assert (one.blocks, one.value) == (two.blocks, two.value)  # exactly: the same sums in the same order


def test_a_kept_turnover_is_the_one_computed_afresh_whatever_changed():
    """The router keeps each backend's turnover until its index entries or its waiting
    sessions' valuation change: after every kind of change (turns of sessions and
    requests without one, there or elsewhere, evictions by capacity and by the index's
    bound, blocks brought back, expiry, a new capacity, a backend's cache lost, the
    ticks), what it gives is what it computes with nothing kept."""
    fleet = Fleet([BackendSpec(n, frozenset({"m"}), kv_capacity_tokens=8192) for n in ("a", "b", "c")])
    r = Router(fleet, EstimatedTTFT(random.Random(1)), PrefixIndex(ttl_s=5.0, max_blocks=200))
    rng = random.Random(4)
    backends = list(r.fleet.backends.values())

    def check() -> None:
        kept = [r.kv_turnover(b) for b in backends]
        for w in r.sessions.waiting.values():
            w.turnover = None
        assert kept == [r.kv_turnover(b) for b in backends]

    now = 1.0
    for i in range(400):
        now += rng.choice((0.01, 0.3, 1.5))
        text = context(rng.randrange(12), turns=rng.randrange(1, 4)) + str(i % 3)
        if i % 4 == 3:  # no session, sent to one backend
            route(r, turn(text, subset=frozenset({backends[rng.randrange(3)].name})), now)
        else:
            route(r, turn(text, f"s{rng.randrange(12)}"), now)
        check()
        if i % 50 == 25:
            r.index.set_capacity(backends[i % 3].name, 16 * (1 + i % 2))
            check()
        if i % 60 == 30:
            r.index.expire(now + 4.0)
            check()
        if i % 70 == 35:
            r.forget_backend(backends[(i + 1) % 3].name)
            check()
    assert sum(b.evictions.evicted for b in r.index.backends.values()) > 0
    assert sum(b.evictions.refetched for b in r.index.backends.values()) > 0
    assert any(any(w.blocks[1:]) for w in r.sessions.waiting.values())
