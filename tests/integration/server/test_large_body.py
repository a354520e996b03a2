"""A large body under the limit does not hold the event loop: its parse and estimate run
off the loop, and the prefix index records no more of it than a cache can hold, so
other requests go on while it is worked on. The loop's longest stall during the
request is compared with the request's own time, in the same run (no absolute bound)."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson

from tests.support.servers import gateway_config, raw_backend, running_gateway

BODY_MB = 24


async def _context_too_long(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A backend that reads the request and refuses it, as an engine refuses a prompt
    longer than its context, without parsing it."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(v) for k, _, v in (line.partition(b":") for line in head.split(b"\r\n"))
                  if k.strip().lower() == b"content-length")
    await reader.readexactly(length)
    body = b'{"error": {"message": "too long", "type": "invalid_request_error", "code": null}}'
    writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
                 % (len(body), body))
    await writer.drain()


async def test_a_large_body_leaves_the_loop_free_for_other_requests():
    words = "lorem ipsum dolor sit amet " * (BODY_MB * 1024 * 1024 // 27)
    body = orjson.dumps({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": words}]})
    async with raw_backend(_context_too_long) as url:
        cfg = gateway_config([{"name": "b", "url": url, "models": ["m"]}],
                             limits={"max_body_bytes": 2 * len(body)})
        async with running_gateway(cfg) as gw, aiohttp.ClientSession() as http:
            loop = asyncio.get_running_loop()
            stalls: list[float] = []
            done = asyncio.Event()

            async def ticker() -> None:
                last = loop.time()
                while not done.is_set():
                    await asyncio.sleep(0.005)
                    now = loop.time()
                    stalls.append(now - last)
                    last = now

            tick = asyncio.create_task(ticker())
            await asyncio.sleep(0.05)
            started = loop.time()
            async with http.post(gw.url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"}) as r:
                assert r.status == 400
                await r.read()
            took = loop.time() - started
            done.set()
            await tick
    # the loop never stood still for a large part of the request's time
    assert max(stalls) < took / 2, (max(stalls), took)
