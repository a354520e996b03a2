"""Regressions a review of the request-pipeline split found (each compared with the code
before it): a body aiohttp cannot decode is a 400, a batch line's TTFT starts when the
batch gate lets it in, a middleware the lean protocol would bypass is refused loudly, a
recovered backend keeps its KV capacity in the prefix index, and a non-POST request to
a completion path still needs the key."""

from __future__ import annotations

import asyncio
import hashlib
import zlib

import aiohttp
import orjson
import pytest
from aiohttp import web

from gateway.server.app import create_app
from gateway.server.listener import listen
from routing.core import BackendSpec, DecisionCore
from tests.support.redis_server import redis_url
from tests.support.servers import ScriptedBackend, gateway_config, running_gateway
from tests.integration.batch.test_batch import batch_config

BUG = "found by the review of the pipeline split"


@pytest.mark.fixed_bug(reason=BUG)
async def test_a_body_aiohttp_cannot_decode_is_a_400_not_a_500():
    async with ScriptedBackend().running() as be:
        async with running_gateway(gateway_config([{"name": "b", "url": be.url, "models": ["m"]}])) as gw:
            port = int(gw.url.rsplit(":", 1)[1])
            r, w = await asyncio.open_connection("127.0.0.1", port)
            try:  # chunked: served by aiohttp; the second chunk is not deflate
                w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Encoding: deflate\r\nTransfer-Encoding: chunked\r\n\r\n")
                c = zlib.compressobj()
                first = c.compress(b'{"model":"m","messages":[{"role":"user","content":"' + b"x" * 5000) + \
                    c.flush(zlib.Z_SYNC_FLUSH)
                w.write(b"%x\r\n%b\r\n" % (len(first), first))
                bad = b"\xff" * 64
                w.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(bad), bad))
                await w.drain()
                head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)
                assert head.startswith(b"HTTP/1.1 400 "), head
            finally:
                w.close()
            assert be.bodies == []


@pytest.fixture(scope="module")
def redis():
    with redis_url() as url:
        yield url


@pytest.mark.fixed_bug(reason=BUG)
async def test_a_batch_lines_ttft_does_not_count_its_wait_at_the_gate(redis, tmp_path):
    async with ScriptedBackend().running() as be:
        cfg = batch_config([{"name": "b", "url": be.url, "models": ["demo-model"]}], redis, tmp_path, workers=0)
        async with running_gateway(cfg) as gw:
            gate = gw.state.batch_gate
            gate.in_flight += 1  # a line in flight elsewhere, holding a share the next line does not fit in
            gate.kv_in_flight = 1e12
            body = {"model": "demo-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            async with aiohttp.ClientSession() as s:
                pending = asyncio.ensure_future(s.post(gw.url + "/v1/chat/completions", json=body,
                                                       headers={"x-turbo-priority": "batch"}))
                await asyncio.sleep(0.5)  # the line waits at the gate at least this long
                assert not be.bodies
                loop = asyncio.get_running_loop()
                released_at = loop.time()
                gate.in_flight -= 1
                gate.kv_in_flight = 0.0
                gate._changed.set()
                r = await asyncio.wait_for(pending, 10)
                assert r.status == 200
                await r.read()
                answered_at = loop.time()
            ttft = gw.state.metrics.child(gw.state.metrics.ttft, "demo-model")
            # the TTFT counts from the gate's release (the loop's clock, ms resolution), not from arrival
            assert sum(ttft.counts) == 1 and ttft.sum <= answered_at - released_at + 0.002


@pytest.mark.fixed_bug(reason=BUG)
async def test_a_middleware_the_lean_protocol_would_bypass_is_refused_loudly():
    @web.middleware
    async def deny(request, handler):
        return web.json_response({"error": {"message": "denied"}}, status=403)

    async with ScriptedBackend().running() as be:
        app = create_app(gateway_config([{"name": "b", "url": be.url, "models": ["m"]}]))
        app.middlewares.append(deny)
        with pytest.raises(ValueError, match="fast_path: false"):
            await listen(app, "127.0.0.1", 0)
        app = create_app(gateway_config([{"name": "b", "url": be.url, "models": ["m"]}],
                                         listen={"fast_path": False}))
        app.middlewares.append(deny)
        server = await listen(app, "127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://127.0.0.1:{server.addresses[0][1]}/v1/chat/completions",
                                  json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}) as r:
                    assert r.status == 403  # every request through aiohttp, the middleware included
        finally:
            await server.shutdown(1.0)


@pytest.mark.fixed_bug(reason=BUG)
def test_a_recovered_backend_keeps_its_kv_capacity_in_the_prefix_index():
    core = DecisionCore([BackendSpec("b", frozenset({"m"}), kv_capacity_tokens=6400)], "round_robin",
                        block_tokens=64)
    b = core.fleet.backends["b"]
    assert core.index.backends["b"].capacity_blocks == 100
    core.index.record("b", tuple(range(50)), 0.0)
    core.backend_restarted(b)
    assert core.index.match(tuple(range(50)), 0.0).get("b", 0) == 0  # its entries are gone
    assert core.index.backends["b"].capacity_blocks == 100  # its capacity is not


@pytest.mark.fixed_bug(reason=BUG)
@pytest.mark.parametrize("method", ["GET", "PUT"])
async def test_a_non_post_completion_request_without_the_key_is_a_401(method):
    key = "sk-review-0123456789"
    keys = {"keys": [{"name": "k", "key_sha256": hashlib.sha256(key.encode()).hexdigest()}]}
    async with ScriptedBackend().running() as be:
        async with running_gateway(gateway_config([{"name": "b", "url": be.url, "models": ["m"]}], auth=keys)) as gw:
            async with aiohttp.ClientSession() as s:
                async with s.request(method, gw.url + "/v1/chat/completions") as r:
                    assert r.status == 401
                    assert orjson.loads(await r.read())["error"]["code"] == "missing_api_key"
