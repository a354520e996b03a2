"""Request ids the engine can trust (issue 27, point 3): each upstream attempt carries
its own id from the cryptographic source, the caller's id only as a readable prefix;
the caller's id is echoed when it is short and plain, else replaced."""

from __future__ import annotations

import asyncio

import openai
from aiohttp import web

from tests.support.servers import ScriptedBackend, default_answer, gateway_config, running_gateway

CHAT = [{"role": "user", "content": "hi"}]


def _sent_id(headers: dict[str, str]) -> str:
    return {k.lower(): v for k, v in headers.items()}["x-request-id"]


async def test_two_concurrent_requests_with_one_id_both_succeed_and_the_engine_sees_two_ids():
    running: set[str] = set()
    both_in = asyncio.Event()

    async def engine(backend, request, body):
        # vLLM's behaviour: the header is the engine's request id, and an id already
        # running is refused
        rid = request.headers["x-request-id"]
        if rid in running:
            return web.json_response({"error": {"message": f"Request id {rid} already running."}}, status=400)
        running.add(rid)
        try:
            if len(running) == 2:
                both_in.set()
            await asyncio.wait_for(both_in.wait(), 10)
            return await default_answer(backend, request, body)
        finally:
            running.discard(rid)

    be = ScriptedBackend(handler=engine)
    async with be.running(), running_gateway(gateway_config([{"name": "b", "url": be.url, "models": ["m"]}],
                                                            retries={"max_attempts": 1})) as gw:
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)

        async def one():
            return await client.chat.completions.with_raw_response.create(
                model="m", messages=CHAT, extra_headers={"x-request-id": "same-id"})

        answers = await asyncio.gather(one(), one())
        assert [a.parse().choices[0].message.content for a in answers] == ["hello", "hello"]
        assert [a.headers["x-request-id"] for a in answers] == ["same-id", "same-id"]  # echoed as sent
        seen = [_sent_id(h) for h in be.headers]
        assert len(set(seen)) == 2 and all(s.startswith("same-id-") for s in seen)


async def test_each_attempt_of_one_request_carries_its_own_id():
    async def fail_first(backend, request, body):
        if len(backend.bodies) == 1:
            return web.Response(status=503)
        return await default_answer(backend, request, body)

    be = ScriptedBackend(handler=fail_first)
    async with be.running(), running_gateway(gateway_config([{"name": "b", "url": be.url, "models": ["m"]}],
                                                            retries={"failed_backend_cooldown_s": 0})) as gw:
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        raw = await client.chat.completions.with_raw_response.create(model="m", messages=CHAT,
                                                                     extra_headers={"x-request-id": "r1"})
        assert raw.headers["x-request-id"] == "r1"
        seen = [_sent_id(h) for h in be.headers]
        assert len(seen) == 2 and len(set(seen)) == 2 and all(s.startswith("r1-") for s in seen)


async def test_a_long_or_strange_caller_id_is_replaced_and_the_answer_says_by_what():
    be = ScriptedBackend()
    async with be.running(), running_gateway(gateway_config([{"name": "b", "url": be.url, "models": ["m"]}])) as gw:
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        for bad in ("r" * 129, "has space", 'quo"te', "semi;colon"):  # non-ASCII: tests/test_review_perf.py
            raw = await client.chat.completions.with_raw_response.create(
                model="m", messages=CHAT, extra_headers={"x-request-id": bad})
            echoed = raw.headers["x-request-id"]
            assert echoed != bad and len(echoed) == 32 and int(echoed, 16) >= 0
            assert _sent_id(be.headers[-1]).startswith(echoed + "-")
        ok = "a" * 128
        raw = await client.chat.completions.with_raw_response.create(model="m", messages=CHAT,
                                                                     extra_headers={"x-request-id": ok})
        assert raw.headers["x-request-id"] == ok


def test_gateway_made_ids_do_not_repeat():
    from gateway import request_ids

    ids = {request_ids.new_id() for _ in range(5000)}
    assert len(ids) == 5000
    ups = {request_ids.upstream_id("x") for _ in range(5000)}
    assert len(ups) == 5000
