"""Benchmark metrics (vLLM's definitions) against hand-computed examples."""

from __future__ import annotations

import math

import pytest

from loadtest.client import backend_load, gateway_info, parse_prometheus, policy_from_route
from loadtest.metrics import RequestRecord, meets_slo, parse_slo, percentile, summarize, summarize_groups


def test_percentile_interpolates_linearly_like_numpy():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 90) == pytest.approx(3.7)  # rank 0.9 * 3 = 2.7 -> 3 + 0.7 * (4 - 3)
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))


def _records() -> list[RequestRecord]:
    return [
        # usage reported: 4 output tokens, 100 prompt tokens, 50 cached
        RequestRecord(0, group="a", start_s=0.0, ttft_s=0.1, itl_s=[0.02, 0.03, 0.05], e2e_s=0.2, chunks=4,
                      output_tokens=4, prompt_tokens=100, cached_tokens=50, input_tokens_expected=99),
        # no usage: output = 2 text chunks, input = the workload's expectation (80)
        RequestRecord(1, group="a", start_s=0.5, ttft_s=0.3, itl_s=[0.1], e2e_s=0.4, chunks=2,
                      input_tokens_expected=80),
        # one output token: no TPOT (counts as 0 for goodput)
        RequestRecord(2, group="b", start_s=1.0, ttft_s=0.05, e2e_s=0.05, chunks=1, output_tokens=1, prompt_tokens=20,
                      cached_tokens=0),
        RequestRecord(3, group="b", start_s=1.2, status=503, error="http_503"),
        RequestRecord(4, group="b", start_s=1.3, error="timeout"),
    ]


def test_summary_matches_hand_computation():
    s = summarize(_records(), slo_ms={"ttft": 200, "tpot": 50})
    dur = 1.05  # first send (0.0) -> last completion (1.0 + 0.05)
    assert s["duration_s"] == pytest.approx(dur)
    assert (s["completed"], s["failed"], s["errors"]) == (3, 2, {"http_503": 1, "timeout": 1})
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (200, 7)
    assert s["request_throughput"] == pytest.approx(3 / dur)
    assert s["output_throughput"] == pytest.approx(7 / dur)
    assert s["total_token_throughput"] == pytest.approx(207 / dur)
    assert s["mean_ttft_ms"] == pytest.approx(150.0)
    assert s["median_ttft_ms"] == pytest.approx(100.0)
    # TPOT = (e2e - TTFT) / (output - 1): (0.2 - 0.1) / 3 and (0.4 - 0.3) / 1
    assert s["mean_tpot_ms"] == pytest.approx((100 / 3 + 100) / 2)
    assert s["p99_tpot_ms"] == pytest.approx(100 / 3 + (100 - 100 / 3) * 0.99)
    # ITL pooled over requests: 20, 30, 50, 100 ms
    assert s["mean_itl_ms"] == pytest.approx(50.0)
    assert s["median_itl_ms"] == pytest.approx(40.0)
    assert s["p90_itl_ms"] == pytest.approx(50 + 50 * 0.7)
    assert s["mean_e2el_ms"] == pytest.approx((200 + 400 + 50) / 3)
    # goodput: #0 (TTFT 100, TPOT 33) and #2 (TTFT 50, TPOT 0) meet TTFT <= 200 ms and TPOT <= 50 ms
    assert s["goodput"] == pytest.approx(2 / dur)
    assert s["slo_attainment"] == pytest.approx(2 / 5)
    # cache: (50 + 0) / (100 + 20) over the requests that report cached_tokens
    assert s["prefix_cache_hit_ratio"] == pytest.approx(50 / 120)
    assert s["cache_reporting_requests"] == 2


def test_groups_use_the_whole_run_duration():
    g = summarize_groups(_records())
    assert set(g) == {"a", "b"}
    assert g["a"]["completed"] == 2 and g["b"]["failed"] == 2
    assert g["a"]["duration_s"] == pytest.approx(1.05)
    assert g["a"]["request_throughput"] == pytest.approx(2 / 1.05)


def test_tpot_and_slo_edge_cases():
    r = RequestRecord(0, ttft_s=0.1, e2e_s=0.1, chunks=1)
    assert r.tpot_s is None and meets_slo(r, {"tpot": 1})
    assert not meets_slo(RequestRecord(1, error="timeout"), {"ttft": 1e9})
    assert meets_slo(RequestRecord(2, ttft_s=0.5, e2e_s=1.0, chunks=3), {"e2el": 1000}) is True
    assert meets_slo(RequestRecord(2, ttft_s=0.5, e2e_s=1.0, chunks=3), {"e2el": 999}) is False


def test_empty_and_all_failed_runs_do_not_crash():
    s = summarize([])
    assert s["completed"] == 0 and math.isnan(s["mean_ttft_ms"])
    s = summarize([RequestRecord(0, start_s=1.0, error="connect")])
    assert s["failed"] == 1 and s["prefix_cache_hit_ratio"] is None


def test_parse_slo_forms_and_errors():
    assert parse_slo("ttft_ms=500,tpot_ms=50") == {"ttft": 500.0, "tpot": 50.0}
    assert parse_slo("ttft:500 tpot:50 e2el:3000") == {"ttft": 500.0, "tpot": 50.0, "e2el": 3000.0}
    assert parse_slo(None) == {}
    for bad in ("ttft_ms", "itl_ms=5", "ttft_ms=x", "ttft_ms=0"):
        with pytest.raises(ValueError):
            parse_slo(bad)


METRICS_TEXT = """# HELP turbo_gateway_backend_in_flight Requests dispatched
# TYPE turbo_gateway_backend_in_flight gauge
turbo_gateway_backend_in_flight{backend="a"} 3.0
turbo_gateway_backend_in_flight{backend="b"} 0.0
turbo_gateway_backend_healthy{backend="a"} 1.0
turbo_gateway_backend_healthy{backend="b"} 1.0
turbo_gateway_backend_queued_prefill_tokens{backend="a"} 512.0
turbo_gateway_routing_decisions_total{policy="estimated_ttft",reason="lowest_ttft"} 7.0
turbo_gateway_ttft_seconds_bucket{le="0.005",model="m"} 1.0
"""


def test_gateway_metrics_parsing():
    samples = parse_prometheus(METRICS_TEXT)
    assert ("turbo_gateway_backend_in_flight", {"backend": "a"}, 3.0) in samples
    assert ("turbo_gateway_ttft_seconds_bucket", {"le": "0.005", "model": "m"}, 1.0) in samples
    assert backend_load(samples) == {"a": {"in_flight": 3.0, "queued_prefill_tokens": 512.0}, "b": {"in_flight": 0.0}}
    info = gateway_info(samples)
    assert info == {"backends": ["a", "b"], "policy": "estimated_ttft"}
    assert gateway_info(parse_prometheus("vllm:num_requests_running 1\n")) is None
    assert policy_from_route("policy=round_robin; backend=a; reason=rr") == "round_robin"
    assert policy_from_route(None) is None
