"""The precise prefix index in the offline replay and its benchmark harness
(``loadtest/precise_bench.py``, ``loadtest/replay.py`` with ``evidence``).

- with KV events the router's index holds what the engines hold: its predicted hits are
  the engines' reported ones, request by request, and its entries are the engines';
- the shared-prefix workload is what it says (tenants, lengths, rate);
- a direct client's request (``direct_backend``) is served by its engine, never enters
  the approximate index and enters the precise one through that engine's KV events;
  the gateway's metrics leave it out;
- the harness runs a tiny slice of both workloads end to end and gives every row.
"""

from __future__ import annotations

import json

import pytest

from loadtest import precise_bench as pb
from loadtest import replay as rp
from loadtest.traces import TRACE_BLOCK_TOKENS, TRACES, TRACES_DIR, TraceRequest, shared_prefix_trace
from tests.unit.loadtest.test_replay_oracle import sharing_trace, small_fleet


def test_with_kv_events_the_router_predicts_what_the_engines_report_better_than_without():
    reqs = sharing_trace(n=120)
    fleet = small_fleet()  # 800 blocks each: prefixes are evicted
    cpu: dict[str, float] = {}
    precise = rp.replay(reqs, "estimated_ttft", fleet, evidence=rp.PRECISE, cpu=cpu)
    approximate = rp.replay(reqs, "estimated_ttft", fleet)
    assert all(r.end is not None for r in precise)
    assert sum(1 for r in precise if r.cached_tokens) > len(reqs) / 2
    # exact but for blocks evicted or stored between dispatch and the engine's admission
    assert sum(1 for r in precise if r.predicted_cached == r.cached_tokens) > 0.9 * len(reqs)

    def error(recs: list[rp.Record]) -> float:
        return sum(abs(r.predicted_cached - r.cached_tokens) for r in recs)

    assert error(precise) < error(approximate)
    assert cpu["kv_events_s"] > 0 and cpu["route_s"] > 0


def test_without_kv_events_nothing_is_decoded_and_the_approximate_index_decides():
    reqs = sharing_trace(n=60)
    cpu: dict[str, float] = {}
    recs = rp.replay(reqs, "estimated_ttft", small_fleet(), cpu=cpu)
    assert cpu["kv_events_s"] == 0.0
    assert sum(r.cached_tokens for r in recs) > 0


def test_unknown_evidence_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown evidence 'exact'"):
        rp.replay(sharing_trace(n=2), "estimated_ttft", small_fleet(), evidence="exact")


def direct_then_gateway() -> list[TraceRequest]:
    """Three requests of a direct client to b1 with one 2,048-token prefix (and a
    question of their own), then one through the gateway with the same prefix; 10 s
    apart, so each is finished (and its events published) before the next arrives."""
    prefix = [500, 501, 502, 503]
    reqs = [TraceRequest(10.0 * k, 4 * 512 + 100, 8, prefix + [900 + k], direct_backend="b1") for k in range(3)]
    return reqs + [TraceRequest(30.0, 4 * 512 + 100, 8, prefix + [999])]


def test_direct_requests_reach_their_engine_and_only_events_tell_the_router():
    reqs = direct_then_gateway()
    approximate = rp.replay(reqs, "estimated_ttft", small_fleet())
    precise = rp.replay(reqs, "estimated_ttft", small_fleet(), evidence=rp.PRECISE)
    for recs in (approximate, precise):
        assert [r.direct for r in recs] == [True, True, True, False]
        assert all(r.end is not None and r.error is None for r in recs)
        # the direct client's repeats hit on its engine; the router predicted nothing for them
        assert [r.cached_tokens for r in recs[:3]] == [0, 4 * 512, 4 * 512]
        assert all(r.predicted_cached == 0.0 for r in recs[:3])
    # the approximate index never saw the prefix: it predicts no hit wherever it routes
    assert approximate[3].predicted_cached == 0.0
    # b1's events put the prefix in the precise index, under b1 only: routed there, hit as predicted
    assert precise[3].backend == "b1"
    assert precise[3].cached_tokens == 4 * 512
    assert precise[3].predicted_cached == precise[3].cached_tokens


def test_the_gateways_metrics_leave_the_direct_clients_out():
    recs = rp.replay(direct_then_gateway(), "estimated_ttft", small_fleet(), evidence=rp.PRECISE)
    gateway = rp.summarize(recs, 2.0, 0.1)
    direct = rp.summarize(recs, 2.0, 0.1, direct=True)
    assert (gateway["requests"], direct["requests"]) == (1, 3)
    assert direct["hit_ratio"] == pytest.approx(2 * 4 * 512 / (3 * (4 * 512 + 100)))
    assert gateway["hit_ratio"] == pytest.approx(4 * 512 / (4 * 512 + 100))
    assert rp.ceiling_hit_ratio(direct_then_gateway()) == pytest.approx(gateway["hit_ratio"])
    with pytest.raises(ValueError, match="no direct clients requests"):
        rp.summarize(recs[3:], 2.0, 0.1, direct=True)


def test_a_direct_backend_outside_the_fleet_is_a_clear_error():
    reqs = [TraceRequest(0.0, 600, 4, [1, 2], direct_backend="b9")]
    with pytest.raises(ValueError, match=r"direct_backend b9 not in the fleet \(b0, b1\)"):
        rp.replay(reqs, "estimated_ttft", small_fleet())


def test_shared_prefix_trace_has_one_system_prompt_per_tenant():
    reqs = shared_prefix_trace(tenants=5, requests=400, system_prompt_len=1024, question_len=600, rate=8.0, seed=3)
    systems = {tuple(r.hash_ids[:2]) for r in reqs}
    assert len(systems) == 5
    questions = [tuple(r.hash_ids[2:]) for r in reqs]
    assert len(set(questions)) == 400 and all(len(q) == 2 for q in questions)
    assert not {h for s in systems for h in s} & {h for q in questions for h in q}
    assert all(r.input_tokens == 1624 for r in reqs)
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    assert 399 / span == pytest.approx(8.0, rel=0.15)
    with pytest.raises(ValueError, match="multiple of 512"):
        shared_prefix_trace(system_prompt_len=1000)


def test_direct_clients_workload_pins_its_own_tenants_to_one_engine_each():
    args = pb.build_parser().parse_args(["--tenants", "12", "--direct-tenants", "8", "--shared-requests", "400",
                                         "--system-prompt-len", "1024", "--question-len", "600", "--seed", "4"])
    fleet = rp.make_fleet()
    reqs = pb.direct_clients_trace(args, 8.0, fleet)
    direct = [r for r in reqs if r.direct_backend is not None]
    gateway = [r for r in reqs if r.direct_backend is None]
    assert (len(direct), len(gateway)) == (100, 300)
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    assert 399 / (reqs[-1].arrival_s - reqs[0].arrival_s) == pytest.approx(8.0, rel=0.15)
    # the gateway's part is the shared-prefix workload at its share of the rate
    assert gateway == shared_prefix_trace(12, 300, 1024, 600, 128, 6.0, 4)
    tenants = {tuple(r.hash_ids[:2]): set() for r in direct}
    for r in direct:
        tenants[tuple(r.hash_ids[:2])].add(r.direct_backend)
    assert len(tenants) == 8 and all(len(b) == 1 for b in tenants.values())
    # spread evenly over the engines, regardless of their speed: 2 tenants each
    assert sorted(b for engines in tenants.values() for b in engines) == sorted(2 * [m.name for m in fleet])
    assert not {h for r in direct for h in r.hash_ids} & {h for r in gateway for h in r.hash_ids}
    args.direct_share = 1.0
    with pytest.raises(ValueError, match="direct_share 1 of 400 requests"):
        pb.direct_clients_trace(args, 8.0, fleet)


def test_the_benchmark_reports_the_gateways_and_the_direct_clients_requests_apart(tmp_path):
    out = tmp_path / "rows.json"
    assert pb.main(["--jobs", "1", "--workload", pb.DIRECT_CLIENTS, "--shared-requests", "80", "--tenants", "6",
                    "--direct-tenants", "4", "--system-prompt-len", str(2 * TRACE_BLOCK_TOKENS),
                    "--question-len", "300", "--rate", "4", "--tokenize-sample", "5", "--mode", "approximate",
                    "--mode", "precise", "--mode", rp.ORACLE, "--json", str(out)]) == 0
    (block,) = json.loads(out.read_text()).values()
    assert list(block["rows"]) == ["approximate", "precise", rp.ORACLE]
    for label, s in block["rows"].items():
        assert (s["requests"], s["direct"]["requests"]) == (60, 20), label
        assert s["completed"] == 60 and s["direct"]["completed"] == 20
        assert s["direct"]["hit_ratio"] > 0  # pinned tenants repeat their system prompt on their engine
    oracle = block["rows"][rp.ORACLE]
    assert oracle["predicted_hit_ratio"] == pytest.approx(oracle["hit_ratio"], abs=0.01)
    with pytest.raises(SystemExit):
        pb.main(["--live", "--mode", rp.ORACLE])


@pytest.mark.slow
def test_the_benchmark_runs_a_tiny_slice_of_both_workloads_end_to_end(tmp_path):
    if not (TRACES_DIR / TRACES["mooncake_conversation"][0]).exists():
        pytest.skip(f"the Mooncake traces are not in {TRACES_DIR} (set TG_TRACES_DIR)")
    out = tmp_path / "rows.json"
    assert pb.main(["--jobs", "1", "--conversation-requests", "40", "--shared-requests", "60", "--tenants", "6",
                    "--system-prompt-len", str(4 * TRACE_BLOCK_TOKENS), "--question-len", "300", "--rate", "4",
                    "--json", str(out)]) == 0
    blocks = json.loads(out.read_text())
    assert len(blocks) == 2
    for title, block in blocks.items():
        rows, ref = block["rows"], block["reference"]
        assert list(rows) == list(pb.MODES)
        assert 0 < ref["pooled"] <= ref["ceiling"] + 1e-9
        assert block["tokenize"]["tokenize_us"] > 0 and block["tokenize"]["tokens"] > 0
        for label, s in rows.items():
            assert s["completed"] == s["requests"], (title, label)
            assert s["hit_ratio"] <= ref["ceiling"] + 1e-9
            assert (s["kv_events_s"] > 0) == (label != "approximate")
        assert rows["precise"]["predicted_hit_ratio"] == pytest.approx(rows["precise"]["hit_ratio"], abs=0.02)
    shared = next(b for t, b in blocks.items() if t.startswith("shared_prefix"))
    assert shared["rows"]["precise"]["hit_ratio"] > 0.3


def test_precise_cost_applies_the_replays_router_inputs_again(tmp_path):
    from loadtest.precise_cost import apply, capture

    path = str(tmp_path / "inputs.pickle")
    n = capture("shared_prefix", 6.0, path, requests=40)
    first, again = apply(path, "all", 1), apply(path, "all", 1)
    assert n == first["requests"] == 40
    assert first["digest"] == again["digest"] and first["counts"] == again["counts"]  # the code alone decides
    assert sum(p for p, _ in first["counts"].values()) > 0  # the engines' events were applied
    kv_only = apply(path, "kv", 1)
    assert kv_only["route_us"] == 0 and all(s == 0 for _, s in kv_only["counts"].values())  # nothing dispatched
