"""The offline replay's cache-use rows and scenarios (``loadtest/replay.py``).

A small synthetic trace with heavy prefix sharing (12 documents of 2,048 tokens, each
request one document plus its own question) on a 2-backend fleet whose KV caches hold
about 12.8k tokens each, so that the documents do not all fit:

- the ``oracle`` row (``estimated_ttft`` told the engines' true cache contents) knows
  what it will hit (predicted = reported hits), never beats the ceiling, and hits more
  than ``estimated_ttft`` where the prefix index is short of information: two gateway
  replicas without a shared store, each seeing half the dispatches. (With one replica
  that knows the KV sizes the index is nearly exact on this trace and the two rows'
  hit ratios differ by a few points either way from seed to seed: the policy is greedy
  on TTFT, hits are not its objective, so "oracle >= estimated_ttft" is not a theorem.)
- the ceiling (:func:`loadtest.replay.ceiling_hit_ratio`) is what one engine with a
  huge cache and time to finish every request gets when replayed for real;
- ``restart`` empties the backend's cache and the router keeps requests off it while
  it is down; ``slow`` makes its requests' TTFT higher in the window;
  ``gateway_restart`` starts the router cold while the engines stay warm, and their
  prefill counters tell it at once which one is fast.

Virtual time, no sockets; about 12 s in all.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from loadtest import replay as rp
from loadtest.sim.engine import Engine
from loadtest.sim.profiles import PROFILES
from loadtest.traces import TraceRequest, request_tokens_and_text

DOCS = 12
DOC_BLOCKS = 4  # trace blocks of 512 tokens: 2,048 shared tokens per document


def sharing_trace(n: int = 240, rate: float = 4.0, seed: int = 7) -> list[TraceRequest]:
    """``n`` requests, Poisson arrivals at ``rate``/s: a document (Zipf-ish popularity)
    then a question of its own (100 to 400 tokens)."""
    rng = random.Random(seed)
    weights = [1.0 / (d + 1) for d in range(DOCS)]
    t = 0.0
    out = []
    for i in range(n):
        t += rng.expovariate(rate)
        d = rng.choices(range(DOCS), weights)[0]
        q = rng.randint(100, 400)
        ids = [1000 + d * 10 + b for b in range(DOC_BLOCKS)] + [100000 + i]
        out.append(TraceRequest(t, DOC_BLOCKS * 512 + q, rng.randint(20, 120), ids))
    return out


def small_fleet(n: int = 2, blocks: int = 800) -> list[rp.FleetMember]:
    prof = dataclasses.replace(PROFILES["a100-llama3-8b"], max_model_len=rp.MAX_MODEL_LEN, num_gpu_blocks=blocks)
    return [rp.FleetMember(f"b{i}", prof) for i in range(n)]


def summary(records: list[rp.Record]) -> dict:
    s = rp.summarize(records, 2.0, 0.1)
    assert s["completed"] == len(records)
    return s


def test_oracle_knows_what_it_hits_and_stays_under_the_ceiling():
    reqs = sharing_trace()
    ours = summary(rp.replay(reqs, "estimated_ttft", small_fleet()))
    oracle = summary(rp.replay(reqs, rp.ORACLE, small_fleet()))
    ceiling = rp.ceiling_hit_ratio(reqs)
    assert ours["hit_ratio"] > 0.5  # the trace shares heavily and the router uses it
    assert oracle["predicted_hit_ratio"] == pytest.approx(oracle["hit_ratio"], abs=0.01)
    assert oracle["hit_ratio"] <= ceiling
    assert ceiling > 0.8


@pytest.mark.parametrize("seed", [7, 8])
def test_oracle_hits_more_than_estimated_ttft_when_the_index_lacks_information(seed):
    reqs = sharing_trace(seed=seed)
    ours = summary(rp.replay(reqs, "estimated_ttft", small_fleet(), replicas=2, shared=False))["hit_ratio"]
    oracle = summary(rp.replay(reqs, rp.ORACLE, small_fleet(), replicas=2, shared=False))["hit_ratio"]
    assert ours + 0.03 <= oracle <= rp.ceiling_hit_ratio(reqs)


def test_replay_repeats_exactly_with_a_seed():
    reqs = sharing_trace(80)
    a = rp.replay(reqs, "estimated_ttft", small_fleet(), seed=3)
    b = rp.replay(reqs, "estimated_ttft", small_fleet(), seed=3)
    assert [(r.backend, r.first_token) for r in a] == [(r.backend, r.first_token) for r in b]


def test_ceiling_is_one_engine_with_an_infinite_cache():
    # spread the arrivals so that every request is done before the next one comes
    reqs = rp.scale_time(sharing_trace(120), 100.0)
    recs = rp.replay(reqs, "round_robin", small_fleet(1, blocks=200_000))
    assert summary(recs)["hit_ratio"] == pytest.approx(rp.ceiling_hit_ratio(reqs), abs=1e-12)
    # one finite LRU cache: less, and the same once it holds everything
    assert rp.ceiling_hit_ratio(reqs, capacity_blocks=10**7) == rp.ceiling_hit_ratio(reqs)
    assert rp.ceiling_hit_ratio(reqs, capacity_blocks=800) < rp.ceiling_hit_ratio(reqs)


def test_cached_prefix_tokens_is_what_admission_then_finds():
    prof = dataclasses.replace(PROFILES["a100-llama3-8b"], max_model_len=rp.MAX_MODEL_LEN)
    eng = Engine(prof)
    reqs = sharing_trace(3)
    first, _ = request_tokens_and_text(reqs[0], 0)
    eng.add_request("a", first, 4, arrival_time=0.0)
    t = 0.0
    while eng.has_work():
        dt, _ = eng.step(t)
        t += dt
    cached_before = eng.num_cached_blocks
    same_doc = TraceRequest(0.0, reqs[0].input_tokens + 50, 4, reqs[0].hash_ids[:DOC_BLOCKS] + [999999])
    tokens, _ = request_tokens_and_text(same_doc, 1)
    predicted = eng.cached_prefix_tokens(tokens)
    assert predicted == DOC_BLOCKS * 512
    assert eng.num_cached_blocks == cached_before  # read-only
    eng.add_request("b", tokens, 1, arrival_time=t)
    _, outs = eng.step(t)
    assert outs[0].num_cached_tokens == predicted


def test_oracle_is_not_a_gateway_policy():
    from routing import POLICIES, make_policy
    assert rp.ORACLE not in POLICIES
    with pytest.raises(KeyError):
        make_policy(rp.ORACLE)


def test_restart_empties_the_cache_and_the_router_waits_for_it():
    reqs = sharing_trace()
    fleet = small_fleet()
    scenario = rp.make_scenario("restart", reqs, fleet, backend="b0", duration_s=5.0)
    probe = TraceRequest(0.0, DOC_BLOCKS * 512 + 10, 1, [1000 + b for b in range(DOC_BLOCKS)] + [999999])
    probe_tokens, _ = request_tokens_and_text(probe, 0)
    seen: dict[str, tuple[int, int]] = {}

    def watch(phase: str, t: float, engines: dict[str, Engine]) -> None:
        e = engines["b0"]
        seen[phase] = (e.num_cached_blocks, e.cached_prefix_tokens(probe_tokens))

    recs = rp.replay(reqs, "estimated_ttft", fleet, scenario=scenario, watch=watch)
    blocks_before, doc_before = seen["restart_before"]
    blocks_after, doc_after = seen["restart_down"]
    assert blocks_before > 0 and doc_before > 0  # the hottest document was cached there
    assert blocks_after < blocks_before and doc_after < doc_before
    assert blocks_after == 0
    down = [r for r in recs if scenario.start <= r.arrival < scenario.end]
    assert down and all(r.backend != "b0" for r in down)  # health down: nothing sent to it
    later = [r for r in recs if r.arrival >= scenario.end + 15.0]  # past the breaker's 10 s, if it opened
    assert any(r.backend == "b0" for r in later)  # health up: it takes traffic again
    assert all(r.end is not None or r.error for r in recs)


def test_slow_window_slows_that_backend():
    reqs = sharing_trace()
    fleet = small_fleet()
    scenario = rp.make_scenario("slow", reqs, fleet, backend="b1", at=0.3, duration_s=20.0)
    speeds: dict[str, float] = {}

    def watch(phase: str, t: float, engines: dict[str, Engine]) -> None:
        speeds[phase] = engines["b1"].speed

    # round robin routes the same requests to b1 either way: compare their TTFT
    base = rp.replay(reqs, "round_robin", small_fleet())
    slow = rp.replay(reqs, "round_robin", fleet, scenario=scenario, watch=watch)
    assert speeds == {"slow_start": 0.1, "slow_end": 1.0}

    def window_ttft(recs: list[rp.Record]) -> float:
        xs = [r.first_token - r.arrival for r in recs
              if r.backend == "b1" and scenario.start <= r.arrival < scenario.end]
        assert len(xs) >= 10
        return sum(xs) / len(xs)

    assert window_ttft(slow) > 3 * window_ttft(base)
    phases = rp.scenario_phases(slow, scenario)
    assert phases["during"]["backend_ttft_mean_s"] > 3 * phases["before"]["backend_ttft_mean_s"]


def test_a_restarted_gateway_reads_the_warm_engines_and_sends_its_first_requests_to_the_fast_one():
    """``gateway_restart``: the gateway restarts cold at the midpoint, the engines keep
    running. With their prefill counters scraped, its first 20 requests all go to the
    H100; without, some go to the A100s first (7, 15 and 16 of 20 to the H100 when
    written)."""
    def fleet() -> list[rp.FleetMember]:
        return [rp.FleetMember(n, dataclasses.replace(PROFILES[p], max_model_len=rp.MAX_MODEL_LEN))
                for n, p in (("fast", "h100-llama3-8b"), ("slow1", "a100-llama3-8b"), ("slow2", "a100-llama3-8b"))]

    without = 0
    for seed in range(3):
        reqs = sharing_trace(400, rate=4.0, seed=seed)
        scenario = rp.make_scenario("gateway_restart", reqs, fleet(), duration_s=10.0)
        for engine_metrics in (True, False):
            recs = rp.replay(reqs, "estimated_ttft", fleet(), scenario=scenario, engine_metrics=engine_metrics,
                             seed=seed)
            s = rp.summarize(recs, 2.0, 0.1, cold_from=scenario.start)
            assert s["completed"] == len(reqs) and s["cold_start"]["requests"] == 100
            after = [r.backend for r in sorted(recs, key=lambda r: r.arrival) if r.arrival >= scenario.start][:20]
            if engine_metrics:
                assert after.count("fast") == 20, (seed, after)
            else:
                without += after.count("fast")
    assert without < 3 * 20
