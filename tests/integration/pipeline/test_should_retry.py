"""One retry layer: the gateway's answers tell the openai SDKs whether to retry.

The official SDKs retry 408, 409, 429 and 5xx twice by default unless the answer says
``x-should-retry: false``. A failure the gateway has already retried says ``false`` (one
SDK call is ``retries.max_attempts`` backend attempts, not three times that); a refusal
a client should retry (per-key limits, a full admission queue, ``batch_deferred``) says
``true`` with ``retry-after`` and ``retry-after-ms``, which the SDK waits out. The real
SDK at its default ``max_retries``, over real sockets.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from tests.support.servers import ScriptedBackend, gateway_config, running_gateway

KEY = "sk-test-should-retry-0123456789"
MESSAGES = [{"role": "user", "content": "hi"}]


def _sdk(url: str, seen: list, key: str = "unused") -> openai.AsyncOpenAI:
    """The real SDK at its default ``max_retries``; ``seen`` gets each request sent and
    each response received: (kind, time.monotonic(), status, headers)."""

    async def on_request(request) -> None:
        seen.append(("request", time.monotonic(), 0, None))

    async def on_response(response) -> None:
        seen.append(("response", time.monotonic(), response.status_code, response.headers))

    http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [on_request], "response": [on_response]})
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, http_client=http)


async def _always(status: int, b, request, body):
    return web.json_response({"error": {"message": "engine overloaded", "type": "server_error"}}, status=status)


@pytest.mark.parametrize("status", [502, 503, 504])
async def test_a_failure_the_gateway_retried_is_not_retried_by_the_sdk(status):
    async def answer(b, request, body):
        return await _always(status, b, request, body)

    async with ScriptedBackend(handler=answer).running() as a, ScriptedBackend(handler=answer).running() as b:
        cfg = gateway_config([{"name": "a", "url": a.url, "models": ["m"]},
                              {"name": "b", "url": b.url, "models": ["m"]}],
                             retries={"max_attempts": 3}, breaker={"failure_threshold": 0})
        async with running_gateway(cfg) as gw:
            seen: list = []
            client = _sdk(gw.url, seen)
            assert client.max_retries == 2  # the SDK's default: it would make 3 calls of its own
            with pytest.raises(openai.APIStatusError) as e:
                await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4)
            await client.close()
            assert e.value.status_code == status
            assert e.value.response.headers["x-should-retry"] == "false"
            assert [s[2] for s in seen if s[0] == "response"] == [status]  # one gateway request
            assert len(a.attempt_times) + len(b.attempt_times) == 3  # retries.max_attempts backend attempts


async def test_no_backend_at_all_is_not_retried_by_the_sdk():
    cfg = gateway_config([{"name": "gone", "url": "http://127.0.0.1:9", "models": ["m"]}],
                         retries={"max_attempts": 2})
    async with running_gateway(cfg) as gw:
        seen: list = []
        client = _sdk(gw.url, seen)
        with pytest.raises(openai.APIStatusError) as e:
            await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4)
        await client.close()
        assert e.value.status_code in (502, 503)
        assert e.value.response.headers["x-should-retry"] == "false"
        assert [s[2] for s in seen if s[0] == "response"] == [e.value.status_code]


async def test_a_per_key_limit_is_waited_out_by_the_sdk_and_then_served():
    release = asyncio.Event()

    async def answer(b, request, body):
        if len(b.attempt_times) == 1:
            await release.wait()  # the first request holds the key's only slot
        return web.json_response({"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                               "finish_reason": "stop"}]})

    keys = {"keys": [{"name": "k", "key_sha256": hashlib.sha256(KEY.encode()).hexdigest(), "max_concurrent": 1}]}
    async with ScriptedBackend(handler=answer).running() as be:
        async with running_gateway(gateway_config([{"name": "b", "url": be.url, "models": ["m"]}], auth=keys)) as gw:
            first = asyncio.ensure_future(_sdk(gw.url, [], KEY).chat.completions.create(
                model="m", messages=MESSAGES, max_tokens=4))
            while not be.attempt_times:  # the slot is taken once the first request reached the backend
                await asyncio.sleep(0.01)
            seen: list = []
            client = _sdk(gw.url, seen, KEY)
            second = asyncio.ensure_future(client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4))
            while not any(s[0] == "response" for s in seen):  # the 429
                await asyncio.sleep(0.01)
            release.set()
            assert (await first).choices[0].message.content == "ok"
            assert (await second).choices[0].message.content == "ok"
            await client.close()
            responses = [s for s in seen if s[0] == "response"]
            assert [r[2] for r in responses] == [429, 200]
            h = responses[0][3]
            assert h["x-should-retry"] == "true" and int(h["retry-after"]) >= 1
            wait_s = int(h["retry-after-ms"]) / 1000
            retried_at = [s[1] for s in seen if s[0] == "request"][1]
            assert retried_at - responses[0][1] >= wait_s * 0.99  # the SDK waited what the gateway asked
            assert len(be.attempt_times) == 2  # the refused call never reached the backend


async def test_a_full_admission_queue_asks_the_sdk_to_retry():
    release = asyncio.Event()

    async def answer(b, request, body):
        await release.wait()
        return web.json_response({"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                               "finish_reason": "stop"}]})

    async with ScriptedBackend(handler=answer).running() as be:
        cfg = gateway_config([{"name": "b", "url": be.url, "models": ["m"]}],
                             admission={"max_in_flight_per_backend": 1, "queue_size": 0})
        async with running_gateway(cfg) as gw:
            first = asyncio.ensure_future(_sdk(gw.url, []).chat.completions.create(
                model="m", messages=MESSAGES, max_tokens=4))
            while not be.attempt_times:
                await asyncio.sleep(0.01)
            seen: list = []
            client = _sdk(gw.url, seen)
            second = asyncio.ensure_future(client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4))
            while not any(s[0] == "response" for s in seen):
                await asyncio.sleep(0.01)
            release.set()
            await first
            assert (await second).choices[0].message.content == "ok"
            await client.close()
            responses = [s for s in seen if s[0] == "response"]
            assert [r[2] for r in responses] == [503, 200]
            assert responses[0][3]["x-should-retry"] == "true" and responses[0][3]["retry-after-ms"] == "1000"


@pytest.mark.parametrize("fast_path", [True, False])
async def test_every_error_the_gateway_answers_itself_says_whether_to_retry(fast_path, monkeypatch):
    """The caller's mistakes (400, 401, 404, 405, 413, 415, an unknown route) and the
    gateway's own internal error say ``x-should-retry: false``: no SDK retries them."""
    keys = {"keys": [{"name": "k", "key_sha256": hashlib.sha256(KEY.encode()).hexdigest()}]}
    auth = {"Authorization": f"Bearer {KEY}"}
    chat = "/v1/chat/completions"
    ok = {"model": "m", "messages": MESSAGES, "max_tokens": 4}
    async with ScriptedBackend().running() as be:
        cfg = gateway_config([{"name": "b", "url": be.url, "models": ["m"]}], auth=keys,
                             limits={"max_body_bytes": 10_000}, listen={"fast_path": fast_path})
        async with running_gateway(cfg) as gw, aiohttp.ClientSession() as http:
            cases = [
                ("POST", chat, {}, orjson.dumps(ok), "application/json", 401),
                ("POST", chat, auth, b"{not json", "application/json", 400),
                ("POST", chat, auth, orjson.dumps({**ok, "model": "nope"}), "application/json", 404),
                ("POST", chat, auth, orjson.dumps(ok), "text/plain", 415),
                ("POST", chat, auth, b'{"x": "' + b"a" * 20_000 + b'"}', "application/json", 413),
                ("GET", "/v1/no/such/route", auth, b"", None, 404),
                ("DELETE", "/v1/models", auth, b"", None, 405),
            ]
            for method, path, headers, body, ctype, status in cases:
                h = dict(headers)
                if ctype:
                    h["Content-Type"] = ctype
                async with http.request(method, gw.url + path, headers=h, data=body) as r:
                    assert r.status == status, (path, await r.text())
                    assert r.headers.get("x-should-retry") == "false", (method, path, status)
                    assert "error" in await r.json(content_type=None)

            def broken(*a, **k):
                raise RuntimeError("injected fault")

            monkeypatch.setattr(gw.state.core, "request", broken)
            async with http.post(gw.url + chat, headers=auth, json=ok) as r:
                assert r.status == 500 and (await r.json())["error"]["code"] == "internal_error"
                assert r.headers.get("x-should-retry") == "false"
