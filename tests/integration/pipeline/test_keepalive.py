"""Long first-token waits behind idle timeouts (``streaming``): a stream whose first
event is long in coming gets its 200 head and ``: keep-alive`` comments, so that a proxy
in front that cuts connections idle for N seconds does not cut a healthy stream. Real
sockets throughout: a real relay that drops idle connections, the real openai SDK."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import orjson
from aiohttp import web

from tests.support.servers import ScriptedBackend, gateway_config, raw_backend, running_gateway, sse_chunk

MESSAGES = [{"role": "user", "content": "think hard"}]
IDLE_CUT_S = 1.0  # the relay in front drops a connection that carried no byte for this long
THINK_S = 2.0  # the backend's wait before its first token: longer than IDLE_CUT_S


def idle_cutting_relay(target_port: int, idle_s: float):
    """A TCP relay on 127.0.0.1 to ``target_port`` that closes both sides of a
    connection when no byte went from the server to the client for ``idle_s`` seconds
    (what a cloud load balancer or an nginx ``proxy_read_timeout`` does)."""

    async def relay(c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        s_reader, s_writer = await asyncio.open_connection("127.0.0.1", target_port)

        async def upstream() -> None:
            while data := await c_reader.read(65536):
                s_writer.write(data)
                await s_writer.drain()

        up = asyncio.ensure_future(upstream())
        try:
            while True:
                try:
                    data = await asyncio.wait_for(s_reader.read(65536), idle_s)
                except TimeoutError:
                    return  # idle: cut
                if not data:
                    return
                c_writer.write(data)
                await c_writer.drain()
        finally:
            up.cancel()
            s_writer.close()

    return raw_backend(relay)  # raw_backend closes the client side


async def thinking(b, request, body):
    """A reasoning model: nothing for THINK_S seconds, then its answer."""
    await asyncio.sleep(THINK_S)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(3):
        await resp.write(sse_chunk(i, f"t{i} "))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def _cfg(url: str, after_s: float | None, **extra):
    return gateway_config([{"name": "b", "url": url, "models": ["m"]}],
                          streaming={"keepalive_after_s": after_s, "keepalive_every_s": 0.3}, **extra)


async def _raw_stream(url: str) -> tuple[int, dict, bytes]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "stream": True}) as r:
            body = b""
            try:
                async for chunk in r.content.iter_any():
                    body += chunk
            except aiohttp.ClientPayloadError:
                pass  # cut mid-body: what is read so far is the answer
            return r.status, dict(r.headers), body


async def test_keepalive_comments_carry_a_slow_first_token_through_an_idle_cutting_proxy():
    async with ScriptedBackend(handler=thinking).running() as be:
        async with running_gateway(_cfg(be.url, 0.3)) as gw:
            async with idle_cutting_relay(int(gw.url.rsplit(":", 1)[1]), IDLE_CUT_S) as front:
                status, headers, body = await _raw_stream(front)
                assert status == 200
                assert headers["Cache-Control"] == "no-cache" and headers["X-Accel-Buffering"] == "no"
                assert body.startswith(b": keep-alive\n\n") and body.count(b": keep-alive\n\n") >= 3
                events = [line for line in body.split(b"\n") if line.startswith(b"data: ")]
                assert events[-1] == b"data: [DONE]" and len(events) == 4  # every event, after the comments
                # the comments are not tokens: usage-less streams count events, and TTFT is the first event's
                m = gw.state.metrics
                assert m.child(m.completion_tokens, "m", "chat").value == 3
                assert m.child(m.ttft, "m", "chat").sum >= THINK_S

                client = openai.AsyncOpenAI(base_url=front + "/v1", api_key="unused")
                stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
                text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
                await client.close()
                assert text == "t0 t1 t2 "  # the SDK skips the comments


async def test_without_keepalive_the_same_proxy_cuts_the_stream():
    async with ScriptedBackend(handler=thinking).running() as be:
        async with running_gateway(_cfg(be.url, None)) as gw:
            async with idle_cutting_relay(int(gw.url.rsplit(":", 1)[1]), IDLE_CUT_S) as front:
                async with aiohttp.ClientSession() as s:
                    try:
                        async with s.post(front + "/v1/chat/completions",
                                          json={"model": "m", "messages": MESSAGES, "stream": True}) as r:
                            body = await r.read()
                    except (aiohttp.ClientError, aiohttp.ServerDisconnectedError):
                        body = None
                assert body is None or b"[DONE]" not in body  # the proxy cut it before the first token


async def test_a_failure_behind_the_comments_is_still_retried():
    async def silent(b, request, body):
        await asyncio.sleep(60)  # until the gateway's first-token timeout gives up on it
        raise AssertionError("unreachable")

    async with ScriptedBackend(handler=silent).running() as dead, ScriptedBackend().running() as live:
        cfg = gateway_config([{"name": "dead", "url": dead.url, "models": ["m"], "timeouts": {"ttft_s": 0.8}},
                              {"name": "live", "url": live.url, "models": ["m"]}],
                             routing={"policy": "round_robin"},
                             streaming={"keepalive_after_s": 0.2, "keepalive_every_s": 0.2})
        async with running_gateway(cfg) as gw:
            status, _headers, body = await _raw_stream(gw.url)  # round robin: "dead" first, in config order
            assert status == 200 and dead.attempt_times and live.attempt_times
            assert dead.attempt_times[0] < live.attempt_times[0]
            assert body.startswith(b": keep-alive\n\n")
            assert body.endswith(b"data: [DONE]\n\n") and b'"error"' not in body


async def test_a_final_failure_behind_the_comments_is_an_error_event():
    async def slow_503(b, request, body):
        await asyncio.sleep(0.6)
        return web.json_response({"error": {"message": "engine overloaded", "type": "server_error"}}, status=503)

    async with ScriptedBackend(handler=slow_503).running() as be:
        async with running_gateway(_cfg(be.url, 0.2, retries={"max_attempts": 2})) as gw:
            status, _, body = await _raw_stream(gw.url)
            assert status == 200 and body.startswith(b": keep-alive\n\n")
            last = [line for line in body.split(b"\n") if line.startswith(b"data: ")][-1]
            err = orjson.loads(last[6:])["error"]
            assert err["message"] == "engine overloaded" and b"[DONE]" not in body  # the answer's own body
            assert len(be.attempt_times) == 2  # retried behind the comments first


async def test_a_fast_stream_and_a_whole_answer_get_no_comment():
    async with ScriptedBackend().running() as be:
        async with running_gateway(_cfg(be.url, 0.2)) as gw:
            status, headers, body = await _raw_stream(gw.url)
            assert status == 200 and b"keep-alive" not in body and headers["X-Accel-Buffering"] == "no"
            async with aiohttp.ClientSession() as s:
                async with s.post(gw.url + "/v1/chat/completions", json={"model": "m", "messages": MESSAGES}) as r:
                    assert r.status == 200 and b"keep-alive" not in await r.read()


async def test_a_context_error_behind_the_comments_keeps_its_openai_form():
    async def too_long(b, request, body):
        await asyncio.sleep(0.5)
        return web.json_response({"error": {
            "message": "This model's maximum context length is 4096 tokens. However, you requested 9000 tokens "
                       "(8000 in the messages, 1000 in the completion).", "type": "BadRequestError", "param": None,
            "code": 400}}, status=400)

    async with ScriptedBackend(handler=too_long).running() as be:
        async with running_gateway(_cfg(be.url, 0.2)) as gw:
            status, _, body = await _raw_stream(gw.url)
            assert status == 200 and body.startswith(b": keep-alive\n\n")
            err = orjson.loads([line for line in body.split(b"\n") if line.startswith(b"data: ")][-1][6:])["error"]
            assert err["code"] == "context_length_exceeded" and err["type"] == "invalid_request_error"


async def test_a_whole_answer_arriving_while_a_comment_falls_due_is_never_a_second_response():
    async def slow_json(b, request, body):  # the head at once, the body 1 s later
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = None
        await resp.prepare(request)
        await asyncio.sleep(1.0)
        await resp.write(orjson.dumps({"id": "x", "object": "chat.completion", "choices": []}))
        await resp.write_eof()
        return resp

    async with ScriptedBackend(handler=slow_json).running() as be:
        async with running_gateway(_cfg(be.url, 0.3)) as gw:
            port = int(gw.url.rsplit(":", 1)[1])
            r, w = await asyncio.open_connection("127.0.0.1", port)
            body = orjson.dumps({"model": "m", "messages": MESSAGES, "stream": True})
            w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await w.drain()
            data = await asyncio.wait_for(r.read(), 10)  # to the close that ends the one response
            w.close()
            assert data.startswith(b"HTTP/1.1 200 ") and data.count(b"HTTP/1.1 ") == 1, data
