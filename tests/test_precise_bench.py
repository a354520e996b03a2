"""The precise prefix index in the offline replay and its benchmark harness
(``loadtest/precise_bench.py``, ``loadtest/replay.py`` with ``evidence``).

- with KV events the router's index holds what the engines hold: its predicted hits are
  the engines' reported ones, request by request, and its entries are the engines';
- the shared-prefix workload is what it says (tenants, lengths, rate);
- the harness runs a tiny slice of both workloads end to end and gives every row.
"""

from __future__ import annotations

import json

import pytest

from loadtest import precise_bench as pb
from loadtest import replay as rp
from loadtest.traces import TRACE_BLOCK_TOKENS, TRACES, TRACES_DIR, shared_prefix_trace

from tests.test_replay_oracle import sharing_trace, small_fleet


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


def test_shared_prefix_trace_has_one_system_prompt_per_tenant():
    reqs = shared_prefix_trace(tenants=5, requests=400, system_prompt_len=1024, question_len=600, rate=8.0, seed=3)
    systems = {tuple(r.hash_ids[:2]) for r in reqs}
    assert len(systems) == 5
    questions = [tuple(r.hash_ids[2:]) for r in reqs]
    assert len(set(questions)) == 400 and all(len(q) == 2 for q in questions)
    assert not set(h for s in systems for h in s) & set(h for q in questions for h in q)
    assert all(r.input_tokens == 1624 for r in reqs)
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    assert 399 / span == pytest.approx(8.0, rel=0.15)
    with pytest.raises(ValueError, match="multiple of 512"):
        shared_prefix_trace(system_prompt_len=1000)


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
