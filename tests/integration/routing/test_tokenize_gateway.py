"""The gateway with a model's own tokenizer configured, over real sockets: the
simulated engines of loadtest/sim behind it, the official SDK in front.

Each request's exact prompt tokens are counted in ``/metrics``
(``turbo_gateway_tokenized_prompt_tokens_total``) and must equal the ids the same
tokenizer gives the same request here; a long prompt goes through the executor; a
conversation's next turn meets the prefix cache; a request that cannot be reproduced,
and a model without a tokenizer, are served as before.
"""

from __future__ import annotations

import openai
import pytest

from gateway.runtime import model_tokenizers
from loadtest.sim.server import SimBackendConfig, start_backends
from routing.tokenizer import OFFLOAD_CHARS, load_tokenizer
from tests.support.chat_cases import TINY
from tests.support.servers import gateway_config, running_gateway


@pytest.fixture
async def gateway():
    runners, urls = await start_backends([SimBackendConfig(name="s1", models=["tiny", "plain"], profile="demo",
                                                           speed=50.0)])
    cfg = gateway_config([{"name": n, "url": u, "models": ["tiny", "plain"]} for n, u in urls.items()],
                         models={"tiny": {"tokenizer": str(TINY)}})
    try:
        async with running_gateway(cfg) as gw:
            yield gw
    finally:
        for r in runners:
            await r.cleanup()


async def test_the_gateway_counts_each_requests_exact_tokens(gateway):
    tok = load_tokenizer(TINY)  # the object the gateway loaded (same files): its cache is the gateway's
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    expected = 0
    hits0 = tok.cache.hits
    async with client:
        convo = [{"role": "system", "content": "You are terse. " * 40}]
        for turn in range(3):
            convo.append({"role": "user", "content": f"Frage {turn}: wie weit ist es nach Zürich? 🙂"})
            expected += len(tok.encode(tok.render_chat({"messages": convo}), False))
            r = await client.chat.completions.create(model="tiny", messages=convo, max_tokens=2)
            convo.append({"role": "assistant", "content": r.choices[0].message.content})
        long = "a long prompt " * (OFFLOAD_CHARS // 10)  # more than OFFLOAD_CHARS: encoded in the executor
        assert tok.tokenization("completions", {"prompt": long}).offload
        expected += len(tok.encode(long, True))
        await client.completions.create(model="tiny", prompt=long, max_tokens=2)
        expected += 3
        await client.completions.create(model="tiny", prompt=[7, 8, 9], max_tokens=2)
        image = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                              {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]
        await client.chat.completions.create(model="tiny", messages=image, max_tokens=2)
        await client.chat.completions.create(model="plain", messages=convo, max_tokens=2)
    assert gateway.metric("turbo_gateway_tokenized_prompt_tokens_total", model="tiny") == expected
    assert gateway.metric("turbo_gateway_tokenizations_total", model="tiny", result="exact") == 5
    assert gateway.metric("turbo_gateway_tokenizations_total", model="tiny", result="unsupported") == 1
    assert gateway.metric("turbo_gateway_tokenizer_cache_hits_total", model="tiny") >= hits0 + 2  # turns 2 and 3
    registry = gateway.state.metrics.registry
    assert registry.get_sample_value("turbo_gateway_tokenizations_total", {"model": "plain", "result": "exact"}) is None
    assert gateway.metric("turbo_gateway_completion_tokens_total", model="plain") == 2


def test_a_tokenizer_without_a_chat_template_is_named_at_start(caplog):
    cfg = gateway_config([{"name": "s1", "url": "http://127.0.0.1:1", "models": ["tiny", "bare"]}],
                         models={"tiny": {"tokenizer": str(TINY)}, "bare": {"tokenizer": str(TINY / "tokenizer.json")}})
    with caplog.at_level("WARNING", logger="gateway.runtime"):
        toks = model_tokenizers(cfg)
    assert set(toks) == {"tiny", "bare"}
    warned = [r.getMessage() for r in caplog.records if r.name == "gateway.runtime"]
    assert len(warned) == 1 and warned[0].startswith("model bare: its tokenizer") and "no chat template" in warned[0]


async def test_responses_and_messages_are_tokenized_as_the_chat_they_render(gateway):
    """A Responses or Messages request is tokenized exactly as the chat conversation
    its adapter renders (``instructions`` or ``system`` as the system message, content
    parts and blocks as text), with the model's chat template; a rerank request, whose
    prompt the engine tokenizes pair by pair, is not counted as one exact prompt."""
    import anthropic

    from gateway.apis.registry import BY_NAME

    tok = load_tokenizer(TINY)
    system = "You are terse. " * 20
    responses = {"model": "tiny", "instructions": system, "max_output_tokens": 2,
                 "input": [{"role": "user", "content": [{"type": "input_text", "text": "Wie weit ist Zürich?"}]}]}
    messages = {"model": "tiny", "system": [{"type": "text", "text": system}], "max_tokens": 2,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "Wie weit ist Zürich?"}]}]}
    expected = sum(len(tok.encode(tok.render_chat(BY_NAME[name].view(body)), False))
                   for name, body in (("responses", responses), ("messages", messages)))
    async with openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as client:
        await client.responses.create(**responses)
        await anthropic.AsyncAnthropic(base_url=gateway.url, api_key="unused", max_retries=0).messages.create(
            **messages)
        await client.post("/rerank", cast_to=object, body={"model": "tiny", "query": "q", "documents": ["a", "b"]})
    assert gateway.metric("turbo_gateway_tokenizations_total", model="tiny", result="exact") == 2
    assert gateway.metric("turbo_gateway_tokenized_prompt_tokens_total", model="tiny") == expected > 0
