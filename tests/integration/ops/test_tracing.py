"""OpenTelemetry traces (issue 33): the gateway in-process, scripted backends and an OTLP/HTTP
receiver on 127.0.0.1 that decodes what the SDK's exporter sends (OTLP/JSON).

A streamed chat completion with one retry gives one trace: the server span (whose parent
is the caller's ``traceparent``), its admission, a route and a CLIENT span per attempt
(siblings), a relay span with the first token and the end as events; the backend
received a ``traceparent`` of the same trace, naming its attempt's span. No prompt,
completion or key in any span. Tracing off: test_tracing_off.py."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging

import openai
import pytest
from aiohttp import web

from tests.support.otlp import OtlpReceiver, children, strings, tracing_config
from tests.support.servers import ScriptedBackend, default_answer, gateway_config, running_gateway, sse_chunk

pytest.importorskip("opentelemetry.sdk.trace", reason="the otel extra (pip install -e '.[test]')")

KEY = "sk-tracing-secret-0123456789"
PROMPT = "a-very-private-prompt-about-penguins"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


async def test_a_streamed_chat_with_one_retry_is_one_trace_joined_to_the_caller_and_the_engine(caplog):
    calls = []

    async def first_fails(backend, request, body):
        calls.append(request.headers.get("traceparent"))
        if len(calls) == 1:
            return web.json_response({"error": {"message": "busy", "type": "server_error"}}, status=503)
        return await default_answer(backend, request, body)

    keys = {"keys": [{"name": "team-a", "key_sha256": hashlib.sha256(KEY.encode()).hexdigest()}]}
    a, b, receiver = ScriptedBackend(handler=first_fails), ScriptedBackend(handler=first_fails), OtlpReceiver()
    async with receiver.running(), a.running(), b.running():
        backends = [{"name": "a", "url": a.url, "models": ["m"]}, {"name": "b", "url": b.url, "models": ["m"]}]
        cfg = gateway_config(backends, auth=keys, tracing=tracing_config(receiver),
                             retries={"failed_backend_cooldown_s": 0})
        async with running_gateway(cfg) as gw:
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)
            with caplog.at_level(logging.INFO, logger="gateway"):
                stream = await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": PROMPT}], max_tokens=7, stream=True,
                    extra_headers={"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01", "tracestate": "vendor=x1",
                                   "x-request-id": "traced-1"})
                text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            await client.close()
        # the gateway's shutdown exported what was buffered
    assert text == "t0 t1 t2 "

    spans = [s for s in receiver.spans if s.trace_id == TRACE_ID]
    assert spans and len(spans) == len(receiver.spans)
    (root,) = [s for s in spans if s.parent == CALLER_SPAN]
    assert root.name == "POST /v1/chat/completions" and root.kind == 2  # SPAN_KIND_SERVER
    assert root.resource["service.name"] == "gw-under-test"
    assert root.attrs["gen_ai.operation.name"] == "chat" and root.attrs["gen_ai.request.model"] == "m"
    assert root.attrs["gen_ai.request.max_tokens"] == 7 and root.attrs["turbo.request.stream"] is True
    assert root.attrs["http.response.status_code"] == 200 and root.attrs["turbo.attempts"] == 2
    assert root.attrs["turbo.request_id"] == "traced-1" and root.attrs["gen_ai.response.id"] == "chatcmpl-test"
    assert root.attrs["gen_ai.usage.output_tokens"] == 3 and "gen_ai.usage.input_tokens" in root.attrs
    assert "turbo.key.name" not in root.attrs  # tracing.record_key_name is off
    assert root.status == 0  # unset: the request was answered

    kids = children(spans, root)
    assert [s.name for s in kids] == ["admission", "route", "chat m", "route", "chat m"]
    admission, route1, first, route2, second = kids
    assert admission.end <= route1.start
    assert {first.attrs["turbo.backend"], second.attrs["turbo.backend"]} == {"a", "b"}
    for route, attempt in ((route1, first), (route2, second)):
        assert route.attrs["turbo.route.backend"] == attempt.attrs["turbo.backend"]
        assert route.attrs["turbo.route.policy"] == "round_robin" and route.attrs["turbo.route.pool"] == "mixed"
        assert route.attrs["turbo.route.reason"] and route.attrs["turbo.route.evidence"]
        assert isinstance(route.attrs["turbo.route.matched_tokens"], int)
        assert attempt.kind == 3  # SPAN_KIND_CLIENT
        assert attempt.attrs["gen_ai.operation.name"] == "chat" and attempt.attrs["gen_ai.request.model"] == "m"
        assert attempt.attrs["server.address"] == "127.0.0.1" and attempt.attrs["server.port"] > 0
    assert first.attrs["turbo.attempt"] == 1 and second.attrs["turbo.attempt"] == 2
    assert first.status == 2 and first.attrs["error.type"] == "status_503"  # STATUS_CODE_ERROR
    assert first.attrs["http.response.status_code"] == 503 and children(spans, first) == []
    assert second.status == 0 and second.attrs["gen_ai.response.id"] == "chatcmpl-test"
    assert second.attrs["gen_ai.usage.output_tokens"] == 3 and first.end <= second.start

    (relay,) = children(spans, second)
    assert relay.name == "relay" and [e[0] for e in relay.events] == ["first_token", "end"]
    assert relay.events[0][1]["turbo.ttft_s"] > 0 and relay.events[1][1]["http.response.status_code"] == 200
    assert len(spans) == 7

    # each attempt told its backend its own span, in the caller's trace
    assert calls == [f"00-{TRACE_ID}-{first.span_id}-01", f"00-{TRACE_ID}-{second.span_id}-01"]
    sent = [h for be in (a, b) for h in be.headers]
    assert all({k.lower(): v for k, v in h.items()}.get("tracestate") == "vendor=x1" for h in sent)

    everything = " ".join(strings(spans))
    assert PROMPT not in everything and KEY not in everything and "t0" not in everything
    assert "team-a" not in everything

    # the log lines written while the request's span was current name it
    access = [r for r in caplog.records if r.name == "gateway.access" and "traced-1" in r.getMessage()]
    assert len(access) == 1 and access[0].trace_id == TRACE_ID and access[0].span_id == root.span_id
    from gateway.server.run import _JsonFormatter

    line = json.loads(_JsonFormatter().format(access[0]))
    assert (line["trace_id"], line["span_id"]) == (TRACE_ID, root.span_id)


async def test_a_refused_request_and_a_request_without_traceparent_start_their_own_traces():
    keys = {"keys": [{"name": "team-a", "key_sha256": hashlib.sha256(KEY.encode()).hexdigest()}]}
    be, receiver = ScriptedBackend(), OtlpReceiver()
    async with receiver.running(), be.running():
        cfg = gateway_config([{"name": "b", "url": be.url, "models": ["m"]}], auth=keys,
                             tracing=tracing_config(receiver, record_key_name=True))
        async with running_gateway(cfg) as gw:
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)
            with pytest.raises(openai.NotFoundError):
                await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": PROMPT}])
            answer = await client.completions.create(model="m", prompt=PROMPT, max_tokens=2)
            await client.close()
    assert answer.choices
    roots = [s for s in receiver.spans if s.parent == ""]
    assert len(roots) == 2 and len({s.trace_id for s in roots}) == 2
    refused = next(s for s in roots if s.name == "POST /v1/chat/completions")
    assert refused.attrs["http.response.status_code"] == 404 and refused.attrs["error.type"] == "model_not_found"
    assert refused.status == 2 and children(receiver.spans, refused) == []
    served = next(s for s in roots if s.name == "POST /v1/completions")
    assert served.attrs["gen_ai.operation.name"] == "text_completion" and served.attrs["turbo.key.name"] == "team-a"
    assert [s.name for s in children(receiver.spans, served)] == ["admission", "route", "text_completion m"]
    (attempt,) = [s for s in receiver.spans if s.kind == 3]
    (sent,) = [{k.lower(): v for k, v in h.items()} for h in be.headers]
    version, trace_id, parent, flags = sent["traceparent"].split("-")
    assert (version, trace_id, parent) == ("00", served.trace_id, attempt.span_id) and "tracestate" not in sent
    assert int(flags, 16) & 1  # sampled (0x02, a random trace id, may be set too)
    assert PROMPT not in " ".join(strings(receiver.spans)) and KEY not in " ".join(strings(receiver.spans))


async def test_an_unsampled_caller_gets_no_spans_but_its_backend_still_joins_its_trace():
    be, receiver = ScriptedBackend(), OtlpReceiver()
    async with receiver.running(), be.running():
        cfg = gateway_config([{"name": "b", "url": be.url, "models": ["m"]}], tracing=tracing_config(receiver))
        async with running_gateway(cfg) as gw:
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                 extra_headers={"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-00"})
            await client.close()
    assert receiver.spans == []
    (sent,) = [{k.lower(): v for k, v in h.items()} for h in be.headers]
    version, trace_id, parent, flags = sent["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", TRACE_ID, "00") and parent not in (CALLER_SPAN, "0" * 16)


async def test_sample_ratio_zero_traces_nothing_and_sends_an_unsampled_traceparent():
    be, receiver = ScriptedBackend(), OtlpReceiver()
    async with receiver.running(), be.running():
        cfg = gateway_config([{"name": "b", "url": be.url, "models": ["m"]}],
                             tracing=tracing_config(receiver, sample_ratio=0.0))
        async with running_gateway(cfg) as gw:
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
            for _ in range(3):
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            await client.close()
    assert receiver.spans == []
    flags = [int({k.lower(): v for k, v in h.items()}["traceparent"].split("-")[3], 16) for h in be.headers]
    assert len(flags) == 3 and not any(f & 1 for f in flags)  # not sampled


async def test_requests_are_served_while_the_collector_is_down(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "0.5")  # the export given up at shutdown, seconds
    be = ScriptedBackend()
    async with be.running():
        cfg = gateway_config([{"name": "b", "url": be.url, "models": ["m"]}],
                             tracing={"enabled": True, "endpoint": "http://127.0.0.1:9/v1/traces"})
        async with running_gateway(cfg) as gw:
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
            answers = await asyncio.gather(*(client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}]) for _ in range(5)))
            await client.close()
    assert [a.choices[0].message.content for a in answers] == ["hello"] * 5


async def test_the_prefill_leg_is_a_span_whose_attempt_sends_the_prefill_backend_its_traceparent():
    async def prefill(backend, request, body):
        return web.json_response({
            "id": "cmpl-prefill", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 1300, "completion_tokens": 1, "total_tokens": 1301},
            "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e1",
                                   "remote_block_ids": [1], "remote_host": "127.0.0.1", "remote_port": 5600}})

    pf, dc, receiver = ScriptedBackend(handler=prefill), ScriptedBackend(), OtlpReceiver()
    async with receiver.running(), pf.running(), dc.running():
        cfg = gateway_config(
            [{"name": "pf", "url": pf.url, "models": ["m"], "pool": "prefill"},
             {"name": "dc", "url": dc.url, "models": ["m"], "pool": "decode"}],
            pools=[{"name": "prefill", "role": "prefill"}, {"name": "decode", "role": "decode"}],
            routing={"long_prompt_tokens": 256, "scrape_interval_s": 0}, tracing=tracing_config(receiver))
        async with running_gateway(cfg) as gw:
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
            raw = await client.chat.completions.with_raw_response.create(
                model="m", max_tokens=4, messages=[{"role": "user", "content": PROMPT + " lorem ipsum" * 400}])
            await client.close()
    assert raw.headers["x-turbo-backend"] == "dc"
    (root,) = [s for s in receiver.spans if s.parent == ""]
    assert [s.name for s in children(receiver.spans, root)] == ["admission", "prefill", "route", "chat m"]
    leg = children(receiver.spans, root)[1]
    assert leg.attrs["turbo.prefill.outcome"] == "ok"
    route, attempt = children(receiver.spans, leg)
    assert route.name == "route" and (route.attrs["turbo.route.pool"], route.attrs["turbo.route.backend"]) == (
        "prefill", "pf")
    assert attempt.kind == 3 and attempt.attrs["turbo.backend"] == "pf" and attempt.attrs["turbo.leg"] == "prefill"
    decode = children(receiver.spans, root)[3]
    assert decode.attrs["turbo.backend"] == "dc" and decode.attrs["turbo.leg"] == "serve"
    for backend, span in ((pf, attempt), (dc, decode)):
        (sent,) = [{k.lower(): v for k, v in h.items()} for h in backend.headers]
        assert sent["traceparent"].split("-")[1:3] == [root.trace_id, span.span_id]
    assert PROMPT not in " ".join(strings(receiver.spans))


async def test_a_stream_that_breaks_after_its_first_event_ends_its_relay_span_with_the_error():
    async def breaks(backend, request, body):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse_chunk(0, "t0 "))
        await resp.write_eof()  # no `data: [DONE]`
        return resp

    be, receiver = ScriptedBackend(handler=breaks), OtlpReceiver()
    async with receiver.running(), be.running():
        cfg = gateway_config([{"name": "b", "url": be.url, "models": ["m"]}], tracing=tracing_config(receiver))
        async with running_gateway(cfg) as gw:
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
            stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                          stream=True)
            with pytest.raises(openai.APIError):
                async for _ in stream:
                    pass
            await client.close()
    (root,) = [s for s in receiver.spans if s.parent == ""]
    (attempt,) = [s for s in children(receiver.spans, root) if s.kind == 3]
    (relay,) = children(receiver.spans, attempt)
    assert attempt.status == 2 and attempt.attrs["error.type"] == "disconnected"
    assert [name for name, _ in relay.events] == ["first_token", "end"] and relay.status == 2
    assert relay.events[1][1]["error.type"] == "disconnected"
    assert root.status == 2 and root.attrs["http.response.status_code"] == 502
