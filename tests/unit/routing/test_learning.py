"""Routing that keeps learning (virtual time, routing/ only, no sockets): a backend that
was slow for a while is measured again and gets its share back, exploration stays
bounded, a cold fleet finds its fast backends, non-streamed answers teach speeds, and a
backend whose engine metrics stopped answering is uncertain, not idle."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from routing.core import BackendSpec, BackendState, DecisionCore, EngineSample, RouteRequest
from routing.load import BackendLoad
from routing.load.speed_fit import ERROR_MIN_SAMPLES, EstimateError
from routing.policies import Match
from routing.policies.estimated_ttft import PROBE_AFTER_S, estimate_ttft
from tests.unit.routing.test_router_model import VirtualFleet


def _prompt(rng: random.Random) -> str:
    return rng.randbytes(4000).hex()  # no prefix shared between requests


def test_a_backend_slow_for_a_while_gets_its_share_back():
    # two identical backends, light load: one alone could serve it all, so once "b" looks
    # slow, nothing but exploration sends it a request
    vf = VirtualFleet({"a": 20000.0, "b": 20000.0}, seed=0, decode_s=0.3)
    vf.rates["b"] = 2000.0  # slowed 10x for its first 20 requests
    rng = random.Random(0)
    names: list[str] = []
    restored_at = None
    for i in range(5000):  # 1,000 s: one probe per PROBE_AFTER_S while it looks slow
        names.append(vf.submit(_prompt(rng), i * 0.2))
        if restored_at is None and names.count("b") == 20:
            vf.rates["b"] = 20000.0
            restored_at = i
    assert restored_at is not None, "the slowed backend was never measured again"
    later = Counter(names[restored_at + 500:restored_at + 1500])  # 100 s after the restoration
    assert abs(later["a"] - later["b"]) <= 0.2 * max(later["a"], later["b"]), later


def test_exploration_of_a_truly_slow_backend_stays_bounded():
    vf = VirtualFleet({"a": 20000.0, "b": 2000.0}, seed=1, decode_s=0.3)
    for b in vf.fleet.backends.values():
        b.load = BackendLoad()  # no hints: both look alike at first
    rng = random.Random(1)
    n, gap = 3000, 0.2
    for i in range(n):
        vf.submit(_prompt(rng), i * gap)
    probes_at_most = n * gap / PROBE_AFTER_S + 5  # one per probe period, a few while it was being learned
    assert vf.assigned.count("b") <= probes_at_most, vf.assigned.count("b")


def test_a_cold_fleet_finds_its_fast_backends_within_50_requests():
    shares = []
    for seed in range(3):
        vf = VirtualFleet({"f1": 40000.0, "f2": 40000.0, "s1": 4000.0, "s2": 4000.0}, seed=seed, decode_s=0.3)
        for b in vf.fleet.backends.values():
            b.load = BackendLoad()  # no hints
        rng = random.Random(seed)
        for i in range(50):
            vf.submit(_prompt(rng), i * 0.02)
        shares.append((vf.prefill_tokens["f1"] + vf.prefill_tokens["f2"]) / sum(vf.prefill_tokens.values()))
    assert min(shares) >= 0.6, shares


def test_a_request_waiting_longer_than_predicted_says_the_backend_is_slower():
    core = DecisionCore([BackendSpec("b", frozenset({"m"}), prefill_tokens_per_s=10000.0)], "estimated_ttft")
    b = core.fleet.backends["b"]
    _, req = core.request("m", "x" * 40000, 10)
    _, res = core.route(req, 0.0)  # 10k tokens: about 1 s at the hinted rate
    probe = RouteRequest("m", prompt_tokens=1000, output_tokens=10)
    on_time = estimate_ttft(b, probe, Match.of(probe, 0.5))[0]
    # still no first token 5 s later: the backend is 5x slower than it was thought
    late = estimate_ttft(b, probe, Match.of(probe, 5.0))[0]
    assert late > 3 * on_time
    res.release(5.0)


def test_non_streamed_answers_teach_the_backends_speeds():
    core = DecisionCore([BackendSpec("fast", frozenset({"m"})), BackendSpec("slow", frozenset({"m"}))],
                        "round_robin")
    rates = {"fast": 20000.0, "slow": 4000.0}
    t = 0.0
    for i in range(40):
        _, req = core.request("m", f"{i} " + "x" * 4000 * (1 + i % 5), 16)
        d, res = core.route(req, t)
        total = 0.005 + req.prompt_tokens / rates[d.backend.name] + 15 * 0.02
        res.release(t + total, 16, whole=True)  # a whole answer: its first byte is its last
        t += 1.0
    fast, slow = core.fleet.backends["fast"].load, core.fleet.backends["slow"].load
    assert fast.ttft_fit.samples == slow.ttft_fit.samples == 20
    assert slow.ttft_fit.predict(4000) > 2 * fast.ttft_fit.predict(4000)  # 4.9x in truth, 1x unlearned
    assert fast.itl_fit.samples == slow.itl_fit.samples == 20


def test_stale_engine_metrics_count_as_uncertain_not_idle():
    core = DecisionCore([BackendSpec("b", frozenset({"m"}), prefill_tokens_per_s=10000.0)], "estimated_ttft")
    load = core.fleet.backends["b"].load
    load.metrics_max_age_s = 6.0
    req = RouteRequest("m", prompt_tokens=1000, output_tokens=10)
    load.observe_engine(EngineSample(0.0, waiting=0.0, running=0.0, kv_usage=0.0))  # "idle", then silence
    fresh = estimate_ttft(core.fleet.backends["b"], req, Match.of(req, 1.0))[0]
    stale = estimate_ttft(core.fleet.backends["b"], req, Match.of(req, 30.0))[0]
    assert stale == 2 * fresh  # counted up to twice while its metrics are stale
    assert load.metrics_staleness(30.0) == 1.0 and load.metrics_staleness(1.0) == 0.0


def _lifetime_counters(rate: float, tokens: float = 2e6) -> tuple[float, float]:
    """An engine's prefill counters (seconds, uncached tokens) after it prefilled
    ``tokens`` at ``rate`` tokens/s."""
    return tokens / rate, tokens


def _cold_fleet_first_requests(engine_metrics: bool, seed: int, n: int = 20) -> list[str]:
    rates = {"f1": 40000.0, "f2": 40000.0, "s1": 4000.0, "s2": 4000.0}
    vf = VirtualFleet(rates, seed=seed, decode_s=0.3)
    for name, b in vf.fleet.backends.items():
        b.load = BackendLoad()  # no hints
        if engine_metrics:  # the scraper's first sample, before any request
            b.load.observe_engine_prefill(0.0, *_lifetime_counters(rates[name]))
    rng = random.Random(seed)
    for i in range(n):
        vf.submit(_prompt(rng), 0.1 + i * 0.02)
    return vf.assigned


def test_a_cold_fleet_whose_engines_show_their_rates_sends_its_first_requests_to_the_fast_pair():
    for seed in range(3):
        first = _cold_fleet_first_requests(True, seed)
        fast = sum(1 for n in first if n.startswith("f"))
        assert fast == 20, (seed, first)  # all of the first 20


def test_a_cold_fleet_without_engine_metrics_tries_its_slow_pair_first():
    # the reference of the test above: with nothing known, the slow pair gets some of
    # the first requests (2 or 3 of 20) before their waits tell it apart
    for seed in range(3):
        first = _cold_fleet_first_requests(False, seed)
        assert any(n.startswith("s") for n in first[:6]), (seed, first)


def test_engine_prefill_rate_seeds_a_backend_and_teaches_it_while_it_gets_no_traffic():
    load = BackendLoad()
    load.observe_engine_prefill(10.0, 0.0, 0.0)  # an engine that has prefilled nothing says nothing
    assert load.prior_from == "default" and load.engine_prefill_tokens_per_s is None
    load.observe_engine_prefill(12.0, 5.0, 50_000.0)  # 10k tokens/s since it started
    assert load.prior_from == "engine" and load.ttft_fit.samples == 0
    assert load.prefill_tokens_per_s == pytest.approx(10_000.0)
    load.observe_ttft(2000.0, 0.02 + 2000.0 / 10_000.0, now=13.0)  # a request of ours
    load.observe_engine_prefill(14.0, 6.0, 60_000.0)  # ours came since the last scrape: not taught
    assert load.ttft_fit.samples == 1
    load.observe_engine_prefill(16.0, 6.5, 70_000.0)  # none of ours since: 20k tokens/s is taught
    assert load.ttft_fit.samples == 2 and load.engine_prefill_tokens_per_s == pytest.approx(20_000.0)
    load.observe_engine_prefill(18.0, 1.0, 5_000.0)  # counters went back: the engine restarted
    assert load.engine_prefill_tokens_per_s == pytest.approx(5_000.0)
    for bad in (float("nan"), -1.0, float("inf")):
        load.observe_engine_prefill(20.0, bad, 1000.0)  # ignored, not a crash
    assert load.engine_prefill_tokens_per_s == pytest.approx(5_000.0)


def test_a_hint_outranks_the_engine_rate_as_the_prior():
    load = BackendLoad(prefill_tokens_per_s=10_000.0)
    load.observe_engine_prefill(0.0, *_lifetime_counters(30_000.0))
    assert load.prior_from == "hint" and load.ttft_fit.prior_slope == pytest.approx(1 / 10_000.0)
    assert load.ttft_fit.samples == 1  # the engine's rate is a sample instead
    assert 10_000.0 < load.prefill_tokens_per_s < 30_000.0


def test_an_engine_rate_below_the_fit_teaches_nothing():
    # requests prefilled together each count their shared steps: the engine's rate is a
    # lower bound, and a lower bound below the estimate says nothing new
    load = BackendLoad(prefill_tokens_per_s=30_000.0)
    load.observe_engine_prefill(0.0, *_lifetime_counters(10_000.0))
    assert load.ttft_fit.samples == 0 and load.prefill_tokens_per_s == pytest.approx(30_000.0)


def test_a_new_backend_starts_from_its_pool_peers_speed():
    vf = VirtualFleet({"a": 20000.0, "b": 20000.0}, seed=0, decode_s=0.3)
    for b in vf.fleet.backends.values():
        b.load = BackendLoad()  # no hints
    rng = random.Random(0)
    for i in range(40):
        vf.submit(_prompt(rng), i * 0.2)
    new = BackendState(BackendSpec("c", frozenset({"m"}), weight=2.0))  # a scale-out, twice as big
    vf.fleet.backends["c"] = new
    vf.router.refresh_speeds(10.0)
    peers = sorted(1.0 / b.load.ttft_fit.slope for n, b in vf.fleet.backends.items() if n != "c")
    assert new.load.prior_from == "peers"
    assert new.load.prefill_tokens_per_s == pytest.approx(2 * peers[0], rel=1e-6)


def _engine_counters_after(counters: dict[str, list[float]], name: str, rate: float, tokens: float) -> tuple:
    c = counters[name]
    c[0] += tokens / rate
    c[1] += tokens
    return tuple(c)


def test_a_backend_without_our_traffic_whose_engine_got_faster_wins_traffic_back():
    """Two identical backends; "b" is slow from 20 s to 80 s of virtual time, then as
    fast as before. Its engine serves other clients all along, so its metrics show its
    prefill rate. While slow it gets none of our traffic; once its metrics show it fast
    again it gets its share back within a few scrapes, without waiting for the next
    silence probe (one every 30 s while it looks slow)."""
    def run(engine_metrics: bool) -> tuple[list[str], list[str], list[float]]:
        vf = VirtualFleet({"a": 20000.0, "b": 20000.0}, seed=0, decode_s=0.3)
        for b in vf.fleet.backends.values():
            b.load = BackendLoad()
        counters = {"a": [0.0, 0.0], "b": [0.0, 0.0]}
        rng = random.Random(0)
        times = []
        for i in range(600):  # 120 s, a request every 0.2 s
            t = i * 0.2
            if t == 20.0:
                vf.rates["b"] = 2000.0
            elif t == 80.0:
                vf.rates["b"] = 20000.0
            if engine_metrics and i % 10 == 0:  # a scrape every 2 s; others' traffic: 10k tokens per interval
                for name, b in vf.fleet.backends.items():
                    b.load.observe_engine_prefill(t, *_engine_counters_after(counters, name, vf.rates[name], 1e4))
            vf.submit(_prompt(rng), t)
            times.append(t)
        return vf.assigned, vf.reasons, times

    names, _reasons, times = run(True)
    slow = [n for n, t in zip(names, times) if 30.0 <= t < 80.0]
    assert slow.count("b") <= 2, slow.count("b")  # starved but for its silence probes
    after = [n for n, t in zip(names, times) if 80.0 <= t < 90.0]
    assert after.count("b") >= 10, after  # of 50, within 10 s (5 scrapes): 15 when written
    # without engine metrics, the same 10 s give it at most a probe
    names, _reasons, times = run(False)
    assert [n for n, t in zip(names, times) if 80.0 <= t < 90.0].count("b") <= 1


def test_a_cold_replica_starts_from_what_another_replica_learned():
    # the shared store's RemoteLoad.speeds: (prefill tokens/s, overhead s, ITL base s, ITL per stream s, samples)
    load = BackendLoad()
    load.remote.speeds = [(30_000.0, 0.01, 0.015, 0.0002, 200)]
    assert load.prefill_tokens_per_s == pytest.approx((2 * 8000.0 + 200 * 30_000.0) / 202)  # its 2 prior samples
    load.observe_engine_prefill(0.0, *_lifetime_counters(25_000.0))  # its engine's rate seeds its own prior
    assert load.prefill_tokens_per_s == pytest.approx((2 * 25_000.0 + 200 * 30_000.0) / 202)


def test_the_estimate_error_is_the_spread_of_the_log_ratio_and_needs_samples():
    err = EstimateError()
    for _ in range(ERROR_MIN_SAMPLES - 1):
        err.add(2.0, 2.0)
    assert err.sigma == 0.0  # too few samples to say
    for i in range(300):  # estimates twice too high and twice too low, alternately
        err.add(1.0, 2.0 if i % 2 else 0.5)
    assert err.sigma == pytest.approx(math.log(2.0), rel=0.05)
    assert abs(err.mean) < 0.05
    before = (err.mean, err.var, err.samples)
    err.add(0.0, 1.0)
    err.add(1.0, -1.0)  # nothing to compare: ignored
    assert (err.mean, err.var, err.samples) == before
    exact = EstimateError()
    for _ in range(50):
        exact.add(0.3, 0.3)
    assert exact.sigma == 0.0 and exact.samples == 50


def test_a_routed_streams_first_token_teaches_its_backend_how_far_the_estimate_was():
    core = DecisionCore([BackendSpec("a", frozenset({"m"}))], "estimated_ttft")
    req = RouteRequest("m", prompt_tokens=4000, output_tokens=16, stream=True)
    decision, res = core.route(req, 10.0)
    est = decision.detail["ttft_est_s"]
    res.first_token(10.0 + 3 * est)  # three times what the policy estimated
    err = core.fleet.backends["a"].load.estimate_error
    assert err.samples == 1 and err.mean == pytest.approx(math.log(3.0))
    res.release(11.0)
