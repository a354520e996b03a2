"""Behind a real Envoy, the routes on what the gateway keeps (stored responses,
background responses, conversations) are answered by the endpoint picker from the
fleet's store, as the gateway's own data plane answers them: authenticated (401),
scoped to the caller's key (404 for another's), in OpenAI's error shape; a background
response created through Envoy is run by the picker's process and polled through
Envoy. The official openai SDK in front, simulated engines behind."""

from __future__ import annotations

import asyncio
import hashlib

import aiohttp
import openai
import pytest

from loadtest.sim.server import SimBackendConfig, start_backends
from tests.support.envoy import picker_stack
from tests.support.servers import gateway_config

MODEL = "sim-model"
KEYS = {"alice": "sk-alice", "bob": "sk-bob"}


async def test_stored_routes_are_answered_by_the_picker_per_key():
    runners, urls = await start_backends([SimBackendConfig.from_dict(
        {"name": n, "models": [MODEL], "speed": 50.0, "eos_after": 3}) for n in ("a", "b")])
    cfg = gateway_config([{"name": n, "url": u, "models": [MODEL]} for n, u in urls.items()],
                         auth={"keys": [{"name": n, "key_sha256": hashlib.sha256(k.encode()).hexdigest()}
                                        for n, k in KEYS.items()]})
    try:
        async with picker_stack(cfg) as stack, \
                openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=KEYS["alice"], max_retries=0) as alice, \
                openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=KEYS["bob"], max_retries=0) as bob:
            r1 = await alice.responses.create(model=MODEL, input="Is it raining?")
            got = await alice.responses.retrieve(r1.id)
            assert got.id == r1.id and got.output_text == r1.output_text
            items = await alice.responses.input_items.list(r1.id)
            assert [i.content for i in items.data] == ["Is it raining?"]
            with pytest.raises(openai.BadRequestError) as e:  # a foreground response
                await alice.responses.cancel(r1.id)
            assert e.value.body["code"] == "not_background"
            with pytest.raises(openai.NotFoundError) as e:  # another key's
                await bob.responses.retrieve(r1.id)
            assert e.value.body["code"] == "response_not_found"
            # a conversation made, used by a turn and listed, all through Envoy
            conv = await alice.conversations.create(items=[{"type": "message", "role": "user", "content": "Hi."}])
            turn = await alice.responses.create(model=MODEL, input="Rain?", conversation=conv.id)
            listed = await alice.conversations.items.list(conv.id, order="asc")
            assert [i.id for i in listed.data][-1] == turn.output[0].id and len(listed.data) == 3
            with pytest.raises(openai.NotFoundError):
                await bob.conversations.items.list(conv.id)
            # a background response: queued at once, run by the picker's process, polled through Envoy
            bg = await alice.responses.create(model=MODEL, input="Later.", background=True)
            assert bg.status == "queued"
            for _ in range(500):
                polled = await alice.responses.retrieve(bg.id)
                if polled.status not in ("queued", "in_progress"):
                    break
                await asyncio.sleep(0.02)
            assert polled.status == "completed" and polled.output_text
            assert (await alice.conversations.delete(conv.id)).deleted
            deleted = await alice.responses.with_raw_response.delete(r1.id)
            assert deleted.http_response.json() == {"id": r1.id, "object": "response", "deleted": True}
            with pytest.raises(openai.NotFoundError):
                await alice.responses.retrieve(r1.id)
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{stack.url}/v1/responses/{bg.id}", headers={"Authorization": "Bearer sk-no"}) as r:
                    assert r.status == 401 and (await r.json())["error"]["type"]
                async with s.post(f"{stack.url}/v1/responses/{bg.id}", headers={"Authorization": "Bearer sk-bob"}) as r:
                    assert r.status == 405 and "GET" in r.headers["Allow"]
                async with s.post(f"{stack.url}/v1/conversations", data=b"{not json",
                                  headers={"Authorization": "Bearer sk-bob", "Content-Type": "application/json"}) as r:
                    assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_json"
        assert stack.gateway.idle("a") and stack.gateway.idle("b")
    finally:
        for r in runners:
            await r.cleanup()
