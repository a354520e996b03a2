"""The gateway in front of real llama.cpp ``llama-server`` processes.

Two llama-servers serve a tiny random-weight model generated locally
(``scripts/make_tiny_model.py``); ``python -m gateway`` runs as a subprocess with a
temporary config in front of them. Everything is real: processes, sockets on
127.0.0.1, the official ``openai`` SDK and curl as clients.

The output text is gibberish; ``ignore_eos`` makes lengths exact. Needs the
llama-server binary (``scripts/ci_build_llama_server.sh`` builds it once into the
cache, or set ``LLAMA_SERVER_BIN``); without it the whole module skips.
"""
# ruff: noqa: E402 - the imports below need the skip checks above to pass first

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.support import engines

pytestmark = [pytest.mark.engine, pytest.mark.slow]

BIN = engines.require_llama_server()

import openai

MODEL = engines.MODEL_ALIAS
NO_EOS = {"ignore_eos": True}  # llama.cpp extension: exactly max_tokens tokens
# One streamed chunk per token, exactly: llama.cpp holds back a token that ends inside a
# multi-byte UTF-8 character and sends it with the next one (~0.5% of this model's
# random tokens), so chunk counts are exact only when the output is ASCII. A GBNF
# grammar (another llama.cpp extension the gateway passes through untouched) makes it so.
ONE_CHUNK_PER_TOKEN = {**NO_EOS, "grammar": "root ::= [a-zA-Z .,]*"}
# A condition wait (the engine reacting), bounded so that a broken build fails
# instead of hanging; never a speed assertion.
SETTLE_S = 30.0


# ---- fixtures: processes started once for the module, stopped by PID ------------

@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("real-engine")


@pytest.fixture(scope="module")
def engines_pair(workdir):
    model = engines.tiny_model()
    servers = []
    try:
        for i in range(2):
            servers.append(engines.LlamaServer(BIN, model, workdir, name=f"llama-{i}", parallel=2).start())
        yield servers
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(scope="module")
def gateway(engines_pair, workdir):
    """The gateway with both engines, round robin."""
    with engines.GatewayProcess({s.name: s.url for s in engines_pair}, workdir, name="gw-pair").start() as gw:
        yield gw


@pytest.fixture(scope="module")
def gateway_one(engines_pair, workdir):
    """A gateway with one engine only (llama-0): repeated prompts meet its cache,
    and the test knows whose /slots to watch."""
    e = engines_pair[0]
    with engines.GatewayProcess({e.name: e.url}, workdir, name="gw-one").start() as gw:
        yield gw, e


def sdk(gw, cls=openai.OpenAI):
    return cls(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def long_prompt(words: int = 400) -> str:
    """A prompt of ~2.3 tokens per word, unique from its first token."""
    base = ["the", "gateway", "routes", "each", "request", "to", "the", "engine", "that", "holds", "its", "prefix"]
    return f"{uuid.uuid4().hex} " + " ".join(base[i % len(base)] for i in range(words))


# ---- (a) the openai SDK through the gateway, from the real engines ----------------

def test_sdk_sync_non_streaming_from_both_engines(gateway):
    client = sdk(gateway)
    served_by = set()
    for i in range(4):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=chat(f"hello number {i}"), max_tokens=8, extra_body=NO_EOS)
        served_by.add(raw.headers["x-turbo-backend"])
        assert raw.headers.get("x-request-id")
        resp = raw.parse()
        assert resp.object == "chat.completion"
        assert resp.choices[0].message.content, resp
        assert resp.choices[0].finish_reason == "length"
        assert resp.usage.completion_tokens == 8
        assert resp.usage.prompt_tokens > 0
    assert served_by == {"llama-0", "llama-1"}  # round robin reached both real engines


def test_sdk_sync_streaming(gateway):
    client = sdk(gateway)
    with client.chat.completions.create(model=MODEL, messages=chat("tell me a story"), max_tokens=12, stream=True,
                                        stream_options={"include_usage": True},
                                        extra_body=ONE_CHUNK_PER_TOKEN) as stream:
        assert stream.response.headers["x-turbo-backend"] in {"llama-0", "llama-1"}
        chunks = list(stream)
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in chunks if c.usage is not None]
    assert finish == ["length"]
    assert len(usage) == 1 and usage[0].completion_tokens == 12
    assert len(content) == 12  # one content chunk per generated token
    assert "".join(c.choices[0].delta.content for c in content)


async def test_sdk_async_streaming_and_not_concurrently(gateway):
    async with sdk(gateway, openai.AsyncOpenAI) as client:
        await _async_requests(client)


async def _async_requests(client: openai.AsyncOpenAI) -> None:
    async def one_stream(i: int) -> tuple[int, int, int]:
        stream = await client.chat.completions.create(
            model=MODEL, messages=chat(f"stream {i}"), max_tokens=10 + i, stream=True,
            stream_options={"include_usage": True}, extra_body=ONE_CHUNK_PER_TOKEN)
        n, usage = 0, None
        async with stream:
            async for c in stream:
                if c.choices and c.choices[0].delta.content:
                    n += 1
                if c.usage is not None:
                    usage = c.usage
        return i, n, usage.completion_tokens

    async def one_plain(i: int):
        return await client.chat.completions.create(model=MODEL, messages=chat(f"plain {i}"), max_tokens=5 + i,
                                                    extra_body=ONE_CHUNK_PER_TOKEN)

    # more requests than the fleet's 4 slots: some queue in the engines
    results = await asyncio.gather(*(one_stream(i) for i in range(4)), *(one_plain(i) for i in range(3)))
    for i, n, completion_tokens in results[:4]:
        assert n == 10 + i and completion_tokens == 10 + i
    for i, resp in enumerate(results[4:]):
        assert resp.choices[0].message.content
        assert resp.usage.completion_tokens == 5 + i


def test_sdk_text_completions_streaming(gateway):
    client = sdk(gateway)
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, stream=True,
                                            extra_body=ONE_CHUNK_PER_TOKEN))
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) == 6


# ---- (b) usage with cached prompt tokens reaches the client ------------------------

def test_cached_tokens_on_repeated_prefix_reach_the_client(gateway_one):
    gw, _engine = gateway_one
    client = sdk(gw)
    prompt = long_prompt()
    first = client.chat.completions.create(model=MODEL, messages=chat(prompt), max_tokens=4, extra_body=NO_EOS)
    assert first.usage.prompt_tokens > 500
    # the same prompt again, to the same engine: its slot still holds the prefix
    second = client.chat.completions.create(model=MODEL, messages=chat(prompt), max_tokens=4, extra_body=NO_EOS)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 16, (first.usage, second.usage)
    assert cached > (first.usage.prompt_tokens_details.cached_tokens or 0)
    print(f"prompt_tokens={first.usage.prompt_tokens} cached_tokens: "
          f"first={first.usage.prompt_tokens_details.cached_tokens} second={cached}")

    # and in a stream, in the usage chunk
    with client.chat.completions.create(model=MODEL, messages=chat(prompt + " and one more question"), max_tokens=4,
                                        stream=True, stream_options={"include_usage": True},
                                        extra_body=NO_EOS) as stream:
        usage = [c.usage for c in stream if c.usage is not None]
    assert len(usage) == 1
    assert usage[0].prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16, usage[0]
    # the gateway counts a stream's usage once the engine ended the response, which can be
    # after the client read the usage chunk and [DONE]
    engines.wait_for(lambda: gw.metric("turbo_gateway_cached_prompt_tokens_total", model=MODEL) >=
                     2 * (first.usage.prompt_tokens - 16), "the streamed usage counted", SETTLE_S)


# ---- (c) a client that goes away stops the engine ---------------------------------

def test_client_disconnect_stops_generation_in_the_engine(gateway_one):
    gw, engine = gateway_one
    engines.wait_for(lambda: not engine.busy_slots(), "engine idle before the test", SETTLE_S)
    max_tokens = 100_000  # far more than the slot's context: only the disconnect can end it early
    client = sdk(gw)
    stream = client.chat.completions.create(model=MODEL, messages=chat("never stop talking"), max_tokens=max_tokens,
                                            stream=True, extra_body=NO_EOS)
    assert stream.response.headers["x-turbo-backend"] == engine.name
    got = 0
    for c in stream:
        if c.choices and c.choices[0].delta.content:
            got += 1
            if got == 5:
                break
    busy = engines.wait_for(engine.busy_slots, "the engine generating for the open stream", SETTLE_S)
    assert len(busy) == 1
    n_prompt = next(s for s in engine.slots() if s["id"] == busy[0])["n_prompt_tokens"]
    predicted_before = engine.metrics()["llamacpp:tokens_predicted_total"]
    stream.close()  # the client hangs up mid-stream

    # condition wait: the engine notices (through the gateway) and frees the slot
    engines.wait_for(lambda: not engine.busy_slots(), "the engine to stop after the client left", SETTLE_S)
    # It stopped because the client left, not because it reached max_tokens or filled
    # the slot's context (which ends a generation at prompt + predicted == n_ctx). The
    # counter is settled when the task ends.
    predicted = engine.metrics()["llamacpp:tokens_predicted_total"] - predicted_before
    assert got <= predicted < max_tokens, predicted
    assert n_prompt + predicted < engine.ctx_per_slot, (n_prompt, predicted)
    engines.wait_for(lambda: gw.metric("turbo_gateway_backend_in_flight", backend=engine.name) == 0,
                     "gateway in-flight back to 0", SETTLE_S)
    assert gw.metric("turbo_gateway_client_disconnects_total", backend=engine.name) >= 1


# ---- the engine's own prefill rate, as the scraper reads it -------------------------

def test_the_scraper_reads_llama_cpp_prefill_counters(gateway_one):
    from gateway.engine_signals.metrics_scraper import parse_engine_metrics

    gw, engine = gateway_one
    before = parse_engine_metrics(engines.http_get(engine.url + "/metrics")[1].decode())
    sdk(gw).chat.completions.create(model=MODEL, messages=chat(long_prompt()), max_tokens=2)
    after = parse_engine_metrics(engines.http_get(engine.url + "/metrics")[1].decode())
    assert before.prefill_s_total is not None and before.prefill_tokens_total is not None
    assert after.prefill_s_total > before.prefill_s_total  # a fresh prompt was prefilled
    assert after.prefill_tokens_total - before.prefill_tokens_total >= 400  # ~2.3 tokens a word, 400 words


# ---- curl, the way a user first tries it -------------------------------------------

@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
def test_curl_streaming_through_the_gateway(gateway):
    body = {"model": MODEL, "messages": chat("Say hi"), "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}, **ONE_CHUNK_PER_TOKEN}
    out = subprocess.run(["curl", "-sS", "-N", "-D", "-", gateway.url + "/v1/chat/completions",
                          "-H", "Content-Type: application/json", "-d", json.dumps(body)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    head, _, sse = out.replace("\r\n", "\n").partition("\n\n")
    assert head.startswith("HTTP/1.1 200")
    assert "x-turbo-backend: llama-" in head.lower()
    events = [line[len("data: "):] for line in sse.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    objs = [json.loads(e) for e in events[:-1]]
    assert sum(1 for o in objs if o["choices"] and o["choices"][0]["delta"].get("content")) == 5
    assert objs[-1]["usage"]["completion_tokens"] == 5


# ---- models discovered from the engine ---------------------------------------------

def test_models_auto_discovers_the_engines_model(engines_pair, workdir):
    """``models: auto``: the gateway serves what llama-server's own ``/v1/models`` lists
    (its model alias), with no model named in the config."""
    e = engines_pair[0]
    status, body = engines.http_get(e.url + "/v1/models")
    assert status == 200 and MODEL in {m["id"] for m in json.loads(body)["data"]}
    with engines.GatewayProcess({e.name: e.url}, workdir, name="gw-auto", model="auto").start() as gw:
        def listed():
            s, b = engines.http_get(gw.url + "/v1/models")
            return s == 200 and {m["id"]: m for m in json.loads(b)["data"]}.get(MODEL)
        card = engines.wait_for(listed, "the gateway listing the engine's model", SETTLE_S)
        assert "parent" not in card  # a base model, not an adapter
        r = sdk(gw).chat.completions.with_raw_response.create(model=MODEL, messages=chat("hi"), max_tokens=4,
                                                                extra_body=NO_EOS)
        assert r.headers["x-turbo-backend"] == e.name
        assert r.parse().usage.completion_tokens == 4
