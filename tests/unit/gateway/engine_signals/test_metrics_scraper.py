"""Engine-metrics scraping: parsing the engines' names and what a backend's load takes
from them, without sockets (the gateway scraping a real /metrics endpoint:
``tests/integration/engine_signals/test_metrics_scraper.py``)."""

from __future__ import annotations

import pytest

from gateway.engine_signals.metrics_scraper import parse_engine_metrics
from routing.load import BackendLoad, EngineSample

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 5.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="1000"} 1.0
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1234.0
"""

SGLANG = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 7.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 2.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.5
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="m"} 65536.0
"""

LLAMACPP = """# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 1
"""


@pytest.mark.parametrize("text,expected", [
    (VLLM, (5.0, 3.0, 0.25, 16000)),
    (SGLANG, (2.0, 7.0, 0.5, 65536)),
    (LLAMACPP, (1.0, 2.0, None, None)),
    ("# nothing here\n", (None, None, None, None)),
])
def test_parse_engine_metrics(text, expected):
    m = parse_engine_metrics(text)
    assert (m.waiting, m.running, m.kv_usage, m.kv_capacity_tokens) == expected


def test_external_load_counts_only_fresh_samples():
    load = BackendLoad(kv_capacity_tokens=10_000, metrics_max_age_s=5.0)
    load.admit(uncached_tokens=1000, prompt_tokens=1000, output_tokens=10, now=0.0)
    load.observe_engine(EngineSample(at=1.0, waiting=4, running=2, kv_usage=0.5))
    # the engine holds 3 more waiting requests than the gateway sent, at ~1000 tokens each
    assert load.external_queued_tokens(now=2.0) == pytest.approx(3000)
    assert load.external_running(now=2.0) == 2
    assert load.kv_used_tokens(now=2.0) == pytest.approx(5000)
    # stale, so ignored
    assert load.external_queued_tokens(now=7.0) == 0
    assert load.kv_used_tokens(now=7.0) == pytest.approx(1000)


def test_parse_engine_prefill_counters():
    vllm = VLLM + """# TYPE vllm:prompt_tokens_cached_total counter
vllm:prompt_tokens_cached_total{engine="0",model_name="m"} 234.0
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_bucket{engine="0",le="0.3",model_name="m"} 3.0
vllm:request_prefill_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 4.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 0.5
"""
    m = parse_engine_metrics(vllm)
    assert (m.prefill_s_total, m.prefill_tokens_total) == (0.5, 1000.0)  # 1234 prompt tokens, 234 cached
    llamacpp = LLAMACPP + """# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 5000
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total 2.5
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds 2000
"""
    m = parse_engine_metrics(llamacpp)
    assert (m.prefill_s_total, m.prefill_tokens_total) == (2.5, 5000.0)
    m = parse_engine_metrics(VLLM)  # prompt tokens but no prefill time: no rate
    assert m.prefill_s_total is None and m.prefill_tokens_total is None
