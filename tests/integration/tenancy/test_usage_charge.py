"""Charge what was generated (issue 27, point 6): a streamed request whose client leaves,
or whose stream breaks, is charged in the usage ledger and by the per-key token limit
its prompt and the completion tokens relayed; a client that did not ask for
``stream_options.include_usage`` gets exactly the stream it asked for while the
gateway asks the engine for the usage chunk and keeps it, so the count is the engine's
whenever the engine got that far. Real sockets: a scripted engine speaking raw HTTP/1.1
on a loopback port, the gateway, the openai SDK and aiohttp as clients, a real
valkey-server for the ledger."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import aiohttp
import openai
import orjson

from routing.core import canonical_prompt
from tests.integration.tenancy.test_usage import ADMIN, ADMIN_KEY, PRICES, counts, get, row, settled, sha
from tests.support.redis_server import redis_url
from tests.support.servers import gateway_config, raw_backend, running_gateway, sse_chunk, wait_until

KEY = "sk-charge-alpha-0123456789"
EVENTS = 6  # content events in a whole answer
USAGE = {"prompt_tokens": 40, "completion_tokens": 2 * EVENTS, "total_tokens": 40 + 2 * EVENTS}  # two tokens an event
CONTENT = b"".join(sse_chunk(i, f"t{i} ") for i in range(EVENTS))
USAGE_EVENT = b"data: " + orjson.dumps({"id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 0,
                                        "model": "m", "choices": [], "usage": USAGE}) + b"\n\n"
DONE = b"data: [DONE]\n\n"


class Engine:
    """An OpenAI-style engine that sends the usage chunk only when asked (as vLLM,
    SGLang and llama.cpp do). What it does is chosen by the first message's content:
    ``full``; ``split`` (the usage event in two writes); ``hold:K`` (K events, then
    nothing until the gateway closes the connection); ``usage-then-hold``; ``cut:K``
    (K events, then the connection closes mid-response); ``usage-then-cut``."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.closed_by_gateway = 0

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        m = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
        assert m is not None
        raw = await reader.readexactly(int(m[1]))
        self.bodies.append(raw)
        body = orjson.loads(raw)
        mode = body["messages"][0]["content"]
        asked = bool((body.get("stream_options") or {}).get("include_usage"))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                     b"Connection: close\r\n\r\n")

        def chunk(data: bytes) -> None:
            writer.write(b"%x\r\n%b\r\n" % (len(data), data))

        usage = USAGE_EVENT if asked else b""
        if mode in ("full", "usage-then-hold", "usage-then-cut"):
            chunk(CONTENT + usage)
        elif mode == "split":
            chunk(CONTENT + usage[:25])
            await writer.drain()
            await asyncio.sleep(0.05)
            chunk(usage[25:])
        else:
            k = int(mode.split(":")[1])
            chunk(b"".join(sse_chunk(i, f"t{i} ") for i in range(k)))
        await writer.drain()
        if mode.startswith("cut") or mode == "usage-then-cut":
            return  # the connection closes without the chunked body's end
        if "hold" in mode:
            await reader.read()  # until the gateway closes the connection
            self.closed_by_gateway += 1
            return
        chunk(DONE)
        writer.write(b"0\r\n\r\n")
        await writer.drain()


def _config(engine_url: str, redis: str) -> Any:
    return gateway_config([{"name": "e", "url": engine_url, "models": ["m"]}], retries={"max_attempts": 1},
                          admin={"key_sha256": sha(ADMIN_KEY)}, usage={"prices": PRICES, "flush_interval_s": 3600},
                          state={"url": redis, "namespace": "charge", "timeout_s": 0.2},
                          auth={"keys": [{"name": "alpha", "key_sha256": sha(KEY), "tokens_per_minute": 1_000_000}]})


def _chat(mode: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": mode}], "stream": True, **extra}


async def _ledger(http: aiohttp.ClientSession, gw) -> tuple:
    await gw.state.usage_sync.flush_once()
    status, report = await get(http, gw.url + "/admin/usage", ADMIN)
    assert status == 200, report
    return counts(row(report, "alpha"))


def _limiter_tokens(gw) -> float:
    """The tokens the per-key limit holds against alpha (this minute and the last)."""
    lim = gw.state.limiter
    u, w = lim.usage["alpha"], lim.window()
    return u.count(w - 1)[1] + u.count(w)[1]


def _estimate(gw, body: dict[str, Any]) -> int:
    """The prompt tokens the gateway estimates for ``body`` (no usage reported)."""
    return gw.state.core.prompt_tokens("m", canonical_prompt("chat", body))


async def _stream(http: aiohttp.ClientSession, gw, body: dict[str, Any]) -> bytes:
    """POST ``body`` (a streamed chat) and return the whole answer, which must be a 200."""
    async with http.post(gw.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        return await r.read()


async def test_a_client_not_asking_for_usage_gets_its_stream_unchanged_and_is_charged_exactly():
    engine = Engine()
    with redis_url() as redis:
        async with raw_backend(engine) as url, running_gateway(_config(url, redis)) as gw, \
                aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as http:
            for mode in ("full", "split"):  # the usage event in one read, or split over two
                sent = _chat(mode, max_tokens=50)
                assert await _stream(http, gw, sent) == CONTENT + DONE  # byte for byte what it asked for
                upstream = orjson.loads(engine.bodies[-1])
                assert upstream.pop("stream_options") == {"include_usage": True} and upstream == sent
            # a client that asked for usage gets it, and its body goes upstream as it was sent
            asked = _chat("full", stream_options={"include_usage": True})
            assert await _stream(http, gw, asked) == CONTENT + USAGE_EVENT + DONE
            assert orjson.loads(engine.bodies[-1]) == asked
            # other stream options: include_usage added, vLLM's usage in every chunk not turned on
            await _stream(http, gw, _chat("full", stream_options={"continuous_usage_stats": True}))
            assert orjson.loads(engine.bodies[-1])["stream_options"] == {"include_usage": True}
            # the openai SDK sees no usage chunk and no chunk without choices
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)
            stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "full"}],
                                                          stream=True)
            chunks = [c async for c in stream]
            assert len(chunks) == EVENTS and all(c.choices and c.usage is None for c in chunks)
            await wait_until(lambda: settled(gw) == 5)
            # every request counted as the engine reported it (12 tokens), not as 6 events
            assert await _ledger(http, gw) == (5, 5 * 40, 0, 5 * 2 * EVENTS, 0)
            assert _limiter_tokens(gw) == 5 * (40 + 2 * EVENTS)


async def test_a_client_that_leaves_mid_stream_is_charged_its_prompt_and_what_was_relayed():
    engine = Engine()
    with redis_url() as redis:
        async with raw_backend(engine) as url, running_gateway(_config(url, redis)) as gw, \
                aiohttp.ClientSession() as http:
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)

            async def read_then_leave(body: dict[str, Any], n: int) -> None:
                stream = await client.chat.completions.create(**body)
                got = 0
                async for c in stream:
                    assert c.choices and c.usage is None
                    got += 1
                    if got == n:
                        break
                await stream.close()

            left = _chat("hold:3", max_tokens=100)  # charged the prompt and max_tokens up front
            prompt = _estimate(gw, left)
            await read_then_leave(left, 3)
            await wait_until(lambda: engine.closed_by_gateway == 1 and settled(gw) == 1)
            assert await _ledger(http, gw) == (1, prompt, 0, 3, 1)  # 499: an error entry
            assert _limiter_tokens(gw) == prompt + 3
            # the engine sent its usage before the client left: its count, exactly
            await read_then_leave(_chat("usage-then-hold", max_tokens=100), EVENTS)
            await wait_until(lambda: engine.closed_by_gateway == 2 and settled(gw) == 2)
            assert await _ledger(http, gw) == (2, prompt + 40, 0, 3 + 2 * EVENTS, 2)
            assert _limiter_tokens(gw) == prompt + 3 + 40 + 2 * EVENTS


async def test_a_stream_that_breaks_is_charged_its_prompt_and_what_was_relayed():
    engine = Engine()
    with redis_url() as redis:
        async with raw_backend(engine) as url, running_gateway(_config(url, redis)) as gw, \
                aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as http:
            cut = _chat("cut:4", max_tokens=100)
            prompt = _estimate(gw, cut)
            got = await _stream(http, gw, cut)
            assert got.startswith(b"".join(sse_chunk(i, f"t{i} ") for i in range(4)) + b"data: {\"error\"")
            assert DONE not in got
            got = await _stream(http, gw, _chat("usage-then-cut", max_tokens=100))
            assert got.startswith(CONTENT + b"data: {\"error\"") and b'"usage"' not in got
            await wait_until(lambda: settled(gw) == 2)
            assert await _ledger(http, gw) == (2, prompt + 40, 0, 4 + 2 * EVENTS, 2)
            assert _limiter_tokens(gw) == prompt + 4 + 40 + 2 * EVENTS
