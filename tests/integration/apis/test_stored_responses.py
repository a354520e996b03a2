"""The Responses API's conversation state belongs to the fleet: a response stored by
the gateway (:mod:`gateway.store.responses`) is expanded into a follow-up turn's input
on any backend and any replica, survives the backend that made it, is answered by
``GET``/``input_items``/``DELETE`` from the store, and is seen only by the key that
made it. Simulated engines (which keep no responses: a ``previous_response_id`` reaching
one is a 404) behind the gateway, the official openai SDK in front; the replicas share
a real Redis-protocol server (valkey)."""

from __future__ import annotations

import hashlib
import uuid
from contextlib import AsyncExitStack, asynccontextmanager

import aiohttp
import openai
import pytest

from loadtest.sim.server import SimBackendConfig, start_backends
from tests.support.redis_server import redis_url
from tests.support.servers import gateway_config, running_gateway

MODEL = "sim-model"
KEYS = {"alice": "sk-alice", "bob": "sk-bob"}
SYSTEM = "You answer questions about the weather in detail. " * 12


@asynccontextmanager
async def fleet(replicas: int = 1, redis: str | None = None):
    """``replicas`` gateways (sharing ``redis`` when given) before two simulated engines;
    yields the gateways and the engines' URLs by name."""
    runners, urls = await start_backends([SimBackendConfig.from_dict(
        {"name": n, "models": [MODEL], "speed": 50.0, "eos_after": 3}) for n in ("a", "b")])
    cfg = gateway_config([{"name": n, "url": u, "models": [MODEL]} for n, u in urls.items()],
                         routing={"policy": "cache_aware"},
                         auth={"keys": [{"name": n, "key_sha256": hashlib.sha256(k.encode()).hexdigest()}
                                        for n, k in KEYS.items()]},
                         **({"state": {"url": redis, "namespace": f"t{uuid.uuid4().hex[:8]}"}} if redis else {}))
    try:
        async with AsyncExitStack() as stack:
            gws = [await stack.enter_async_context(running_gateway(cfg)) for _ in range(replicas)]
            yield gws, urls
    finally:
        for r in runners:
            await r.cleanup()


def client(gw, who: str = "alice") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEYS[who], max_retries=0)


async def test_a_chain_is_expanded_from_the_store_listed_and_deleted():
    async with fleet() as ([gw], _), client(gw) as alice, client(gw, "bob") as bob:
        r1 = await alice.responses.create(model=MODEL, instructions=SYSTEM, input="Is it raining?")
        r2 = await alice.responses.create(model=MODEL, instructions=SYSTEM, input="And tomorrow?",
                                          previous_response_id=r1.id)
        assert r1.usage is not None and r2.usage is not None
        # the second turn's prompt holds the first turn, its answer and the new question
        assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens
        assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens // 2
        # a streamed third turn is stored from its response.completed event
        async with alice.responses.stream(model=MODEL, input="Thanks.", previous_response_id=r2.id) as s:
            async for _ in s:
                pass
            r3 = await s.get_final_response()
        got = await alice.responses.retrieve(r3.id)
        assert got.id == r3.id and got.output_text == r3.output_text
        items = await alice.responses.input_items.list(r3.id, order="asc")
        texts = [i.content if isinstance(i.content, str) else i.content[0].text for i in items.data]
        assert texts == ["Is it raining?", r1.output_text, "And tomorrow?", r2.output_text, "Thanks."]
        # one tenant never reads another's
        with pytest.raises(openai.NotFoundError):
            await bob.responses.retrieve(r1.id)
        with pytest.raises(openai.BadRequestError) as e:
            await bob.responses.create(model=MODEL, input="x", previous_response_id=r1.id)
        assert e.value.body["code"] == "previous_response_not_found"
        # store: false keeps nothing
        r4 = await alice.responses.create(model=MODEL, input="Off the record.", store=False)
        with pytest.raises(openai.NotFoundError):
            await alice.responses.retrieve(r4.id)
        deleted = await alice.responses.with_raw_response.delete(r1.id)  # the SDK's parse returns None
        assert deleted.status_code == 200
        assert deleted.http_response.json() == {"id": r1.id, "object": "response", "deleted": True}
        with pytest.raises(openai.NotFoundError):
            await alice.responses.retrieve(r1.id)
        with pytest.raises(openai.BadRequestError):
            await alice.responses.create(model=MODEL, input="again", previous_response_id=r1.id)
    assert gw.idle("a") and gw.idle("b")


async def test_a_chain_crosses_replicas_and_survives_the_backend_that_made_it():
    with redis_url() as redis:
        async with fleet(2, redis) as ([gw1, gw2], urls), client(gw1) as one, client(gw2) as two:
            raw = await one.responses.with_raw_response.create(model=MODEL, instructions=SYSTEM, input="Hello.")
            r1, first = raw.parse(), raw.headers["x-turbo-backend"]
            # the next turn on the other replica
            r2 = await two.responses.create(model=MODEL, instructions=SYSTEM, input="Go on.",
                                            previous_response_id=r1.id)
            assert r2.usage is not None and r1.usage is not None
            assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens
            # the backend that made both turns restarts with an empty cache
            async with aiohttp.ClientSession() as s, s.post(urls[first] + "/admin/crash", json={"down_s": 0.3}) as r:
                assert r.status == 200
            r3 = await one.responses.create(model=MODEL, instructions=SYSTEM, input="And then?",
                                            previous_response_id=r2.id)
            assert r3.status == "completed" and r3.usage is not None
            assert r3.usage.input_tokens > r2.usage.input_tokens + r2.usage.output_tokens
            got = await two.responses.retrieve(r3.id)
            assert got.output_text == r3.output_text
