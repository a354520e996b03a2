"""Exemplars (issue 33): a traced, sampled request's TTFT and end-to-end times carry its
trace id as exemplars of their histograms, which ``/metrics`` shows in the OpenMetrics
format when the scraper asks for it (``Accept: application/openmetrics-text``); the
classic text format otherwise. The gateway in-process, a scripted backend and an OTLP
receiver on 127.0.0.1; the exposition read with prometheus_client's OpenMetrics parser."""

from __future__ import annotations

import aiohttp
import openai
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from tests.support.otlp import OtlpReceiver, tracing_config
from tests.support.servers import ScriptedBackend, gateway_config, running_gateway

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
OPENMETRICS = "application/openmetrics-text; version=1.0.0,text/plain;version=0.0.4;q=0.5"
LATENCIES = ("turbo_gateway_ttft_seconds", "turbo_gateway_pool_ttft_seconds", "turbo_gateway_e2e_seconds")


async def _scrape(url: str, accept: str | None) -> tuple[str, str]:
    headers = {"Accept": accept} if accept is not None else {}
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics", headers=headers) as r:
        assert r.status == 200
        return r.headers["Content-Type"], await r.text()


def _exemplars(text: str) -> dict[str, list[tuple[str, float, dict[str, str]]]]:
    """Per histogram family: (the bucket's ``le``, the exemplar's value, its labels)."""
    out: dict[str, list[tuple[str, float, dict[str, str]]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.exemplar is not None:
                out.setdefault(fam.name, []).append((s.labels["le"], s.exemplar.value, s.exemplar.labels))
    return out


async def _chat(gw_url: str, traceparent: str | None, stream: bool) -> None:
    client = openai.AsyncOpenAI(base_url=gw_url + "/v1", api_key="x", max_retries=0)
    extra = {"traceparent": traceparent} if traceparent else {}
    answer = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=stream, extra_headers=extra)
    if stream:
        async for _ in answer:  # type: ignore[union-attr]
            pass
    await client.close()


@pytest.mark.parametrize("stream", [True, False])
async def test_a_sampled_request_is_the_exemplar_of_its_latency_buckets(stream):
    pytest.importorskip("opentelemetry.sdk.trace", reason="the otel extra (pip install -e '.[test]')")
    be, receiver = ScriptedBackend(), OtlpReceiver()
    async with receiver.running(), be.running():
        cfg = gateway_config([{"name": "b", "url": be.url, "models": ["m"]}], tracing=tracing_config(receiver))
        async with running_gateway(cfg) as gw:
            # an unsampled caller: counted, no exemplar
            await _chat(gw.url, f"00-{'1' * 32}-00f067aa0ba902b7-00", stream)
            _, before = await _scrape(gw.url, OPENMETRICS)
            await _chat(gw.url, f"00-{TRACE_ID}-00f067aa0ba902b7-01", stream)
            content_type, text = await _scrape(gw.url, OPENMETRICS)
            plain_type, plain = await _scrape(gw.url, None)
    assert _exemplars(before) == {}
    assert content_type.startswith("application/openmetrics-text") and "version=1.0.0" in content_type
    assert text.rstrip().endswith("# EOF")
    exemplars = _exemplars(text)
    assert sorted(exemplars) == sorted(LATENCIES)
    assert [s.kind for s in receiver.spans if s.parent == "00f067aa0ba902b7"] == [2]  # the request was traced
    for name in LATENCIES:
        (ex,) = exemplars[name]
        le, value, labels = ex
        assert labels == {"trace_id": TRACE_ID}
        assert value > 0
        bounds = [float(s.labels["le"]) for f in text_string_to_metric_families(text) if f.name == name
                  for s in f.samples if s.name.endswith("_bucket")]
        # the exemplar sits in the bucket its value falls in
        assert value <= float(le) and not any(b < float(le) and value <= b for b in bounds)
    ttft = exemplars["turbo_gateway_ttft_seconds"][0][1]
    assert ttft <= exemplars["turbo_gateway_e2e_seconds"][0][1]
    # the classic format, by default: the same histograms, no exemplar
    assert plain_type == "text/plain; version=0.0.4; charset=utf-8"
    assert 'turbo_gateway_ttft_seconds_count{api="chat",model="m"} 2.0' in plain and TRACE_ID not in plain


async def test_without_tracing_the_openmetrics_exposition_has_no_exemplar():
    be = ScriptedBackend()
    async with be.running():
        cfg = gateway_config([{"name": "b", "url": be.url, "models": ["m"]}])
        async with running_gateway(cfg) as gw:
            await _chat(gw.url, f"00-{TRACE_ID}-00f067aa0ba902b7-01", True)
            content_type, text = await _scrape(gw.url, OPENMETRICS)
    assert content_type.startswith("application/openmetrics-text")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    ttft_count = [s.value for s in families["turbo_gateway_ttft_seconds"].samples if s.name.endswith("_count")]
    assert ttft_count == [1.0]
    assert _exemplars(text) == {} and TRACE_ID not in text
