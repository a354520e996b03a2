"""Failure classes users of other gateways have hit, each broken on purpose here
(issue 8): 4xx relayed as 4xx (and 5xx never as 4xx), a non-streaming client that
leaves stops generation, SSE comments never become data, a cut stream never looks
finished, limiter slots come back."""

from __future__ import annotations

import asyncio
import hashlib

import aiohttp
import orjson
import pytest
from aiohttp import web

from tests.support.servers import ScriptedBackend, gateway_config, running_gateway, sse_chunk, wait_until

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def post(url: str, body: dict, headers: dict | None = None):
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
            return r.status, r.headers.copy(), await r.read()


@pytest.mark.parametrize("status", [400, 401, 404, 413, 422])
async def test_backend_4xx_is_relayed_not_retried_and_breaker_not_tripped(status):
    async def answer(b, request, body):
        return web.json_response({"error": {"message": "This model's maximum context length is 4096 tokens.",
                                            "type": "invalid_request_error", "param": "messages",
                                            "code": "context_length_exceeded"}}, status=status)

    async with ScriptedBackend(handler=answer).running() as a, ScriptedBackend(handler=answer).running() as b:
        cfg = gateway_config([{"name": "a", "url": a.url, "models": ["m"]},
                              {"name": "b", "url": b.url, "models": ["m"]}],
                             breaker={"failure_threshold": 1})
        async with running_gateway(cfg) as gw:
            for stream in (False, True, False):
                st, _, body = await post(gw.url, {**CHAT, "stream": stream})
                assert st == status
                assert orjson.loads(body)["error"]["code"] == "context_length_exceeded"
            assert len(a.attempt_times) + len(b.attempt_times) == 3  # one attempt each
            assert all(x.breaker.state == "closed" for x in gw.state.fleet.backends.values())


@pytest.mark.parametrize("status", [500, 501, 502, 503, 504])
async def test_backend_5xx_is_never_reported_as_4xx(status):
    async def answer(b, request, body):
        return web.Response(status=status, text="<html>upstream broke</html>", content_type="text/html")

    async with ScriptedBackend(handler=answer).running() as be:
        cfg = gateway_config([{"name": "a", "url": be.url, "models": ["m"]}])
        async with running_gateway(cfg) as gw:
            st, _, body = await post(gw.url, CHAT)
            assert 500 <= st < 600
            assert orjson.loads(body)["error"]["type"] == "server_error"  # an OpenAI error, not the HTML


async def test_non_streaming_client_disconnect_stops_generation():
    generating = asyncio.Event()

    async def slow_whole(b, request, body):
        generating.set()
        await asyncio.sleep(60)  # "generating" a long non-streamed answer
        return web.json_response({})

    async with ScriptedBackend(handler=slow_whole).running() as be:
        cfg = gateway_config([{"name": "a", "url": be.url, "models": ["m"]}])
        async with running_gateway(cfg) as gw:
            async with aiohttp.ClientSession() as s:
                task = asyncio.create_task(s.post(gw.url + "/v1/chat/completions", json=CHAT))
                await generating.wait()
                task.cancel()  # the client leaves before any response byte
                with pytest.raises(asyncio.CancelledError):
                    await task
            await asyncio.wait_for(be.disconnected.wait(), 10)  # the backend saw its client go away
            await wait_until(lambda: gw.idle("a"))
            await wait_until(lambda: gw.metric("turbo_gateway_requests_total", model="m", backend="a",
                                               status="499") == 1)


async def test_sse_comment_lines_are_relayed_never_turned_into_data():
    sent = (b": keep-alive\n\n" + sse_chunk(0, "a") + b": keep-alive\n\n" + b":\n\n" + sse_chunk(1, "b", finish="stop")
            + b": ping 12345\n\n" + b"data: [DONE]\n\n")

    async def answer(b, request, body):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for part in sent.split(b"\n\n")[:-1]:
            await resp.write(part + b"\n\n")
        await resp.write_eof()
        return resp

    async with ScriptedBackend(handler=answer).running() as be:
        cfg = gateway_config([{"name": "a", "url": be.url, "models": ["m"]}])
        async with running_gateway(cfg) as gw:
            st, _, body = await post(gw.url, {**CHAT, "stream": True})
            assert st == 200
            assert body == sent  # byte for byte: comments relayed, nothing added
            data_lines = [ln for ln in body.split(b"\n") if ln.startswith(b"data:")]
            assert len(data_lines) == 3
            assert gw.metric("turbo_gateway_completion_tokens_total", model="m") == 2  # comments are not tokens
            assert gw.idle("a")


@pytest.mark.parametrize("cut", ["disconnect", "idle_timeout"])
async def test_cut_stream_never_ends_like_a_normal_finish(cut):
    async def answer(b, request, body):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse_chunk(0, "half"))
        await resp.write(sse_chunk(1, " an"))
        if cut == "disconnect":
            request.transport.close()
        else:
            await asyncio.sleep(30)
        return resp

    async with ScriptedBackend(handler=answer).running() as be:
        cfg = gateway_config([{"name": "a", "url": be.url, "models": ["m"], "timeouts": {"idle_s": 0.2}}])
        async with running_gateway(cfg) as gw:
            st, _, body = await post(gw.url, {**CHAT, "stream": True})
            assert st == 200
            assert b"[DONE]" not in body
            events = [orjson.loads(ln[5:]) for ln in body.split(b"\n") if ln.startswith(b"data:")]
            assert all(c["finish_reason"] is None for e in events if "choices" in e for c in e["choices"])
            assert events[-1]["error"]["code"] == ("disconnected" if cut == "disconnect" else "idle_timeout")
            assert gw.idle("a")


async def test_limiter_slots_returned_after_cancel_and_timeout_many_times():
    key = "sk-failure-classes"
    cfg_key = {"name": "k", "key_sha256": hashlib.sha256(key.encode()).hexdigest(), "max_concurrent": 2}
    started = asyncio.Event()

    async def answer(b, request, body):
        started.set()
        await asyncio.sleep(30)
        return web.json_response({})

    async with ScriptedBackend(handler=answer).running() as be:
        cfg = gateway_config([{"name": "a", "url": be.url, "models": ["m"], "timeouts": {"ttft_s": 0.1}}],
                             retries={"max_attempts": 1}, auth={"keys": [cfg_key]})
        async with running_gateway(cfg) as gw:
            h = {"Authorization": f"Bearer {key}"}
            for _ in range(3):  # timeouts
                assert (await post(gw.url, CHAT, h))[0] == 504
            async with aiohttp.ClientSession() as s:  # cancels
                for _ in range(3):
                    started.clear()
                    t = asyncio.create_task(s.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                                                   headers=h))
                    await started.wait()
                    t.cancel()
            await wait_until(lambda: gw.state.limiter.usage["k"].concurrent == 0)
            await wait_until(lambda: gw.idle("a"))
