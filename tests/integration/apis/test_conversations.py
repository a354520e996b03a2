"""OpenAI's Conversations API, kept by the gateway: a conversation made with the openai
SDK's ``client.conversations`` is put before each Responses turn that names it
(``conversation``), gets that turn's input and output appended, is one session (its
turns go to one backend), is listed, updated and deleted from the store, and is seen
only by the key that made it. Simulated engines (which know no conversation: the field
reaching one would be ignored) behind the gateway, the official openai SDK in front;
kept in the process, and in a real Redis-protocol server (valkey)."""

from __future__ import annotations

import hashlib
import uuid
from contextlib import ExitStack

import openai
import pytest

from loadtest.sim.server import SimBackendConfig, start_backends
from tests.support.redis_server import redis_url
from tests.support.servers import gateway_config, running_gateway

MODEL = "sim-model"
KEYS = {"alice": "sk-alice", "bob": "sk-bob"}
SYSTEM = "You answer questions about gardening in detail. " * 12


def texts(items) -> list[str]:
    return [i.content if isinstance(i.content, str) else i.content[0].text for i in items]


@pytest.mark.parametrize("shared", [False, True], ids=["in_process", "redis"])
async def test_a_conversation_is_expanded_appended_listed_and_kept_per_key(shared):
    with ExitStack() as stack:
        redis = stack.enter_context(redis_url()) if shared else None
        await _conversation_checks(redis)


async def _conversation_checks(redis: str | None) -> None:
    runners, urls = await start_backends([SimBackendConfig.from_dict(
        {"name": n, "models": [MODEL], "speed": 50.0, "eos_after": 3}) for n in ("a", "b")])
    cfg = gateway_config([{"name": n, "url": u, "models": [MODEL]} for n, u in urls.items()],
                         routing={"policy": "cache_aware"},
                         auth={"keys": [{"name": n, "key_sha256": hashlib.sha256(k.encode()).hexdigest(),
                                         "route_details": True} for n, k in KEYS.items()]},
                         **({"state": {"url": redis, "namespace": f"t{uuid.uuid4().hex[:8]}"}} if redis else {}))
    try:
        async with running_gateway(cfg) as gw, \
                openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEYS["alice"], max_retries=0) as alice, \
                openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEYS["bob"], max_retries=0) as bob:
            first = {"type": "message", "role": "user", "content": "I grow tomatoes."}
            conv = await alice.conversations.create(items=[first], metadata={"topic": "garden"})
            assert conv.id.startswith("conv_") and conv.metadata == {"topic": "garden"}
            alone = await alice.responses.create(model=MODEL, instructions=SYSTEM, input="When to water?")
            raw = await alice.responses.with_raw_response.create(model=MODEL, instructions=SYSTEM,
                                                                 input="When to water?", conversation=conv.id)
            r1 = raw.parse()
            assert r1.usage is not None and alone.usage is not None
            # the conversation's item came before the turn's own input
            assert r1.usage.input_tokens > alone.usage.input_tokens
            route1 = dict(p.split("=", 1) for p in raw.headers["x-turbo-route"].split("; "))
            raw = await alice.responses.with_raw_response.create(
                model=MODEL, instructions=SYSTEM, input="And in summer?", conversation={"id": conv.id})
            r2 = raw.parse()
            route2 = dict(p.split("=", 1) for p in raw.headers["x-turbo-route"].split("; "))
            assert r2.usage is not None
            assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens
            assert r2.usage.input_tokens_details.cached_tokens > 0
            # one session: both turns on one backend
            assert route1["session"] == route2["session"] and route2["placement"] == "home"
            assert route1["backend"] == route2["backend"]
            items = await alice.conversations.items.list(conv.id, order="asc")
            assert texts(items.data) == ["I grow tomatoes.", "When to water?", r1.output_text, "And in summer?",
                                         r2.output_text]
            assert all(i.id for i in items.data)
            page = await alice.conversations.items.list(conv.id, limit=2)  # newest first by default
            assert texts(page.data) == [r2.output_text, "And in summer?"] and page.has_more
            # the stored response names its conversation and lists its whole input
            got = await alice.responses.retrieve(r2.id)
            assert got.conversation is not None and got.conversation.id == conv.id
            # items added, read and deleted by id
            added = await alice.conversations.items.create(
                conv.id, items=[{"type": "message", "role": "user", "content": "Note: clay soil."}])
            note = added.data[0]
            assert (await alice.conversations.items.retrieve(note.id, conversation_id=conv.id)).id == note.id
            after = await alice.conversations.items.delete(note.id, conversation_id=conv.id)
            assert after.id == conv.id
            with pytest.raises(openai.NotFoundError):
                await alice.conversations.items.retrieve(note.id, conversation_id=conv.id)
            updated = await alice.conversations.update(conv.id, metadata={"topic": "tomatoes"})
            assert updated.metadata == {"topic": "tomatoes"}
            assert (await alice.conversations.retrieve(conv.id)).metadata == {"topic": "tomatoes"}
            # another key sees none of it, nor can it write into it
            with pytest.raises(openai.NotFoundError):
                await bob.conversations.retrieve(conv.id)
            with pytest.raises(openai.NotFoundError):
                await bob.conversations.items.list(conv.id)
            with pytest.raises(openai.NotFoundError) as e:
                await bob.responses.create(model=MODEL, input="hi", conversation=conv.id)
            assert e.value.body["param"] == "conversation"
            # bad input: OpenAI's error shape, the field named
            with pytest.raises(openai.BadRequestError) as e:
                await alice.responses.create(model=MODEL, input="x", conversation=conv.id, previous_response_id=r1.id)
            assert e.value.body["param"] == "conversation"
            with pytest.raises(openai.BadRequestError) as e:
                await alice.conversations.create(items=[{"type": "message", "content": "no role"}])  # type: ignore[typeddict-item]
            assert e.value.body["param"] == "items[0]"
            deleted = await alice.conversations.delete(conv.id)
            assert deleted.deleted and deleted.id == conv.id
            with pytest.raises(openai.NotFoundError):
                await alice.conversations.retrieve(conv.id)
            with pytest.raises(openai.NotFoundError):
                await alice.responses.create(model=MODEL, input="hi", conversation=conv.id)
        assert gw.idle("a") and gw.idle("b")
    finally:
        for r in runners:
            await r.cleanup()
