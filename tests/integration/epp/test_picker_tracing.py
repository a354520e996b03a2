"""Traces through the endpoint picker (issue 33), behind a real Envoy: the picker's spans
are the gateway's own (admission, route, the attempt, its relay), the caller's
``traceparent`` is their parent (or, when Envoy traces, the span of Envoy's ext_proc
call, carried in its gRPC metadata), and the backend joins the trace. The picker's and
Envoy's spans go to an OTLP receiver on 127.0.0.1 (the gateway's as JSON, Envoy's as
protobuf)."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.support.envoy import picker_stack
from tests.support.otlp import OtlpReceiver, Span, children, strings, tracing_config
from tests.support.servers import ScriptedBackend, gateway_config, wait_until

pytest.importorskip("opentelemetry.sdk.trace", reason="the otel extra (pip install -e '.[test]')")
pytestmark = pytest.mark.slow

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
PROMPT = "a-very-private-prompt-about-penguins"


async def _chat(url: str) -> str:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": PROMPT}], stream=True,
        extra_headers={"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01"})
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    await client.close()
    return text


def _picker_root(receiver: OtlpReceiver) -> Span:
    (root,) = [s for s in receiver.spans if s.resource.get("service.name") == "gw-under-test" and s.kind == 2]
    return root


def _check_tree(receiver: OtlpReceiver, root: Span, be: ScriptedBackend) -> Span:
    """The picker's span tree under ``root``; returns its attempt span."""
    assert root.trace_id == TRACE_ID and root.name == "POST /v1/chat/completions"
    assert root.attrs["http.response.status_code"] == 200 and root.attrs["gen_ai.response.id"] == "chatcmpl-test"
    kids = children(receiver.spans, root)
    assert [s.name for s in kids] == ["admission", "route", "chat m"]
    attempt = kids[2]
    assert attempt.kind == 3 and attempt.attrs["turbo.backend"] == "b"  # SPAN_KIND_CLIENT
    (relay,) = children(receiver.spans, attempt)
    assert relay.name == "relay" and [e[0] for e in relay.events] == ["first_token", "end"]
    assert PROMPT not in " ".join(strings(receiver.spans))
    (sent,) = [{k.lower(): v for k, v in h.items()} for h in be.headers]
    assert sent["traceparent"].split("-")[1] == TRACE_ID
    return attempt


async def test_the_pickers_spans_join_the_callers_trace_and_the_backend_gets_the_attempts_traceparent():
    be, receiver = ScriptedBackend(), OtlpReceiver()
    async with receiver.running(), be.running():
        cfg = gateway_config([{"name": "b", "url": be.url, "models": ["m"]}], tracing=tracing_config(receiver))
        async with picker_stack(cfg) as stack:
            assert await _chat(stack.url) == "t0 t1 t2 "
    root = _picker_root(receiver)
    assert root.parent == CALLER_SPAN
    attempt = _check_tree(receiver, root, be)
    (sent,) = [{k.lower(): v for k, v in h.items()} for h in be.headers]
    assert sent["traceparent"] == f"00-{TRACE_ID}-{attempt.span_id}-01"  # Envoy passed the picker's on


def _envoy_traces(receiver: OtlpReceiver) -> Any:
    """Turn Envoy's OpenTelemetry tracing on, every request sampled, exporting to ``receiver``."""
    port = int(receiver.url.split(":")[2].split("/")[0])

    def edit(boot: dict) -> None:
        hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["tracing"] = {"random_sampling": {"value": 100}, "provider": {
            "name": "envoy.tracers.opentelemetry",
            "typed_config": {"@type": "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig",
                             "service_name": "envoy-under-test",
                             "http_service": {"http_uri": {"uri": receiver.url, "cluster": "otlp", "timeout": "5s"}}}}}
        # each finished span is exported at once rather than on a 5 s timer in batches of 5
        # (Envoy's runtime keys), so that a loaded machine's test does not wait on a batch
        boot["layered_runtime"] = {"layers": [{"name": "static", "static_layer": {
            "tracing.opentelemetry.min_flush_spans": 1, "tracing.opentelemetry.flush_interval_ms": 200}}]}
        boot["static_resources"]["clusters"].append({
            "name": "otlp", "type": "STATIC", "connect_timeout": "1s",
            "load_assignment": {"cluster_name": "otlp", "endpoints": [{"lb_endpoints": [{"endpoint": {
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]}})

    return edit


async def test_when_envoy_traces_its_ext_proc_span_is_the_pickers_parent():
    be, receiver = ScriptedBackend(), OtlpReceiver()
    async with receiver.running(), be.running():
        cfg = gateway_config([{"name": "b", "url": be.url, "models": ["m"]}], tracing=tracing_config(receiver))
        async with picker_stack(cfg, bootstrap=_envoy_traces(receiver)) as stack:
            assert await _chat(stack.url) == "t0 t1 t2 "

            def envoy_exported() -> bool:
                return any(s.resource.get("service.name") == "envoy-under-test" for s in receiver.spans)

            await wait_until(envoy_exported, timeout_s=30)
    root = _picker_root(receiver)
    envoy_spans = {s.span_id: s for s in receiver.spans if s.resource.get("service.name") == "envoy-under-test"}
    assert all(s.trace_id == TRACE_ID for s in envoy_spans.values())
    # the picker's request span is a child of Envoy's ext_proc call, a descendant of the caller's span
    ext_proc = envoy_spans[root.parent]
    assert ext_proc.kind == 3 and "ExternalProcessor" in ext_proc.name
    ingress = ext_proc
    while ingress.parent in envoy_spans:
        ingress = envoy_spans[ingress.parent]
    assert ingress.parent == CALLER_SPAN
    _check_tree(receiver, root, be)
