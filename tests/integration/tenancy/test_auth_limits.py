"""Client API keys and per-key limits (requests/min, tokens/min, concurrent), locally
and across replicas through a real Redis-protocol server."""

from __future__ import annotations

import asyncio
import hashlib
import logging

import aiohttp
import orjson
import pytest
from aiohttp import web

from gateway.config import ClientKey
from gateway.errors import ClientError
from gateway.ops.metrics import key_label
from gateway.tenancy.limits import Limiter
from tests.support.redis_server import ValkeyProcess, frozen_redis
from tests.support.servers import ScriptedBackend, free_port, gateway_config, running_gateway, sse_chunk, wait_until

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
KEY_A = "sk-test-alpha-0123456789"
KEY_B = "sk-test-bravo-9876543210"


def sha(k: str) -> str:
    return hashlib.sha256(k.encode()).hexdigest()


def auth(k: str) -> dict:
    return {"Authorization": f"Bearer {k}"}


async def post(url: str, body: dict, headers: dict | None = None):
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
            return r.status, r.headers.copy(), await r.read()


def held_stream(gate: asyncio.Event):
    async def answer(b, request, body):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse_chunk(0, "x"))
        await gate.wait()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    return answer


async def test_no_keys_configured_means_open_access():
    async with ScriptedBackend().running() as be:
        async with running_gateway(gateway_config([{"name": "b", "url": be.url, "models": ["m"]}])) as gw:
            assert (await post(gw.url, CHAT))[0] == 200
            assert (await post(gw.url, CHAT, auth("anything")))[0] == 200


async def test_keys_required_hashed_never_echoed_never_forwarded(monkeypatch, caplog):
    monkeypatch.setenv("TG_TEST_KEY_B", KEY_B)
    async with ScriptedBackend().running() as be:
        cfg = gateway_config([{"name": "b", "url": be.url, "models": ["m"]}],
                             auth={"keys": [{"name": "alpha", "key_sha256": sha(KEY_A)},
                                            {"name": "bravo", "key_env": "TG_TEST_KEY_B"}]})
        caplog.set_level(logging.DEBUG)
        async with running_gateway(cfg) as gw:
            status, headers, body = await post(gw.url, CHAT)
            assert status == 401 and orjson.loads(body)["error"]["code"] == "missing_api_key"
            assert headers["WWW-Authenticate"] == "Bearer"
            wrong = "sk-wrong-" + KEY_A
            status, _, body = await post(gw.url, CHAT, auth(wrong))
            assert status == 401 and orjson.loads(body)["error"]["type"] == "authentication_error"
            assert wrong.encode() not in body
            async with aiohttp.ClientSession() as s:
                async with s.get(gw.url + "/v1/models") as r:
                    assert r.status == 401
                async with s.get(gw.url + "/health") as r:
                    assert r.status == 200  # probes stay open
            for k in (KEY_A, KEY_B):
                assert (await post(gw.url, CHAT, auth(k)))[0] == 200
            assert all("Authorization" not in h for h in be.headers)  # the caller's key stays here
            metrics, _ = gw.state.metrics.exposition()
        for k in (KEY_A, KEY_B, wrong):
            assert k not in caplog.text and k.encode() not in metrics
        assert gw.state.keyring.by_digest  # digests only
        assert all(isinstance(d, bytes) and len(d) == 32 for d in gw.state.keyring.by_digest)


async def test_requests_per_minute_429_with_retry_after():
    async with ScriptedBackend().running() as be:
        cfg = gateway_config([{"name": "b", "url": be.url, "models": ["m"]}],
                             auth={"keys": [{"name": "alpha", "key_sha256": sha(KEY_A), "requests_per_minute": 2},
                                            {"name": "bravo", "key_sha256": sha(KEY_B)}]})
        async with running_gateway(cfg) as gw:
            assert (await post(gw.url, CHAT, auth(KEY_A)))[0] == 200
            assert (await post(gw.url, CHAT, auth(KEY_A)))[0] == 200
            status, headers, body = await post(gw.url, CHAT, auth(KEY_A))
            assert status == 429 and 1 <= int(headers["Retry-After"]) <= 120
            err = orjson.loads(body)["error"]
            assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
            assert KEY_A.encode() not in body
            assert (await post(gw.url, CHAT, auth(KEY_B)))[0] == 200  # another key is not affected
            assert len(be.bodies) == 3
            assert gw.metric("turbo_gateway_rate_limited_total", key_name=key_label("hashed", "alpha"),
                             limit="requests") == 1


async def test_tokens_per_minute_counts_reported_usage():
    async with ScriptedBackend().running() as be:  # usage: 6 tokens per answer
        cfg = gateway_config([{"name": "b", "url": be.url, "models": ["m"]}],
                             auth={"keys": [{"name": "alpha", "key_sha256": sha(KEY_A), "tokens_per_minute": 10}]})
        async with running_gateway(cfg) as gw:
            assert (await post(gw.url, {**CHAT, "max_tokens": 1}, auth(KEY_A)))[0] == 200
            assert (await post(gw.url, {**CHAT, "max_tokens": 1}, auth(KEY_A)))[0] == 200  # 6 < 10
            status, headers, _ = await post(gw.url, {**CHAT, "max_tokens": 1}, auth(KEY_A))  # 12 >= 10
            assert status == 429 and int(headers["Retry-After"]) >= 1
            u = gw.state.limiter.usage["alpha"]
            w = gw.state.limiter.window()
            assert sum(u.count(w - 1)[1:]) + u.count(w)[1] == 12  # corrected to usage, not the estimate


async def test_concurrency_slot_returned_on_client_cancel_and_backend_timeout():
    gate = asyncio.Event()
    stall = {"on": False}

    async def answer(b, request, body):
        if stall["on"]:
            await asyncio.sleep(30)  # never answers within ttft_s
        return await held_stream(gate)(b, request, body)

    async with ScriptedBackend(handler=answer).running() as be:
        cfg = gateway_config([{"name": "b", "url": be.url, "models": ["m"]}],
                             timeouts={"ttft_s": 0.2}, retries={"max_attempts": 1},
                             auth={"keys": [{"name": "alpha", "key_sha256": sha(KEY_A), "max_concurrent": 1}]})
        async with running_gateway(cfg) as gw:
            lim = gw.state.limiter
            # one stream holds the only slot: a second request is refused
            async with aiohttp.ClientSession() as s:
                r = await s.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}, headers=auth(KEY_A))
                assert r.status == 200
                await r.content.readuntil(b"\n\n")
                status, headers, _ = await post(gw.url, CHAT, auth(KEY_A))
                assert status == 429 and headers["Retry-After"] == "1"
                r.close()  # the client goes away mid-stream
            await wait_until(lambda: lim.usage["alpha"].concurrent == 0)
            # a timed-out request returns its slot too
            stall["on"] = True
            assert (await post(gw.url, CHAT, auth(KEY_A)))[0] == 504
            assert lim.usage["alpha"].concurrent == 0
            stall["on"] = False
            gate.set()
            assert (await post(gw.url, {**CHAT, "stream": True}, auth(KEY_A)))[0] == 200
            assert lim.usage["alpha"].concurrent == 0 and gw.idle("b")


def test_sliding_window_retry_after_and_refund():
    now = [600.0 * 60]  # the start of a minute
    lim = Limiter(clock=lambda: now[0])
    key = ClientKey(name="k", key_sha256="0" * 64, requests_per_minute=2, tokens_per_minute=100)
    p1 = lim.acquire(key, 40)
    lim.acquire(key, 40).release(tokens=50)
    with pytest.raises(ClientError) as e:
        lim.acquire(key, 1)
    # 2 requests this minute: one more fits once 2 * (1 - f) + 1 <= 2, half a minute into the next
    assert e.value.status == 429 and int(e.value.headers["Retry-After"]) == 90
    p1.release(dispatched=False)  # never reached a backend: its 40 tokens come back
    assert lim.usage["k"].count(lim.window())[1] == 50
    now[0] += 90  # half a minute into the next one: 2 * 0.5 = 1 request in the window
    lim.acquire(key, 1)
    assert lim.in_flight() == 1


@pytest.mark.slow
async def test_limits_shared_across_replicas_and_local_when_redis_is_down():
    gate = asyncio.Event()
    server = ValkeyProcess()
    server.start()
    try:
        async with ScriptedBackend(handler=held_stream(gate)).running() as be:
            cfg = gateway_config(
                [{"name": "b", "url": be.url, "models": ["m"]}],
                state={"url": server.url, "namespace": f"t{free_port()}", "lease_s": 0.5},
                auth={"keys": [{"name": "alpha", "key_sha256": sha(KEY_A), "max_concurrent": 1,
                                "requests_per_minute": 3}]})
            async with running_gateway(cfg) as a, running_gateway(cfg) as b:
                la, lb = a.state.limiter, b.state.limiter
                async with aiohttp.ClientSession() as s:
                    r = await s.post(a.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                                     headers=auth(KEY_A))
                    await r.content.readuntil(b"\n\n")
                    # B learns that A holds alpha's only slot
                    await wait_until(lambda: _b_sees(b, 1))
                    status, _, body = await post(b.url, CHAT, auth(KEY_A))
                    assert status == 429 and b"concurrent" in body
                    gate.set()
                    await r.read()
                await wait_until(lambda: _b_sees(b, 0))
                # requests per minute are counted across both: A used 1, B's refusal counted none
                await wait_until(lambda: _shared_requests(b) >= 1)
                assert (await post(b.url, CHAT, auth(KEY_A)))[0] == 200
                await wait_until(lambda: _shared_requests(a) >= 2)
                assert (await post(a.url, CHAT, auth(KEY_A)))[0] == 200
                await wait_until(lambda: _shared_requests(b) >= 3)
                assert (await post(b.url, CHAT, auth(KEY_A)))[0] == 429
                assert b.metric("turbo_gateway_limits_store_up") == 1
                # Redis goes away: each replica keeps enforcing on its own counts
                server.stop()
                await wait_until(lambda: b.metric("turbo_gateway_limits_store_up") == 0)
                assert (await post(b.url, CHAT, auth(KEY_A)))[0] == 429
                assert (await post(b.url, CHAT, auth("not-a-key")))[0] == 401
                assert la.usage["alpha"].concurrent == 0 and lb.usage["alpha"].concurrent == 0
    finally:
        gate.set()
        server.cleanup()


def _b_sees(gw, n: int) -> bool:
    u = gw.state.limiter.usage.get("alpha")
    return u is not None and u.remote_concurrent == n


def _shared_requests(gw) -> float:
    lim = gw.state.limiter
    u = lim.usage.get("alpha")
    if u is None:
        return 0.0
    w = lim.window()
    return u.count(w)[0] + u.count(w - 1)[0]


async def test_limits_keep_working_with_a_frozen_redis():
    """A Redis that accepts connections and never answers: requests flow, limits are
    enforced on local counts, and the limiter says its store is down."""
    async with frozen_redis() as (url, held):
        async with ScriptedBackend().running() as be:
            cfg = gateway_config(
                [{"name": "b", "url": be.url, "models": ["m"]}],
                state={"url": url, "timeout_s": 0.1},
                auth={"keys": [{"name": "alpha", "key_sha256": sha(KEY_A), "requests_per_minute": 3}]})
            async with running_gateway(cfg) as gw:
                statuses = [(await post(gw.url, CHAT, auth(KEY_A)))[0] for _ in range(4)]
                assert statuses == [200, 200, 200, 429]
                await wait_until(lambda: gw.metric("turbo_gateway_limits_store_up") == 0)
                assert gw.state.limiter.usage["alpha"].concurrent == 0
                assert held  # it did connect to the frozen server


@pytest.mark.fixed_bug(reason="found by the review of the pipeline split")
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
