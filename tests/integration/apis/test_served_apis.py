"""Every API the gateway serves besides chat and completions, through its own data
plane over real sockets: two simulated engines (loadtest/sim, which serve each API in
vLLM's or Anthropic's shape) behind it, the official ``openai`` and ``anthropic`` SDKs
in front. Each API is routed (prefix affinity across a conversation's turns), counted
from its own usage (metrics and the usage ledger), priced as its API costs (the pooling
APIs as prefill only, in ``x-turbo-route``), authenticated (``x-api-key`` for the
anthropic SDK) and refused in its own error shape."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from contextlib import asynccontextmanager

import aiohttp
import anthropic
import openai
import orjson
import pytest
from aiohttp import web

from loadtest.sim.server import SimBackendConfig, start_backends
from routing.tokenizer import load_tokenizer
from tests.support.chat_cases import TINY
from tests.support.envoy import picker_stack
from tests.support.servers import ScriptedBackend, gateway_config, running_gateway, serving

MODEL = "sim-model"
KEY = "sk-apis"
SYSTEM = "You are a careful assistant who answers in full sentences. " * 20


@asynccontextmanager
async def fleet(behind_envoy: bool = False):
    """The gateway before two simulated engines; ``behind_envoy``: its endpoint picker
    behind a real Envoy, whose address is then the one served (``gw.url``)."""
    runners, urls = await start_backends([SimBackendConfig.from_dict(
        {"name": n, "models": [MODEL], "speed": 50.0, "eos_after": 4}) for n in ("a", "b")])
    cfg = gateway_config([{"name": n, "url": u, "models": [MODEL]} for n, u in urls.items()],
                         routing={"policy": "cache_aware"},
                         auth={"keys": [{"name": "tenant", "key_sha256": hashlib.sha256(KEY.encode()).hexdigest(),
                                         "route_details": True}]})
    try:
        if behind_envoy:
            async with picker_stack(cfg) as stack:
                yield dataclasses.replace(stack.gateway, url=stack.url)  # the gateway's state, Envoy's address
        else:
            async with running_gateway(cfg) as gw:
                yield gw
    finally:
        for r in runners:
            await r.cleanup()


def route(headers) -> dict[str, str]:
    return dict(p.split("=", 1) for p in headers["x-turbo-route"].split("; "))


def served(gw, status: str = "200") -> float:
    return sum(gw.metric("turbo_gateway_requests_total", model=MODEL, backend=b, status=status) for b in ("a", "b"))


@pytest.mark.parametrize("behind_envoy", [False, True], ids=["own_data_plane", "behind_envoy"])
async def test_responses_turns_stay_on_one_backend_and_are_counted_from_their_usage(behind_envoy):
    async with fleet(behind_envoy) as gw, \
            openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0) as client:
        raw = await client.responses.with_raw_response.create(model=MODEL, instructions=SYSTEM, input="Hello.",
                                                              max_output_tokens=8)
        r = raw.parse()
        first = raw.headers["x-turbo-backend"]
        assert r.status == "completed" and len(r.output_text.split()) == 4
        turn2 = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": r.output_text},
                 {"role": "user", "content": "And then?"}]
        streamed = []
        async with client.responses.stream(model=MODEL, instructions=SYSTEM, input=turn2,
                                           max_output_tokens=8) as stream:
            async for event in stream:
                streamed.append(event.type)
            final = await stream.get_final_response()
        assert streamed[0] == "response.created" and streamed[-1] == "response.completed"
        assert streamed.count("response.output_text.delta") == 4
        assert final.usage is not None and final.usage.input_tokens_details.cached_tokens > 0
        # the second turn went where the first left its KV cache
        assert gw.metric("turbo_gateway_requests_total", model=MODEL, backend=first, status="200") == 2
        assert gw.metric("turbo_gateway_prompt_tokens_total", model=MODEL) == \
            r.usage.input_tokens + final.usage.input_tokens
        assert gw.metric("turbo_gateway_completion_tokens_total", model=MODEL) == 8
        assert gw.metric("turbo_gateway_cached_prompt_tokens_total", model=MODEL) == \
            final.usage.input_tokens_details.cached_tokens
        # a chained turn: the gateway expands the previous one from its store, whole answer or stream
        for previous in (r, final):
            chained = await client.responses.create(model=MODEL, instructions=SYSTEM, input="Once more.",
                                                    previous_response_id=previous.id, max_output_tokens=8)
            assert chained.usage is not None and previous.usage is not None
            assert chained.usage.input_tokens > previous.usage.input_tokens + previous.usage.output_tokens
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(model=MODEL, input=7)  # type: ignore[arg-type]
        assert e.value.body["param"] == "input"
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model="no-such-model", input="x")
    assert served(gw) == 4


@pytest.mark.parametrize("behind_envoy", [False, True], ids=["own_data_plane", "behind_envoy"])
async def test_messages_with_the_anthropic_sdk_key_usage_stream_and_errors(behind_envoy):
    async with fleet(behind_envoy) as gw:
        client = anthropic.AsyncAnthropic(base_url=gw.url, api_key=KEY, max_retries=0)
        m = await client.messages.create(model=MODEL, system=SYSTEM, max_tokens=8,
                                         messages=[{"role": "user", "content": "Hello."}])
        assert m.type == "message" and m.stop_reason == "end_turn" and len(m.content[0].text.split()) == 4
        async with client.messages.stream(model=MODEL, system=SYSTEM, max_tokens=3, messages=[
                {"role": "user", "content": "Hello."}, {"role": "assistant", "content": m.content[0].text},
                {"role": "user", "content": "More."}]) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
        assert len(text.split()) == 3 and final.stop_reason == "max_tokens"
        assert final.usage.cache_read_input_tokens and final.usage.cache_read_input_tokens > 0
        prompt = (m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) + final.usage.input_tokens
                  + final.usage.cache_read_input_tokens)
        assert gw.metric("turbo_gateway_prompt_tokens_total", model=MODEL) == prompt
        assert gw.metric("turbo_gateway_completion_tokens_total", model=MODEL) == 4 + 3
        count = await client.messages.count_tokens(model=MODEL, system=SYSTEM,
                                                   messages=[{"role": "user", "content": "Hello."}])
        assert count.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
        # errors as the anthropic SDK raises them: Anthropic's shape, the gateway's statuses
        with pytest.raises(anthropic.BadRequestError) as e:
            await client.messages.create(model=MODEL, max_tokens=0, messages=[{"role": "user", "content": "x"}])
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
        assert "max_tokens" in e.value.body["error"]["message"]
        with pytest.raises(anthropic.NotFoundError) as e:
            await client.messages.create(model="no-such-model", max_tokens=4,
                                         messages=[{"role": "user", "content": "x"}])
        assert e.value.body["error"]["type"] == "not_found_error"
        wrong = anthropic.AsyncAnthropic(base_url=gw.url, api_key="sk-wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as e:
            await wrong.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x"}])
        assert e.value.body["error"]["type"] == "authentication_error"
    assert served(gw) == 3  # create, stream, count_tokens; the refusals never reached a backend


async def test_embeddings_rerank_and_score_are_priced_as_prefill_only():
    async with fleet() as gw, openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0) as client:
        raw = await client.embeddings.with_raw_response.create(model=MODEL, input=[SYSTEM, "short text"])
        e = raw.parse()
        assert len(e.data) == 2 and len(e.data[0].embedding) > 0
        assert route(raw.headers)["output_tokens_est"] == "0"
        assert gw.metric("turbo_gateway_prompt_tokens_total", model=MODEL) == e.usage.prompt_tokens > 0
        assert gw.metric("turbo_gateway_completion_tokens_total", model=MODEL) == 0
        chat = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        assert int(route(chat.headers)["output_tokens_est"]) > 0
        auth = {"Authorization": f"Bearer {KEY}"}
        async with aiohttp.ClientSession(headers=auth) as s:
            for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
                async with s.post(gw.url + path, json={"model": MODEL, "query": "which?",
                                                       "documents": ["one", {"text": "two"}], "top_n": 1}) as r:
                    body = await r.json()
                    assert r.status == 200 and len(body["results"]) == 1, body
                    assert route(r.headers)["output_tokens_est"] == "0"
            async with s.post(gw.url + "/v1/score", json={"model": MODEL, "text_1": "a", "text_2": ["b", "c"]}) as r:
                body = await r.json()
                assert r.status == 200 and len(body["data"]) == 2, body
            async with s.post(gw.url + "/v1/rerank", json={"model": MODEL, "query": "q"}) as r:
                body = await r.json()
                assert r.status == 400 and body["error"]["param"] == "documents", body
            async with s.post(gw.url + "/v1/embeddings", json={"model": MODEL, "input": "x", "stream": True}) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "stream"
        with pytest.raises(openai.AuthenticationError):
            async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-wrong", max_retries=0) as wrong:
                await wrong.embeddings.create(model=MODEL, input="x")
    assert served(gw) == 1 + 1 + 3 + 1
    assert [gw.metric("turbo_gateway_api_requests_total", api=a, status="200")
            for a in ("embeddings", "chat", "rerank", "score")] == [1, 1, 3, 1]
    # latency and tokens by API: the pooling APIs' prompts apart from chat's
    assert [gw.metric("turbo_gateway_e2e_seconds_count", model=MODEL, api=a)
            for a in ("embeddings", "chat", "rerank", "score")] == [1, 1, 3, 1]
    assert gw.metric("turbo_gateway_prompt_tokens_total", api="embeddings") == e.usage.prompt_tokens
    assert gw.metric("turbo_gateway_completion_tokens_total", api="embeddings") == 0
    assert gw.metric("turbo_gateway_completion_tokens_total", api="chat") == chat.parse().usage.completion_tokens
    assert gw.idle("a") and gw.idle("b")


async def test_a_backend_without_an_apis_route_is_learned_and_skipped_not_broken():
    """A backend that answers an API's path with a 404 not about the model (the
    scripted backend serves only chat and completions) is retried elsewhere, left out
    of that API from then on, its breaker untouched; when no backend serves the API the
    client gets a 404 ``api_not_served`` in the API's shape, and a backend configured
    without an API is never sent it."""
    be = ScriptedBackend()
    runners, urls = await start_backends([SimBackendConfig.from_dict({"name": "sim", "models": [MODEL],
                                                                      "speed": 50.0})])
    try:
        async with be.running():
            cfg = gateway_config([{"name": "old", "url": be.url, "models": [MODEL]},
                                  {"name": "sim", "url": urls["sim"], "models": [MODEL],
                                   "apis": ["chat", "embeddings"]}])
            async with running_gateway(cfg) as gw, \
                    openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0) as client:
                for _ in range(4):  # round robin would send two of them to the old backend
                    e = await client.embeddings.create(model=MODEL, input="some text")
                    assert len(e.data) == 1
                assert gw.metric("turbo_gateway_upstream_errors_total", backend="old", reason="api_not_served") == 1
                assert gw.state.fleet.backends["old"].breaker.state == "closed"
                assert gw.metric("turbo_gateway_requests_total", model=MODEL, backend="sim", status="200") == 4
                # no backend serves Messages: the old one has no route, the other is configured without it
                anthropic_client = anthropic.AsyncAnthropic(base_url=gw.url, api_key="unused", max_retries=0)
                with pytest.raises(anthropic.NotFoundError) as err:
                    await anthropic_client.messages.create(model=MODEL, max_tokens=4,
                                                           messages=[{"role": "user", "content": "x"}])
                assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "not_found_error"
                assert "messages API" in err.value.body["error"]["message"]
                with pytest.raises(anthropic.NotFoundError):  # now known: no backend is even tried
                    await anthropic_client.messages.create(model=MODEL, max_tokens=4,
                                                           messages=[{"role": "user", "content": "x"}])
                assert gw.metric("turbo_gateway_upstream_errors_total", backend="old", reason="api_not_served") == 2
                assert gw.metric("turbo_gateway_upstream_errors_total", backend="sim", reason="api_not_served") == 0
                # the old backend still serves chat
                for _ in range(2):
                    await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
                assert be.bodies  # it got its share of chat
    finally:
        for r in runners:
            await r.cleanup()


async def test_count_tokens_is_answered_from_the_models_tokenizer_without_an_engine():
    """With the model's own tokenizer configured, count_tokens is the gateway's answer:
    the messages rendered by the chat template as an engine renders them, no backend
    asked; without one, an engine answers."""
    tok = load_tokenizer(TINY)
    runners, urls = await start_backends([SimBackendConfig.from_dict({"name": "sim", "models": ["tiny", MODEL],
                                                                      "speed": 50.0})])
    cfg = gateway_config([{"name": "sim", "url": urls["sim"], "models": ["tiny", MODEL]}],
                         models={"tiny": {"tokenizer": str(TINY)}})
    messages = [{"role": "user", "content": [{"type": "text", "text": "Wie weit ist es nach Zürich?"}]},
                {"role": "assistant", "content": "Weit."}, {"role": "user", "content": "Und nach Bern?"}]
    view = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [
        {"type": "text", "text": "Wie weit ist es nach Zürich?"}]}, *messages[1:]]
    try:
        async with running_gateway(cfg) as gw:
            client = anthropic.AsyncAnthropic(base_url=gw.url, api_key="unused", max_retries=0)
            count = await client.messages.count_tokens(model="tiny", system="Be brief.", messages=messages)
            assert count.input_tokens == len(tok.encode(tok.render_chat({"messages": view}), False))
            assert gw.metric("turbo_gateway_requests_total", model="tiny", backend="none", status="200") == 1
            assert gw.metric("turbo_gateway_requests_total", model="tiny", backend="sim", status="200") == 0
            other = await client.messages.count_tokens(model=MODEL, messages=messages)  # no tokenizer: the engine's
            assert other.input_tokens > 0
            assert gw.metric("turbo_gateway_requests_total", model=MODEL, backend="sim", status="200") == 1
    finally:
        for r in runners:
            await r.cleanup()


async def test_a_typed_event_streams_first_token_is_its_first_output_delta():
    """A Responses stream opens with ``response.created`` before the engine generated
    anything: the gateway's TTFT (and the load model's first token) waits for the first
    output delta. The scripted engine holds its deltas until the test has read the
    opening event."""
    release = asyncio.Event()

    async def responses(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        created = {"type": "response.created", "response": {"id": "resp_1", "status": "in_progress"}}
        await resp.write(b"event: response.created\ndata: " + orjson.dumps(created) + b"\n\n")
        await release.wait()
        for word in ("one", "two"):
            delta = {"type": "response.output_text.delta", "delta": word, "item_id": "m", "output_index": 0,
                     "content_index": 0}
            await resp.write(b"event: response.output_text.delta\ndata: " + orjson.dumps(delta) + b"\n\n")
        done = {"type": "response.completed", "response": {"id": "resp_1", "status": "completed", "usage": {
            "input_tokens": 5, "output_tokens": 2, "total_tokens": 7}}}
        await resp.write(b"event: response.completed\ndata: " + orjson.dumps(done) + b"\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/responses", responses)
    async with serving(app) as url, \
            running_gateway(gateway_config([{"name": "a", "url": url, "models": [MODEL]}])) as gw, \
            aiohttp.ClientSession() as s, s.post(gw.url + "/v1/responses", json={
                "model": MODEL, "input": "hi", "stream": True, "store": False}) as r:
        assert r.status == 200
        first = await r.content.readuntil(b"\n\n")
        assert b"response.created" in first
        assert gw.metric("turbo_gateway_ttft_seconds_count", model=MODEL) == 0  # no token yet
        release.set()
        rest = await r.read()
        assert rest.count(b"response.output_text.delta\n") == 2 and b"response.completed" in rest
        assert gw.metric("turbo_gateway_ttft_seconds_count", model=MODEL, api="responses") == 1
        assert gw.metric("turbo_gateway_completion_tokens_total", model=MODEL, api="responses") == 2
