"""Token-exact prompts against a real engine: llama.cpp ``llama-server``.

The gateway's chat rendering and token ids (``routing/tokenizer/``, with the tiny
model's own ``tokenizer.json`` and chat template from ``tests/support/data/tiny-tokenizer``)
are compared with what ``llama-server`` itself renders (``POST /apply-template``) and
tokenizes (``POST /tokenize``) for the same requests: with its built-in ChatML
formatter, and with its Jinja engine (``--jinja``) on a template with a default system
prompt, tools and tool calls. Then a gateway in front of it counts, with the model's
tokenizer configured, exactly the prompt tokens the engine reports in ``usage``.

Needs the llama-server binary (``scripts/ci_build_llama_server.sh`` builds it once
into the cache, or set ``LLAMA_SERVER_BIN``); without it the module skips.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.support import engines

pytestmark = [pytest.mark.engine, pytest.mark.slow]

BIN = engines.require_llama_server()

from routing.tokenizer import load_tokenizer  # noqa: E402
from tests.support.chat_cases import (  # noqa: E402
    COMPLETIONS,
    CONVERSATIONS,
    SYSTEM,
    TINY,
    TOOL_CONVERSATIONS,
    TOOLS,
    TOOLS_TEMPLATE,
)


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tokenizer-engine")


@pytest.fixture(scope="module")
def chatml_engine(workdir):
    """llama-server with the model's own template (its built-in ChatML formatter)."""
    with engines.LlamaServer(BIN, engines.tiny_model(), workdir, name="chatml", parallel=1,
                             ctx_per_slot=8192).start() as s:
        yield s


@pytest.fixture(scope="module")
def jinja_engine(workdir):
    """llama-server rendering the tools template with its own Jinja engine."""
    with engines.LlamaServer(BIN, engines.tiny_model(), workdir, name="jinja", parallel=1, ctx_per_slot=8192,
                             extra=["--jinja", "--chat-template-file", str(TOOLS_TEMPLATE)]).start() as s:
        yield s


def engine_chat_ids(engine, body: dict) -> tuple[str, list[int]]:
    """What the engine renders for a chat request, and its ids for that text as its
    chat path tokenizes it (special tokens parsed, the model's BOS setting)."""
    prompt = post(engine.url + "/apply-template", body)["prompt"]
    return prompt, post(engine.url + "/tokenize",
                        {"content": prompt, "add_special": True, "parse_special": True})["tokens"]


@pytest.mark.parametrize("i", range(len(CONVERSATIONS)))
def test_chat_render_and_token_ids_match_the_engine(chatml_engine, i):
    tok = load_tokenizer(TINY)
    body = {"messages": CONVERSATIONS[i]}
    prompt, engine_ids = engine_chat_ids(chatml_engine, body)
    assert tok.render_chat(body) == prompt
    assert list(tok.tokenization("chat", body).token_ids()) == engine_ids


def test_a_growing_conversation_from_the_prefix_cache_matches_the_engine(chatml_engine):
    tok = load_tokenizer(TINY, cache_tokens=1 << 20)  # its own cache, empty
    convo = [SYSTEM]
    for turn in range(6):
        convo.append({"role": "user", "content": f"Question {turn}: what about {'ünïcödé ' * turn}and {turn * 7}?"})
        body = {"messages": convo}
        _, engine_ids = engine_chat_ids(chatml_engine, body)
        tz = tok.tokenization("chat", body)
        if turn:
            assert tz.uncached_chars < len(tok.render_chat(body))  # earlier turns came from the cache
        assert list(tz.token_ids()) == engine_ids
        convo.append({"role": "assistant", "content": f"Answer {turn}. " * (turn + 1)})
    assert tok.cache.hits >= 5


@pytest.mark.parametrize("prompt", COMPLETIONS)
def test_completion_token_ids_match_the_engine(chatml_engine, prompt):
    tok = load_tokenizer(TINY)
    engine_ids = post(chatml_engine.url + "/tokenize", {"content": prompt, "add_special": True})["tokens"]
    assert list(tok.tokenization("completions", {"prompt": prompt}).token_ids()) == engine_ids


@pytest.mark.parametrize("i", range(len(TOOL_CONVERSATIONS)))
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_a_jinja_template_with_tools_matches_the_engines_jinja(jinja_engine, i, tools):
    tok = load_tokenizer(TINY, TOOLS_TEMPLATE)
    body = {"messages": TOOL_CONVERSATIONS[i], **({"tools": tools} if tools else {})}
    prompt, engine_ids = engine_chat_ids(jinja_engine, body)
    assert tok.render_chat(body) == prompt
    assert list(tok.tokenization("chat", body).token_ids()) == engine_ids


def test_the_gateway_counts_the_prompt_tokens_the_engine_reports(chatml_engine, workdir):
    """With the model's tokenizer configured, the gateway's exact prompt tokens equal
    the engine's ``usage.prompt_tokens``, request by request and in sum; a request it
    cannot reproduce is counted as such and still served."""
    import openai

    cfg = {"models": {engines.MODEL_ALIAS: {"tokenizer": str(TINY)}}}
    with engines.GatewayProcess({"chatml": chatml_engine.url}, workdir, name="gw-tokenizer",
                                extra_config=cfg).start() as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        reported = 0
        before = gw.metric("turbo_gateway_tokenized_prompt_tokens_total", model=engines.MODEL_ALIAS)
        for convo in CONVERSATIONS:
            r = client.chat.completions.create(model=engines.MODEL_ALIAS, messages=convo, max_tokens=1,
                                               extra_body={"ignore_eos": True})
            reported += r.usage.prompt_tokens
        for prompt in [*COMPLETIONS[:4], "word " * 2000]:  # the last one is encoded in the executor
            r = client.completions.create(model=engines.MODEL_ALIAS, prompt=prompt, max_tokens=1,
                                          extra_body={"ignore_eos": True})
            reported += r.usage.prompt_tokens
        r = client.completions.create(model=engines.MODEL_ALIAS, prompt=[[1, 2, 3, 4]], max_tokens=1,
                                      extra_body={"ignore_eos": True})
        reported += r.usage.prompt_tokens
        counted = gw.metric("turbo_gateway_tokenized_prompt_tokens_total", model=engines.MODEL_ALIAS) - before
        assert counted == reported == gw.metric("turbo_gateway_prompt_tokens_total", model=engines.MODEL_ALIAS)
        n = len(CONVERSATIONS) + 6
        assert gw.metric("turbo_gateway_tokenizations_total", model=engines.MODEL_ALIAS, result="exact") == n
        # a per-request template: not reproduced, estimated as without a tokenizer, and served
        r = client.chat.completions.create(model=engines.MODEL_ALIAS, messages=CONVERSATIONS[0], max_tokens=1,
                                           extra_body={"ignore_eos": True, "chat_template": "{{ 'x' }}"})
        assert r.choices
        assert gw.metric("turbo_gateway_tokenizations_total", model=engines.MODEL_ALIAS, result="unsupported") == 1
