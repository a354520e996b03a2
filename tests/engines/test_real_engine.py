"""The gateway in front of real llama.cpp ``llama-server`` processes.

Two llama-servers serve a tiny random-weight model generated locally
(``scripts/make_tiny_model.py``); ``python -m gateway`` runs as a subprocess with a
temporary config in front of them. Everything is real: processes, sockets on
127.0.0.1, the official ``openai`` and ``anthropic`` SDKs and curl as clients.

The APIs besides chat and completions (Responses, Anthropic Messages, embeddings,
rerank) are checked against the engine's own answer to the same request sent to it
directly. llama-server serves embeddings and rerank only when started for them
(``--embeddings``, ``--reranking``), so two more llama-servers on the same tiny model
serve those, under their own model names, behind one gateway with a generating one.

The output text is gibberish; ``ignore_eos`` makes lengths exact. Needs the
llama-server binary (``scripts/ci_build_llama_server.sh`` builds it once into the
cache, or set ``LLAMA_SERVER_BIN``); without it the whole module skips.
"""
# ruff: noqa: E402 - the imports below need the skip checks above to pass first

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import engines

pytestmark = [pytest.mark.engine, pytest.mark.slow]

BIN = engines.require_llama_server()

import anthropic
import openai

MODEL = engines.MODEL_ALIAS
EMBED_MODEL, RERANK_MODEL = "tiny-embed", "tiny-rerank"  # the pooling llama-servers' aliases
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


@pytest.fixture(scope="module")
def pooling_engines(workdir):
    """A llama-server serving embeddings (``--embeddings --pooling mean``) and one
    serving rerank (``--reranking``), both on the tiny model."""
    model = engines.tiny_model()
    servers = []
    try:
        for name, alias, extra in (("llama-embed", EMBED_MODEL, ["--embeddings", "--pooling", "mean"]),
                                   ("llama-rerank", RERANK_MODEL, ["--reranking"])):
            servers.append(engines.LlamaServer(BIN, model, workdir, name=name, alias=alias, parallel=1,
                                               ctx_per_slot=4096, extra=extra).start())
        yield servers
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(scope="module")
def gateway_apis(engines_pair, pooling_engines, workdir):
    """A gateway before llama-1 (the model ``tiny``), the embedding server
    (``tiny-embed``) and the rerank server (``tiny-rerank``): ``(gateway, llama-1,
    embedding server, rerank server)``."""
    gen, (embed, rerank) = engines_pair[1], pooling_engines
    backends = {gen.name: gen.url, embed.name: embed.url, rerank.name: rerank.url}
    models = {embed.name: EMBED_MODEL, rerank.name: RERANK_MODEL}
    with engines.GatewayProcess(backends, workdir, name="gw-apis", models=models).start() as gw:
        yield gw, gen, embed, rerank


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


# ---- (d) Responses, Messages, embeddings and rerank, against the engine's own answers ----

def _tokens(gw, model: str) -> tuple[float, float, float]:
    """The gateway's (prompt, cached prompt, completion) token counters of ``model``."""
    return (gw.metric("turbo_gateway_prompt_tokens_total", model=model),
            gw.metric("turbo_gateway_cached_prompt_tokens_total", model=model),
            gw.metric("turbo_gateway_completion_tokens_total", model=model))


def _counted(gw, model: str, before: tuple[float, float, float], prompt: int, cached: int | None,
             completion: int) -> None:
    """Wait until the gateway counted one more answer of ``model`` (settled once the
    engine ended it, which can be after the client read it), then check its counts."""
    engines.wait_for(lambda: _tokens(gw, model)[2] - before[2] >= completion and
                     _tokens(gw, model)[0] - before[0] >= prompt, f"the {model} answer counted", SETTLE_S)
    after = _tokens(gw, model)
    assert after[0] - before[0] == prompt and after[2] - before[2] == completion, (before, after)
    if cached is not None:
        assert after[1] - before[1] == cached, (before, after)


def _post(url: str, body: dict) -> tuple[int, dict[str, str], dict]:
    """``POST`` JSON ``body``: ``(status, headers (lower-case names), JSON answer)``."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, json.loads(e.read())


def _route(headers) -> dict[str, str]:
    return dict(p.split("=", 1) for p in headers["x-turbo-route"].split("; "))


def test_responses_create_and_stream_match_the_engine(gateway_apis):
    gw, gen, _, _ = gateway_apis
    request = {"model": MODEL, "instructions": "Answer in one short sentence.", "input": "What does a gateway do?",
               "max_output_tokens": 7, "extra_body": ONE_CHUNK_PER_TOKEN}
    direct = openai.OpenAI(base_url=gen.url + "/v1", api_key="unused", max_retries=0).responses.create(**request)
    assert direct.usage.input_tokens > 0 and direct.usage.output_tokens == 7

    client = sdk(gw)
    before = _tokens(gw, MODEL)
    raw = client.responses.with_raw_response.create(**request)
    r = raw.parse()
    assert raw.headers["x-turbo-backend"] == gen.name
    assert r.object == "response" and r.status == "completed" and r.output_text
    assert r.usage.input_tokens == direct.usage.input_tokens and r.usage.output_tokens == 7
    assert int(_route(raw.headers)["output_tokens_est"]) > 0  # priced with a decode term
    _counted(gw, MODEL, before, r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens, 7)

    before = _tokens(gw, MODEL)
    with client.responses.create(**request, stream=True) as stream:
        assert stream.response.headers["x-turbo-backend"] == gen.name
        events = list(stream)
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    deltas = [i for i, t in enumerate(types) if t == "response.output_text.delta"]
    assert len(deltas) == 7  # one event per token (ASCII output)
    assert types.index("response.output_item.added") < deltas[0] and deltas[-1] < types.index(
        "response.output_text.done") < types.index("response.output_item.done") < len(types) - 1
    final = events[-1].response
    assert final.status == "completed" and final.output_text == "".join(events[i].delta for i in deltas)
    assert final.usage.input_tokens == direct.usage.input_tokens and final.usage.output_tokens == 7
    _counted(gw, MODEL, before, final.usage.input_tokens, final.usage.input_tokens_details.cached_tokens, 7)


def test_responses_errors_from_the_gateway_and_from_the_engine(gateway_apis):
    gw, gen, _, _ = gateway_apis
    client = sdk(gw)
    with pytest.raises(openai.BadRequestError) as e:  # refused by the gateway: the engine never sees it
        client.responses.create(model=MODEL, input=7)  # type: ignore[arg-type]
    assert e.value.body["param"] == "input" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="x")
    refused = gw.metric("turbo_gateway_requests_total", model=MODEL, backend=gen.name, status="400")
    for stream in (False, True):  # the engine's own 400, before a stream's first byte too
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, input="x", stream=stream, extra_body={"temperature": "hot"})
        assert "temperature" in e.value.body["message"]
    assert gw.metric("turbo_gateway_requests_total", model=MODEL, backend=gen.name, status="400") == refused + 2


def test_messages_create_stream_and_count_tokens_match_the_engine(gateway_apis):
    gw, gen, _, _ = gateway_apis
    client = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0, timeout=60)
    direct = anthropic.Anthropic(base_url=gen.url, api_key="unused", max_retries=0, timeout=60)
    system = "You are a terse assistant."
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                {"role": "user", "content": [{"type": "text", "text": "Another one?"}]}]
    prompt = direct.messages.count_tokens(model=MODEL, system=system, messages=messages).input_tokens
    assert prompt > 0
    assert client.messages.count_tokens(model=MODEL, system=system, messages=messages).input_tokens == prompt

    before = _tokens(gw, MODEL)
    raw = client.messages.with_raw_response.create(model=MODEL, system=system, messages=messages, max_tokens=6,
                                                   extra_body=NO_EOS)
    m = raw.parse()
    assert raw.headers["x-turbo-backend"] == gen.name
    # llama.cpp applies no grammar to Messages: a random model's tokens may all decode to
    # nothing (special tokens), so the text is not asserted, only its shape
    assert m.type == "message" and m.role == "assistant" and m.stop_reason == "max_tokens"
    assert all(block.type == "text" for block in m.content)
    # llama.cpp's input_tokens leave out the prompt read from the cache; the prompt is their sum
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == prompt
    assert m.usage.output_tokens == 6
    _counted(gw, MODEL, before, prompt, m.usage.cache_read_input_tokens or 0, 6)

    before = _tokens(gw, MODEL)
    with client.messages.create(model=MODEL, system=system, messages=messages, max_tokens=5, stream=True,
                                extra_body=NO_EOS) as stream:
        assert stream.response.headers["x-turbo-backend"] == gen.name
        events = list(stream)
    types = [e.type for e in events]
    # a token ending inside a UTF-8 character waits for the next one; one decoding to nothing sends nothing
    n = types.count("content_block_delta")
    assert n <= 5
    assert types == ["message_start", "content_block_start", *["content_block_delta"] * n, "content_block_stop",
                     "message_delta", "message_stop"], types
    start, end = events[0].message.usage, events[-2].usage
    assert start.input_tokens + (start.cache_read_input_tokens or 0) == prompt
    assert end.output_tokens == 5 and events[-2].delta.stop_reason == "max_tokens"
    # the gateway counts the prompt from message_start and the output from message_delta
    _counted(gw, MODEL, before, prompt, start.cache_read_input_tokens or 0, 5)


def test_messages_errors_in_anthropics_shape(gateway_apis):
    gw, gen, _, _ = gateway_apis
    client = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0, timeout=60)
    user = [{"role": "user", "content": "x"}]
    with pytest.raises(anthropic.BadRequestError) as e:  # refused by the gateway
        client.messages.create(model=MODEL, max_tokens=0, messages=user)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", max_tokens=4, messages=user)
    assert e.value.body["error"]["type"] == "not_found_error"
    # the engine's own 400 (OpenAI's shape from llama.cpp) reaches the client in Anthropic's
    refused = gw.metric("turbo_gateway_requests_total", model=MODEL, backend=gen.name, status="400")
    for stream in (False, True):
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model=MODEL, max_tokens=4, messages=user, stream=stream,
                                   extra_body={"temperature": "hot"})
        body = e.value.body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        assert "temperature" in body["error"]["message"]
    assert gw.metric("turbo_gateway_requests_total", model=MODEL, backend=gen.name, status="400") == refused + 2
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.count_tokens(model=MODEL, messages=[{"role": "system", "content": "x"}])
    assert e.value.body["error"]["type"] == "invalid_request_error"


def test_embeddings_match_the_engine_and_are_priced_as_prefill_only(gateway_apis):
    gw, _, embed, _ = gateway_apis
    inputs = ["the gateway routes each request", "to the engine that holds its prefix"]
    direct = openai.OpenAI(base_url=embed.url + "/v1", api_key="unused", max_retries=0).embeddings.create(
        model=EMBED_MODEL, input=inputs)
    before = _tokens(gw, EMBED_MODEL)
    raw = sdk(gw).embeddings.with_raw_response.create(model=EMBED_MODEL, input=inputs)
    e = raw.parse()
    assert raw.headers["x-turbo-backend"] == embed.name
    assert _route(raw.headers)["output_tokens_est"] == "0"
    assert [d.index for d in e.data] == [0, 1]
    for got, want in zip(e.data, direct.data):
        assert len(got.embedding) == len(want.embedding) > 0
        assert got.embedding == pytest.approx(want.embedding, abs=1e-6)
    assert e.usage.prompt_tokens == direct.usage.prompt_tokens > 0
    _counted(gw, EMBED_MODEL, before, e.usage.prompt_tokens, None, 0)
    status, _, err = _post(gw.url + "/v1/embeddings", {"model": EMBED_MODEL, "input": "x", "stream": True})
    assert status == 400 and err["error"]["param"] == "stream"
    status, _, err = _post(gw.url + "/v1/embeddings", {"model": EMBED_MODEL})
    assert status == 400 and err["error"]["param"] == "input"


def test_rerank_matches_the_engine_on_every_path(gateway_apis):
    gw, _, _, rerank = gateway_apis
    body = {"model": RERANK_MODEL, "query": "which one routes requests?", "top_n": 2,
            "documents": ["a gateway routes requests", "a cat sleeps all day", "engines generate tokens"]}
    status, _, direct = _post(rerank.url + "/v1/rerank", body)
    assert status == 200 and len(direct["results"]) == 2 and direct["usage"]["prompt_tokens"] > 0
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        before = _tokens(gw, RERANK_MODEL)
        status, headers, got = _post(gw.url + path, body)
        assert status == 200, got
        assert headers["x-turbo-backend"] == rerank.name and _route(headers)["output_tokens_est"] == "0"
        assert [x["index"] for x in got["results"]] == [x["index"] for x in direct["results"]]
        assert [x["relevance_score"] for x in got["results"]] == pytest.approx(
            [x["relevance_score"] for x in direct["results"]], abs=1e-5)
        assert got["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
        _counted(gw, RERANK_MODEL, before, direct["usage"]["prompt_tokens"], None, 0)
    status, _, err = _post(gw.url + "/v1/rerank", {"model": RERANK_MODEL, "query": "q"})  # refused by the gateway
    assert status == 400 and err["error"]["param"] == "documents"
    # llama.cpp takes string documents only: its own 400 reaches the client as it is
    status, headers, err = _post(gw.url + "/v1/rerank", {**body, "documents": [{"text": "one"}]})
    assert status == 400 and headers["x-turbo-backend"] == rerank.name
    assert err["error"]["type"] == "invalid_request_error" and "documents" in err["error"]["message"]


def test_a_llama_server_not_started_for_an_api_is_learned_and_skipped(engines_pair, pooling_engines, workdir):
    """One model on a generating llama-server and on one started with ``--embeddings``:
    each answers the other's API with llama.cpp's 501 "This server does not support
    ...", which the gateway learns as "no route for that API" (the request retried on
    the other, the breaker untouched), so every request of either API is served."""
    gen, embed = engines_pair[1], pooling_engines[0]
    backends = {gen.name: gen.url, embed.name: embed.url}
    with engines.GatewayProcess(backends, workdir, name="gw-mixed").start() as gw:
        client = sdk(gw)
        for i in range(4):  # round robin would send half of each API to the wrong server
            raw = client.embeddings.with_raw_response.create(model=MODEL, input=f"text {i}")
            assert raw.headers["x-turbo-backend"] == embed.name and len(raw.parse().data) == 1
            raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=chat(f"hi {i}"),
                                                                   max_tokens=2, extra_body=NO_EOS)
            assert raw.headers["x-turbo-backend"] == gen.name and raw.parse().usage.completion_tokens == 2
        for backend in (gen.name, embed.name):  # each learned once, by the first request of the other's API
            assert gw.metric("turbo_gateway_upstream_errors_total", backend=backend, reason="api_not_served") <= 1
            assert gw.metric("turbo_gateway_requests_total", model=MODEL, backend=backend, status="501") == 0


def test_a_responses_chain_is_kept_by_the_gateway_for_an_engine_that_keeps_none(gateway_apis):
    """llama.cpp keeps no responses (it refuses ``previous_response_id``); the gateway
    keeps them and sends the engine the whole conversation: the follow-up turn's prompt
    is the engine's own count of the first turn's input, its output and the new input."""
    gw, gen, _, _ = gateway_apis
    client = sdk(gw)
    first = client.responses.create(model=MODEL, instructions="Be brief.", input="Name a colour.",
                                    max_output_tokens=4, extra_body=ONE_CHUNK_PER_TOKEN)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    with client.responses.create(model=MODEL, instructions="Be brief.", input="Another one?",
                                 previous_response_id=first.id, max_output_tokens=4, stream=True,
                                 extra_body=ONE_CHUNK_PER_TOKEN) as stream:
        second = list(stream)[-1].response
    assert second.status == "completed" and second.usage.output_tokens == 4
    # the same conversation sent whole, straight to the engine
    whole = [{"type": "message", "role": "user", "content": "Name a colour."},
             *(item.model_dump(exclude_none=True) for item in first.output),
             {"type": "message", "role": "user", "content": "Another one?"}]
    direct = openai.OpenAI(base_url=gen.url + "/v1", api_key="unused", max_retries=0).responses.create(
        model=MODEL, instructions="Be brief.", input=whole, max_output_tokens=4, extra_body=ONE_CHUNK_PER_TOKEN)
    assert second.usage.input_tokens == direct.usage.input_tokens > first.usage.input_tokens
    items = client.responses.input_items.list(second.id, order="asc").data
    assert [getattr(i, "role", None) for i in items] == ["user", "assistant", "user"]


# ---- (e) a stream survives its engine: SIGKILL mid-stream, continued on the other ---

@contextlib.contextmanager
def killable_pair(workdir: Path, name: str) -> Iterator[tuple[list[engines.LlamaServer], engines.GatewayProcess]]:
    """Two fresh llama-servers of their own (the test kills one) behind a gateway."""
    model = engines.tiny_model()
    servers = [engines.LlamaServer(BIN, model, workdir, name=f"{name}-{i}", parallel=1) for i in range(2)]
    try:
        for s in servers:
            s.start()
        with engines.GatewayProcess({s.name: s.url for s in servers}, workdir, name=f"gw-{name}").start() as gw:
            yield servers, gw
    finally:
        for s in servers:
            s.stop()


def read_killing(stream: Any, servers: list[engines.LlamaServer], at: int) -> list[Any]:
    """Every event of the SDK's ``stream``, the server that serves it (its
    ``x-turbo-backend``) killed with SIGKILL once ``at`` events arrived, the stream
    still open."""
    victim = next(s for s in servers if s.name == stream.response.headers["x-turbo-backend"])
    out = []
    for e in stream:
        out.append(e)
        if len(out) == at:
            victim.proc.kill()
    return out


def test_a_stream_whose_engine_is_killed_is_continued_on_the_other(workdir):
    """Two fresh llama-servers (this test kills one) behind a gateway: a greedy stream
    (temperature 0; ASCII only, so that one event is one token) whose engine gets
    SIGKILL after some tokens reached the client is continued on the other engine
    (``continue_final_message``; llama.cpp continues a last assistant message by
    itself), and the openai SDK receives one answer equal to an uninterrupted run's,
    with its usage."""
    greedy = {**ONE_CHUNK_PER_TOKEN, "temperature": 0}
    max_tokens = 400
    with killable_pair(workdir, "kill") as (servers, gw):
        client = sdk(gw)
        reference = "".join(
            c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model=MODEL, messages=chat("tell me a long story"), max_tokens=max_tokens, stream=True,
                extra_body=greedy) if c.choices)
        stream = client.chat.completions.create(
            model=MODEL, messages=chat("tell me a long story"), max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, extra_body=greedy)
        chunks = read_killing(stream, servers, 10)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == reference and len({c.id for c in chunks}) == 1
        assert chunks[-1].usage.completion_tokens == max_tokens
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert gw.metric("turbo_gateway_stream_migrations_total", model=MODEL, reason="disconnected") == 1


def test_a_messages_stream_whose_engine_is_killed_is_continued_on_the_other(workdir):
    """The same through the Anthropic Messages API and the anthropic SDK: the
    continuation sends the text relayed as a last assistant message, which llama.cpp
    continues (its default assistant prefill), and the client gets one message equal to
    an uninterrupted greedy run's, its output tokens the whole answer's."""
    greedy = {**ONE_CHUNK_PER_TOKEN, "temperature": 0}
    max_tokens = 400
    with killable_pair(workdir, "kill-msg") as (servers, gw):
        client = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0, timeout=60)
        request = {"model": MODEL, "max_tokens": max_tokens,
                   "messages": [{"role": "user", "content": "tell me a long story"}], "extra_body": greedy}
        reference = "".join(e.delta.text for e in client.messages.create(stream=True, **request)
                            if e.type == "content_block_delta")
        stream = client.messages.create(stream=True, **request)
        events = read_killing(stream, servers, 12)
        text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
        assert text == reference and len(text) > 0
        kinds = [e.type for e in events]
        assert kinds.count("message_start") == 1 and kinds[-1] == "message_stop"
        delta = next(e for e in events if e.type == "message_delta")
        assert delta.usage.output_tokens == max_tokens and delta.delta.stop_reason == "max_tokens"
        assert gw.metric("turbo_gateway_stream_migrations_total", model=MODEL, reason="disconnected") == 1
