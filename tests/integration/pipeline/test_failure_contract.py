"""The streaming and failure contract, over real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest
from aiohttp import web
from multidict import CIMultiDict

from tests.support.servers import (
    ScriptedBackend,
    free_port,
    gateway_config,
    running_gateway,
    sse_chunk,
    wait_until,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def post(url: str, body: dict | bytes, **kw) -> tuple[int, CIMultiDict[str], bytes]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    headers = kw.pop("headers", {"Content-Type": "application/json"})
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", data=data, headers=headers, **kw) as r:
            return r.status, r.headers.copy(), await r.read()


async def test_refused_backend_is_retried_elsewhere():
    dead = f"http://127.0.0.1:{free_port()}"
    async with ScriptedBackend().running() as good:
        cfg = gateway_config([{"name": "dead", "url": dead, "models": ["m"]},
                              {"name": "good", "url": good.url, "models": ["m"]}])
        async with running_gateway(cfg) as gw:
            # round robin starts with `dead`: the first request must fail over
            for stream in (False, True):
                status, headers, body = await post(gw.url, {**CHAT, "stream": stream})
                assert status == 200, body
                assert headers["x-turbo-backend"] == "good"
            assert gw.metric("turbo_gateway_retries_total", reason="connect") >= 1
            assert gw.metric("turbo_gateway_upstream_errors_total", backend="dead", reason="connect") >= 1
            assert gw.idle("dead") and gw.idle("good")


async def test_429_retry_after_is_honoured():
    async def answer(b: ScriptedBackend, request: web.Request, body: dict) -> web.StreamResponse:
        if len(b.attempt_times) == 1:
            return web.json_response({"error": {"message": "slow down", "type": "rate_limit_error"}},
                                     status=429, headers={"Retry-After": "1"})
        return web.json_response({"id": "x", "object": "chat.completion", "choices": []})

    async with ScriptedBackend(handler=answer).running() as be:
        cfg = gateway_config([{"name": "only", "url": be.url, "models": ["m"]}])
        async with running_gateway(cfg) as gw:
            status, _, body = await post(gw.url, CHAT)
            assert status == 200, body
            assert len(be.attempt_times) == 2
            assert be.attempt_times[1] - be.attempt_times[0] >= 1.0
            assert gw.metric("turbo_gateway_retries_total", reason="status_429") == 1
            assert gw.idle("only")


async def test_429_exhausted_is_relayed_with_retry_after():
    async def answer(b, request, body):
        return web.json_response({"error": {"message": "busy", "type": "rate_limit_error", "param": None,
                                            "code": None}}, status=429, headers={"Retry-After": "30"})

    async with ScriptedBackend(handler=answer).running() as be:
        cfg = gateway_config([{"name": "only", "url": be.url, "models": ["m"]}])
        async with running_gateway(cfg) as gw:
            status, headers, body = await post(gw.url, CHAT)
            # Retry-After 30 s exceeds max_retry_after_s (10): no waiting, the 429 is passed on
            assert status == 429
            assert headers["Retry-After"] == "30"
            assert orjson.loads(body)["error"]["message"] == "busy"
            assert len(be.attempt_times) == 1
            assert gw.idle("only")


async def test_failure_after_first_bytes_ends_stream_with_error_event():
    sent: list[bytes] = []

    async def answer(b, request, body):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            chunk = sse_chunk(i, f"t{i}")
            sent.append(chunk)
            await resp.write(chunk)
        await asyncio.sleep(0.05)
        request.transport.close()  # die without finishing the chunked body
        return resp

    async with ScriptedBackend(handler=answer).running() as be:
        cfg = gateway_config([{"name": "flaky", "url": be.url, "models": ["m"]}])
        async with running_gateway(cfg) as gw:
            status, _, body = await post(gw.url, {**CHAT, "stream": True})
            assert status == 200
            expected = b"".join(sent)
            assert body.startswith(expected)
            tail = body[len(expected):]
            assert tail.startswith(b"data: ")
            err = orjson.loads(tail[len(b"data: "):].strip())
            assert err["error"]["code"] == "disconnected"
            assert b"[DONE]" not in body
            assert len(be.attempt_times) == 1  # never retried after bytes reached the client
            assert gw.idle("flaky")
            assert gw.metric("turbo_gateway_stream_errors_total", backend="flaky", reason="disconnected") == 1


async def test_client_disconnect_cancels_upstream():
    async def answer(b, request, body):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(10_000):
                await resp.write(sse_chunk(i, "x"))
                await asyncio.sleep(0.01)
        except (asyncio.CancelledError, ConnectionResetError):
            b.disconnected.set()
            raise
        return resp

    async with ScriptedBackend(handler=answer).running() as be:
        cfg = gateway_config([{"name": "long", "url": be.url, "models": ["m"]}])
        async with running_gateway(cfg) as gw:
            async with aiohttp.ClientSession() as s:
                async with s.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
                    assert r.status == 200
                    await r.content.readany()
                    r.close()  # the client goes away mid-stream
            await asyncio.wait_for(be.disconnected.wait(), 10)
            await wait_until(lambda: gw.idle("long"))
            await wait_until(lambda: gw.metric("turbo_gateway_client_disconnects_total", backend="long") == 1)


async def test_client_disconnect_before_first_token_cancels_upstream():
    async def answer(b, request, body):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            await asyncio.sleep(60)  # a long prefill
        except asyncio.CancelledError:
            b.disconnected.set()
            raise
        return resp

    async with ScriptedBackend(handler=answer).running() as be:
        cfg = gateway_config([{"name": "slow", "url": be.url, "models": ["m"]}])
        async with running_gateway(cfg) as gw:
            async with aiohttp.ClientSession() as s:
                task = asyncio.create_task(s.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}))
                await wait_until(lambda: len(be.attempt_times) == 1)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            await asyncio.wait_for(be.disconnected.wait(), 10)
            await wait_until(lambda: gw.idle("slow"))


# SSE events cut at awkward offsets: inside the JSON, inside a multi-byte UTF-8
# character, and between "\r" and "\n".
def _split_points(data: bytes) -> list[int]:
    euro = data.index("€".encode()) + 1  # inside the 3-byte UTF-8 sequence
    cr = data.index(b"\r") + 1  # between \r and \n
    inside_json = data.index(b'"content"') + 4
    return sorted({1, inside_json, euro, euro + 1, cr, len(data) - 3})


async def test_sse_split_at_arbitrary_offsets_is_relayed_byte_exact():
    events = (b'data: {"choices":[{"index":0,"delta":{"content":"caf\xc3\xa9 \xe2\x82\xac 100"}}]}\r\n\r\n'
              + sse_chunk(1, "\u65e5\u672c\u8a9e") + b"data: [DONE]\r\n\r\n")
    cuts = _split_points(events)

    async def answer(b, request, body):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        prev = 0
        for cut in cuts + [len(events)]:
            await resp.write(events[prev:cut])
            await asyncio.sleep(0.005)  # let each piece leave as its own TCP segment
            prev = cut
        await resp.write_eof()
        return resp

    async with ScriptedBackend(handler=answer).running() as be:
        cfg = gateway_config([{"name": "split", "url": be.url, "models": ["m"]}])
        async with running_gateway(cfg) as gw:
            status, _, body = await post(gw.url, {**CHAT, "stream": True})
            assert status == 200
            assert body == events
            assert gw.idle("split")


async def test_unknown_fields_pass_through_untouched():
    async with ScriptedBackend().running() as be:
        cfg = gateway_config([{"name": "b", "url": be.url, "models": ["m"]}])
        async with running_gateway(cfg) as gw:
            raw = (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", '
                   b'"image_url": {"url": "data:image/png;base64,AAAA"}}]}], "tools": [{"type": "function", '
                   b'"function": {"name": "f", "parameters": {}}}], "logprobs": true, "n": 2, '
                   b'"response_format": {"type": "json_object"}, "vendor_extension": {"x": 1.50}}')
            status, _, _ = await post(gw.url, raw)
            assert status == 200
            assert be.bodies == [raw]
            # the caller's own credentials never reach a backend
            status, _, _ = await post(gw.url, raw, headers={"Content-Type": "application/json",
                                                           "Authorization": "Bearer caller-secret"})
            assert "Authorization" not in be.headers[-1]


async def test_backend_key_from_env_is_sent(monkeypatch):
    monkeypatch.setenv("TG_TEST_BACKEND_KEY", "backend-secret")
    async with ScriptedBackend().running() as be:
        cfg = gateway_config([{"name": "b", "url": be.url, "models": ["m"], "api_key_env": "TG_TEST_BACKEND_KEY"}])
        async with running_gateway(cfg) as gw:
            status, _, _ = await post(gw.url, CHAT, headers={"Content-Type": "application/json",
                                                             "Authorization": "Bearer caller-secret"})
            assert status == 200
            assert be.headers[0]["Authorization"] == "Bearer backend-secret"


async def test_non_retryable_backend_error_is_relayed():
    async def answer(b, request, body):
        return web.json_response({"error": {"message": "context too long", "type": "invalid_request_error",
                                            "param": "messages", "code": None}}, status=400)

    async with ScriptedBackend(handler=answer).running() as a, ScriptedBackend(handler=answer).running() as b:
        cfg = gateway_config([{"name": "a", "url": a.url, "models": ["m"]},
                              {"name": "b", "url": b.url, "models": ["m"]}])
        async with running_gateway(cfg) as gw:
            status, _headers, body = await post(gw.url, CHAT)
            assert status == 400
            assert orjson.loads(body)["error"]["message"] == "context too long"
            assert len(a.attempt_times) + len(b.attempt_times) == 1


async def test_first_token_timeout_retries_elsewhere_and_idle_timeout_ends_stream():
    async def stall_first(b, request, body):
        await asyncio.sleep(30)
        return web.Response()

    async def stall_after_one(b, request, body):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse_chunk(0, "a"))
        await asyncio.sleep(30)
        return resp

    async with ScriptedBackend(handler=stall_first).running() as slow, ScriptedBackend().running() as fast:
        cfg = gateway_config([{"name": "slow", "url": slow.url, "models": ["m"], "timeouts": {"ttft_s": 0.2}},
                              {"name": "fast", "url": fast.url, "models": ["m"]}])
        async with running_gateway(cfg) as gw:
            status, headers, _ = await post(gw.url, {**CHAT, "stream": True})
            assert status == 200 and headers["x-turbo-backend"] == "fast"
            assert gw.metric("turbo_gateway_retries_total", reason="ttft_timeout") == 1

    async with ScriptedBackend(handler=stall_after_one).running() as be:
        cfg = gateway_config([{"name": "stall", "url": be.url, "models": ["m"], "timeouts": {"idle_s": 0.2}}])
        async with running_gateway(cfg) as gw:
            status, _, body = await post(gw.url, {**CHAT, "stream": True})
            assert status == 200
            assert body.startswith(sse_chunk(0, "a"))
            assert orjson.loads(body[len(sse_chunk(0, "a")) + 6:])["error"]["code"] == "idle_timeout"
            assert gw.idle("stall")


async def test_all_backends_down_is_502_with_openai_error():
    cfg = gateway_config([{"name": "x", "url": f"http://127.0.0.1:{free_port()}", "models": ["m"]},
                          {"name": "y", "url": f"http://127.0.0.1:{free_port()}", "models": ["m"]}],
                         retries={"failed_backend_cooldown_s": 0})
    async with running_gateway(cfg) as gw:
        status, headers, body = await post(gw.url, CHAT)
        assert status == 502
        err = orjson.loads(body)["error"]
        assert err["code"] == "connect" and err["type"] == "server_error"
        assert "x-request-id" in headers
        assert gw.idle("x") and gw.idle("y")


async def test_done_inside_content_does_not_hide_a_cut_stream():
    async def answer(b, request, body):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse_chunk(0, "the marker is data: [DONE] ok"))
        await asyncio.sleep(0.05)
        request.transport.close()
        return resp

    async with ScriptedBackend(handler=answer).running() as be:
        cfg = gateway_config([{"name": "b", "url": be.url, "models": ["m"]}])
        async with running_gateway(cfg) as gw:
            status, _, body = await post(gw.url, {**CHAT, "stream": True})
            assert status == 200
            assert b'"error"' in body.split(b"\n\n")[-2]  # ended with an error event
            assert gw.metric("turbo_gateway_stream_errors_total", backend="b", reason="disconnected") == 1


async def test_no_request_field_or_header_changes_where_traffic_goes():
    """Upstream URLs come from the config only (no SSRF), and the caller's headers,
    hop-by-hop or spoofable, are not forwarded: the gateway builds upstream headers
    from scratch."""
    async with ScriptedBackend().running() as be:
        cfg = gateway_config([{"name": "b", "url": be.url, "models": ["m"]}])
        async with running_gateway(cfg) as gw:
            hostile = {"Content-Type": "application/json", "Host": "169.254.169.254", "X-Forwarded-Host": "evil",
                       "X-Forwarded-For": "1.2.3.4", "Connection": "keep-alive, X-Secret", "X-Secret": "s3cret",
                       "Proxy-Authorization": "Basic Zm9vOmJhcg==", "Authorization": "Bearer caller",
                       "X-Turbo-Backend": "other", "Forwarded": "for=1.2.3.4;host=evil"}
            for body in ({**CHAT, "base_url": "http://127.0.0.1:1/", "api_base": "http://evil/",
                          "url": "http://evil/"},
                         {**CHAT, "model": "http://169.254.169.254/latest/meta-data"}):
                status, _, _ = await post(gw.url, body, headers=hostile)
                assert status in (200, 404)
            assert len(be.headers) == 1  # the first reached the configured backend; the URL-like model was a 404
            sent = {k.lower() for k in be.headers[0]}
            for h in ("x-forwarded-host", "x-forwarded-for", "x-secret", "proxy-authorization", "authorization",
                      "x-turbo-backend", "forwarded"):
                assert h not in sent, h
            assert be.headers[0]["Host"] == be.url.removeprefix("http://")
