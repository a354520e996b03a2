"""Reads backends' own Prometheus metrics to correct the load model's drift.

Every ``routing.scrape_interval_s`` seconds, ``GET {url}/metrics`` of each backend is
parsed with ``prometheus_client``'s parser. Recognised names (summed over label sets):

| quantity | vLLM | SGLang | llama.cpp |
|---|---|---|---|
| waiting requests | ``vllm:num_requests_waiting`` | ``sglang:num_queue_reqs`` | ``llamacpp:requests_deferred`` |
| running requests | ``vllm:num_requests_running`` | ``sglang:num_running_reqs`` | ``llamacpp:requests_processing`` |
| KV use (fraction) | ``vllm:kv_cache_usage_perc`` (``vllm:gpu_cache_usage_perc`` before v0.10) | ``sglang:token_usage`` | ``llamacpp:kv_cache_usage_ratio`` |
| KV capacity | ``vllm:cache_config_info{block_size, num_gpu_blocks}`` | ``sglang:max_total_num_tokens`` | |
| LoRA adapters at work | ``vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}`` | | |
| prefill seconds (counter) | ``vllm:request_prefill_time_seconds_sum`` | | ``llamacpp:prompt_seconds_total`` |
| prefilled tokens (counter) | ``vllm:prompt_tokens_total`` - ``vllm:prompt_tokens_cached_total`` | | ``llamacpp:prompt_tokens_total`` |

vLLM sets ``vllm:lora_requests_info`` to the time of each change under that change's
labels, so several series may be exported: the one with the latest value is current
(as the Gateway API Inference Extension's LoRA affinity scorer reads it).

The two counters give the engine's own prefill rate, which seeds and keeps teaching the
load model's TTFT fit (:meth:`routing.load.BackendLoad.observe_engine_prefill`). vLLM
counts a request's prompt tokens at its first token and its prefill time when it ends,
so one interval's rate is approximate; an engine without
``vllm:prompt_tokens_cached_total`` (before v0.11) has its prompt tokens counted whole,
prefix hits included, which overstates its rate where prompts share prefixes.
llama.cpp's ``llamacpp:prompt_tokens_total`` counts only the tokens it processed.

A backend that serves no ``/metrics`` (or none of these names) is simply not corrected;
samples older than three intervals are ignored by the load model.
"""  # noqa: E501 - a table, one row a line

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gateway.errors import reason
from routing.core import DecisionCore, EngineSample, LoraActivity

log = logging.getLogger("gateway.engine_signals.metrics_scraper")

WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "llamacpp:requests_deferred")
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs", "llamacpp:requests_processing")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage",
            "llamacpp:kv_cache_usage_ratio")
# counter sample names: (prefill seconds, prompt tokens, of which cached) per engine
PREFILL_COUNTERS = (("vllm:request_prefill_time_seconds_sum", "vllm:prompt_tokens_total",
                     "vllm:prompt_tokens_cached_total"),
                    ("llamacpp:prompt_seconds_total", "llamacpp:prompt_tokens_total", None))
PREFILL_NAMES = frozenset(n for names in PREFILL_COUNTERS for n in names if n)


@dataclass(slots=True)
class EngineMetrics:
    """What one scrape found (``None``: the backend does not export it)."""

    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    kv_capacity_tokens: int | None = None
    lora_running: frozenset[str] | None = None  # adapters of running requests (vLLM)
    lora_waiting: frozenset[str] = frozenset()
    max_lora: int | None = None
    prefill_s_total: float | None = None  # seconds spent in prefill since the engine started
    prefill_tokens_total: float | None = None  # uncached prompt tokens prefilled since then


def _names(labels: dict[str, str], key: str) -> frozenset[str]:
    return frozenset(n for n in labels.get(key, "").split(",") if n)


def parse_engine_metrics(text: str) -> EngineMetrics:
    """Extract the load-relevant values from a Prometheus text exposition.
    Raises ``ValueError`` on text the parser rejects."""
    m = EngineMetrics()
    sums: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        name = fam.name
        if name in WAITING or name in RUNNING or name in KV_USAGE:
            sums[name] = sum(s.value for s in fam.samples if s.name == name)
        elif name == "vllm:cache_config_info":
            for s in fam.samples:
                try:
                    m.kv_capacity_tokens = int(float(s.labels["num_gpu_blocks"]) * float(s.labels["block_size"]))
                except (KeyError, ValueError):
                    pass
        elif name == "vllm:lora_requests_info":
            latest = max((x for x in fam.samples if x.name == name), key=lambda x: x.value, default=None)
            if latest is not None:
                m.lora_running = _names(latest.labels, "running_lora_adapters")
                m.lora_waiting = _names(latest.labels, "waiting_lora_adapters")
                try:
                    m.max_lora = int(latest.labels["max_lora"])
                except (KeyError, ValueError):
                    m.max_lora = None
        elif name == "sglang:max_total_num_tokens":
            for s in fam.samples:
                m.kv_capacity_tokens = int(s.value)
        else:
            for s in fam.samples:  # counters and histogram sums: the sample names carry the suffix
                if s.name in PREFILL_NAMES:
                    sums[s.name] = sums.get(s.name, 0.0) + s.value
    for names, attr in ((WAITING, "waiting"), (RUNNING, "running"), (KV_USAGE, "kv_usage")):
        for n in names:
            if n in sums:
                setattr(m, attr, sums[n])
                break
    for seconds, tokens, cached in PREFILL_COUNTERS:
        if seconds in sums and tokens in sums:
            m.prefill_s_total = sums[seconds]
            m.prefill_tokens_total = sums[tokens] - (sums.get(cached, 0.0) if cached is not None else 0.0)
            break
    return m


class MetricsScraper:
    """Background scraping of every backend's ``/metrics`` into the decision core's load model."""

    def __init__(self, core: DecisionCore, clients: dict, interval_s: float) -> None:
        self.core = core
        self.clients = clients
        self.interval_s = interval_s
        self.ok: dict[str, bool] = {}

    async def scrape(self, client) -> None:
        name = client.state.name
        try:
            async with client.session.get(client.base_url + "/metrics",
                                          timeout=aiohttp.ClientTimeout(total=max(self.interval_s, 1.0))) as r:
                if r.status != 200:
                    raise ValueError(f"HTTP {r.status}")
                text = await r.text()
            m = parse_engine_metrics(text)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError, UnicodeDecodeError) as e:
            if self.ok.get(name, True):
                log.info("no engine metrics from backend %s (%s); its load is not drift-corrected", name, reason(e))
            self.ok[name] = False
            return
        self.ok[name] = True
        state = client.state
        if m.kv_capacity_tokens and (not state.load.kv_capacity_known or
                                     m.kv_capacity_tokens != state.load.kv_capacity_tokens):
            self.core.set_kv_capacity(state, m.kv_capacity_tokens)
        now = asyncio.get_running_loop().time()
        if m.lora_running is not None:
            self.core.set_lora_activity(state, LoraActivity(m.lora_running, m.lora_waiting, m.max_lora, now))
        if m.waiting is not None or m.running is not None or m.kv_usage is not None:
            state.load.observe_engine(EngineSample(now, m.waiting or 0.0, m.running or 0.0, m.kv_usage))
        if m.prefill_s_total is not None and m.prefill_tokens_total is not None:  # noqa: SIM102 - it records
            if state.load.observe_engine_prefill(now, m.prefill_s_total, m.prefill_tokens_total):
                log.info("the engine of backend %s restarted (its counters went back): its prefix entries "
                         "are dropped", name)
                self.core.backend_restarted(state)

    async def run(self) -> None:
        for c in self.clients.values():
            c.state.load.metrics_max_age_s = 3 * self.interval_s
        while True:
            await asyncio.gather(*(self.scrape(c) for c in self.clients.values()))
            await asyncio.sleep(self.interval_s)
