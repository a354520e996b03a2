"""The routes whose answer is the prompt's tokens: ``POST /v1/responses/input_tokens``
(the openai SDK's ``client.responses.input_tokens.count``), ``POST /tokenize`` and
``POST /detokenize`` (vLLM's shapes). With the model's own tokenizer configured the
gateway answers them itself, no backend asked (a ``previous_response_id`` or
``conversation`` expanded first); without one, ``/tokenize`` and ``/detokenize`` go to a
backend that serves them and ``input_tokens``, which no engine serves, is the gateway's
estimate. Every request is counted by API in the metrics."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from gateway.apis.responses import chat_messages
from loadtest.sim.server import SimBackendConfig, start_backends
from routing.tokenizer import load_tokenizer
from tests.support.chat_cases import TINY
from tests.support.servers import gateway_config, running_gateway

MODEL = "sim-model"  # no tokenizer configured
SYSTEM = "Answer in one short sentence. "


def exact(tok, data: dict) -> int:
    """The prompt tokens of Responses request ``data`` by the tiny model's tokenizer."""
    return len(tok.encode(tok.render_chat({"messages": chat_messages(data)}), False))


async def test_input_tokens_counted_by_the_tokenizer_with_a_chain_else_estimated():
    tok = load_tokenizer(TINY)
    runners, urls = await start_backends([SimBackendConfig.from_dict(
        {"name": "sim", "models": ["tiny", MODEL], "speed": 50.0, "eos_after": 3})])
    cfg = gateway_config([{"name": "sim", "url": urls["sim"], "models": ["tiny", MODEL]}],
                         models={"tiny": {"tokenizer": str(TINY)}})
    try:
        async with running_gateway(cfg) as gw, \
                openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0) as client:
            count = await client.responses.input_tokens.count(model="tiny", instructions=SYSTEM, input="Wie weit?")
            assert count.object == "response.input_tokens"
            assert count.input_tokens == exact(tok, {"instructions": SYSTEM, "input": "Wie weit?"})
            assert gw.metric("turbo_gateway_requests_total", model="tiny", backend="sim") == 0  # no engine asked
            # a chain: the previous turn's input and output before the new input, as the turn would be sent
            r1 = await client.responses.create(model="tiny", instructions=SYSTEM, input="Wie weit?")
            chained = await client.responses.input_tokens.count(model="tiny", instructions=SYSTEM, input="Und dann?",
                                                                previous_response_id=r1.id)
            whole = [{"role": "user", "content": "Wie weit?"}, *[o.model_dump(exclude_none=True) for o in r1.output],
                     {"role": "user", "content": "Und dann?"}]
            assert chained.input_tokens == exact(tok, {"instructions": SYSTEM, "input": whole})
            assert chained.input_tokens > count.input_tokens
            # the same conversation kept as a Conversation
            conv = await client.conversations.create(items=[{"type": "message", "role": "user", "content": "Hallo."}])
            in_conv = await client.responses.input_tokens.count(model="tiny", input="Und dann?", conversation=conv.id)
            assert in_conv.input_tokens == exact(tok, {"input": [{"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Hallo."}]}, {"role": "user", "content": "Und dann?"}]})
            with pytest.raises(openai.BadRequestError) as e:
                await client.responses.input_tokens.count(model="tiny", input="x", previous_response_id="resp_no")
            assert e.value.body["code"] == "previous_response_not_found"
            # no tokenizer and no engine serving the path: the gateway's estimate, said so
            raw = await client.responses.input_tokens.with_raw_response.count(model=MODEL, input="Wie weit ist es?")
            assert raw.headers["x-turbo-token-count"] == "estimated" and raw.parse().input_tokens > 0
            assert gw.metric("turbo_gateway_api_requests_total", api="input_tokens", status="200") == 4
    finally:
        for r in runners:
            await r.cleanup()


async def test_tokenize_and_detokenize_from_the_tokenizer_else_forwarded():
    tok = load_tokenizer(TINY)
    runners, urls = await start_backends([SimBackendConfig.from_dict(
        {"name": "sim", "models": ["tiny", MODEL], "speed": 50.0})])
    cfg = gateway_config([{"name": "sim", "url": urls["sim"], "models": ["tiny", MODEL]}],
                         models={"tiny": {"tokenizer": str(TINY)}})
    text = "Wie weit ist es nach Zürich?"
    messages = [{"role": "user", "content": text}]
    try:
        async with running_gateway(cfg) as gw, aiohttp.ClientSession() as s:
            async def post(path: str, body: dict, base: str = gw.url) -> tuple[int, dict]:
                async with s.post(base + path, json=body) as r:
                    return r.status, await r.json()

            status, got = await post("/tokenize", {"model": "tiny", "prompt": text, "return_token_strs": True})
            ids = tok.encode(text, True)
            assert status == 200 and got == {"count": len(ids), "max_model_len": None, "tokens": ids,
                                             "token_strs": [tok.tokenizer.id_to_token(i) for i in ids]}
            status, got = await post("/tokenize", {"model": "tiny", "messages": messages})
            assert status == 200 and got["tokens"] == tok.encode(tok.render_chat({"messages": messages}), False)
            assert got["token_strs"] is None
            status, got = await post("/detokenize", {"model": "tiny", "tokens": ids})
            assert status == 200 and got == {"prompt": tok.tokenizer.decode(ids, skip_special_tokens=False)}
            assert gw.metric("turbo_gateway_requests_total", model="tiny", backend="sim") == 0  # no engine asked
            assert gw.metric("turbo_gateway_requests_total", model="tiny", backend="none", status="200") == 3
            # without a tokenizer: the engine's own answer, routed like any request
            for path, body in (("/tokenize", {"model": MODEL, "prompt": text}),
                               ("/tokenize", {"model": MODEL, "messages": messages}),
                               ("/detokenize", {"model": MODEL, "tokens": [5, 6, 7]})):
                assert await post(path, body) == await post(path, body, urls["sim"])
            assert gw.metric("turbo_gateway_api_requests_total", api="tokenize", status="200") == 4
            assert gw.metric("turbo_gateway_api_requests_total", api="detokenize", status="200") == 2
            # bad input: OpenAI's error shape, the field named
            for path, body, param in (("/tokenize", {"prompt": text}, "model"),
                                      ("/tokenize", {"model": "tiny", "prompt": 7}, "prompt"),
                                      ("/tokenize", {"model": "tiny", "messages": [{"content": "x"}]}, "messages[0]"),
                                      ("/detokenize", {"model": "tiny", "tokens": ["a"]}, "tokens"),
                                      ("/detokenize", {"model": "tiny", "tokens": [10**9]}, "tokens")):
                status, got = await post(path, body)
                assert status == 400 and got["error"]["param"] == param, got
            status, got = await post("/tokenize", {"model": "nope", "prompt": text})
            assert status == 404 and got["error"]["code"] == "model_not_found"
    finally:
        for r in runners:
            await r.cleanup()
