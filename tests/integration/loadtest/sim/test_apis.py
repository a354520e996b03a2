"""The simulated engine's other APIs (loadtest/sim/apis.py) over real sockets on
127.0.0.1, read by the official SDKs where there is one (openai: Responses, embeddings;
anthropic: Messages, count_tokens) and by raw aiohttp otherwise and for bad requests.
Token counts are checked against the prompt as the simulator renders and tokenizes it,
event grammars in order, and the prefix cache through ``cached_tokens``."""

from __future__ import annotations

from contextlib import asynccontextmanager

import aiohttp
import anthropic
import openai
import orjson
import pytest

from loadtest.sim import tokenizer
from loadtest.sim.prompt import render_chat
from loadtest.sim.server import SimBackendConfig, start_backends
from tests.integration.loadtest.sim.test_http import LONG, MODEL, metrics, until, value


@asynccontextmanager
async def backend(**spec):
    cfg = SimBackendConfig.from_dict({"name": "a", "models": [MODEL], "speed": 50.0, **spec})
    (b,), _ = await start_backends([cfg])
    try:
        async with aiohttp.ClientSession() as session:
            yield session, b
    finally:
        await b.cleanup()


def prompt_len(messages: list[dict]) -> int:
    return len(tokenizer.tokenize(render_chat(messages)))


async def raw_sse(session: aiohttp.ClientSession, url: str, body: dict) -> list[tuple[str, dict]]:
    """The ``(event, data)`` pairs of a streamed answer; fails on a data line without
    its event line."""
    out = []
    async with session.post(url, json=body) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        text = (await r.read()).decode()
    for block in text.split("\n\n"):
        if not block:
            continue
        lines = block.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        out.append((lines[0][7:], orjson.loads(lines[1][6:])))
    return out


# --- Responses ------------------------------------------------------------------------


async def test_responses_create_with_the_openai_sdk_counts_tokens_and_caches_turns():
    async with backend(eos_after=4) as (_, b):
        client = openai.AsyncOpenAI(base_url=b.url + "/v1", api_key="unused", max_retries=0)
        r = await client.responses.create(model=MODEL, instructions=LONG, input="Summarize.", max_output_tokens=10)
        turn1 = [{"role": "system", "content": LONG}, {"role": "user", "content": "Summarize."}]
        assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
        assert r.model == MODEL and len(r.output) == 1 and r.output[0].type == "message"
        assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text"
        assert len(r.output_text.split()) == 4
        u = r.usage
        assert u is not None
        assert (u.input_tokens, u.output_tokens, u.total_tokens) == (prompt_len(turn1), 4, prompt_len(turn1) + 4)
        assert u.input_tokens_details.cached_tokens == 0 and u.output_tokens_details.reasoning_tokens == 0

        # The next turn carries the first answer back as an input item: its prompt starts
        # with the first one, so it hits the blocks the first turn left in the cache.
        turn2 = [{"role": "user", "content": "Summarize."}, r.output[0].model_dump(exclude_none=True),
                 {"role": "user", "content": [{"type": "input_text", "text": "Shorter."}]}]
        r2 = await client.responses.create(model=MODEL, instructions=LONG, input=turn2, max_output_tokens=2)
        assert r2.status == "incomplete" and r2.incomplete_details is not None
        assert r2.incomplete_details.reason == "max_output_tokens" and r2.usage is not None
        assert r2.usage.output_tokens == 2
        assert r2.usage.input_tokens == prompt_len(turn1[:1] + [{"role": "user", "content": "Summarize."},
                                                                {"role": "assistant", "content": r.output_text},
                                                                {"role": "user", "content": "Shorter."}])
        block = b.profile.block_size
        assert r2.usage.input_tokens_details.cached_tokens >= (prompt_len(turn1) // block - 1) * block > 0


async def test_responses_stream_events_in_order_parsed_by_the_openai_sdk():
    async with backend() as (s, b):
        client = openai.AsyncOpenAI(base_url=b.url + "/v1", api_key="unused", max_retries=0)
        events = [e async for e in await client.responses.create(model=MODEL, input="Hi there",
                                                                 max_output_tokens=6, stream=True)]
        kinds = [e.type for e in events]
        assert kinds == (["response.created", "response.in_progress", "response.output_item.added",
                          "response.content_part.added"] + ["response.output_text.delta"] * 6
                         + ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done", "response.completed"])
        assert [e.sequence_number for e in events] == list(range(len(events)))
        deltas = [e for e in events if e.type == "response.output_text.delta"]
        item_id = events[2].item.id
        assert all(d.item_id == item_id and d.output_index == 0 and d.content_index == 0 for d in deltas)
        assert all(len(d.delta.split()) == 1 for d in deltas)
        text = "".join(d.delta for d in deltas)
        done = events[-1].response
        assert events[-4].text == text and done.output_text == text and done.output[0].id == item_id
        assert done.usage is not None and done.usage.output_tokens == 6
        assert done.usage.input_tokens == prompt_len([{"role": "user", "content": "Hi there"}])
        assert events[0].response.status == "in_progress" and events[0].response.usage is None

        # The SDK's stream helper accumulates the same events into the final response.
        async with client.responses.stream(model=MODEL, input="Hi there", max_output_tokens=6) as stream:
            final = await stream.get_final_response()
        assert final.output_text == text  # same prompt, same seed, same tokens
        assert final.usage is not None and final.usage.input_tokens_details.cached_tokens > 0

        # On the wire: an event line before each data line, and no [DONE].
        pairs = await raw_sse(s, b.url + "/v1/responses", {"model": MODEL, "input": "Hi", "stream": True,
                                                            "max_output_tokens": 2})
        assert all(ev == data["type"] for ev, data in pairs) and pairs[-1][0] == "response.completed"


async def test_responses_bad_requests_get_openai_errors():
    async with backend() as (s, b):
        client = openai.AsyncOpenAI(base_url=b.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model="nope", input="x")
        with pytest.raises(openai.NotFoundError) as e:
            await client.responses.create(model=MODEL, input="x", previous_response_id="resp_123")
        assert "resp_123" in str(e.value)
        for body, param in [({"model": MODEL}, "input"), ({"model": MODEL, "input": []}, "input"),
                            ({"model": MODEL, "input": [{"role": "robot", "content": "x"}]}, "input.0"),
                            ({"model": MODEL, "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
                            ({"model": MODEL, "input": "x", "stream": "yes"}, "stream")]:
            async with s.post(b.url + "/v1/responses", json=body) as r:
                err = (await r.json())["error"]
                assert r.status == 400 and err["param"] == param and err["code"] == 400, body
                assert set(err) == {"message", "type", "param", "code"}
        async with s.post(b.url + "/v1/responses", data=b"{not json") as r:
            assert r.status == 400 and "error" in await r.json()
        m = await metrics(s, b.url)  # no refused request reached the engine
        assert value(m, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == 0


async def test_responses_faults_and_client_disconnect():
    async with backend(faults={"error_rate": 1.0, "error_status": 503}) as (s, b):
        async with s.post(b.url + "/v1/responses", json={"model": MODEL, "input": "x"}) as r:
            assert r.status == 503 and (await r.json())["error"]["code"] == 503
        async with s.post(b.url + "/admin/faults", json={"close_after_chunks": 3}) as r:
            assert r.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await raw_sse(s, b.url + "/v1/responses", {"model": MODEL, "input": "x", "stream": True,
                                                       "max_output_tokens": 10})
        async with s.post(b.url + "/admin/faults", json={}) as r:
            assert r.status == 200

    async with backend(speed=1.0) as (s, b):
        r = await s.post(b.url + "/v1/responses", json={"model": MODEL, "input": LONG, "stream": True,
                                                        "max_output_tokens": 3000})
        async for line in r.content:
            if line.startswith(b"data: ") and b"output_text.delta" in line:
                break  # the first token arrived: the request holds KV blocks
        assert value(await metrics(s, b.url), "vllm:num_requests_running") == 1
        r.close()

        async def freed():
            m = await metrics(s, b.url)
            return value(m, "vllm:kv_cache_usage_perc") == 0 and value(m, "vllm:num_requests_running") == 0

        await until(freed)


# --- Anthropic Messages ---------------------------------------------------------------


async def test_messages_create_and_count_tokens_with_the_anthropic_sdk():
    async with backend(eos_after=4) as (_, b):
        client = anthropic.AsyncAnthropic(base_url=b.url, api_key="unused", max_retries=0)
        turn1 = [{"role": "system", "content": LONG}, {"role": "user", "content": "Summarize."}]
        m = await client.messages.create(model=MODEL, max_tokens=10, system=LONG,
                                         messages=[{"role": "user", "content": "Summarize."}])
        assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == MODEL
        assert m.stop_reason == "end_turn" and m.stop_sequence is None
        assert len(m.content) == 1 and m.content[0].type == "text" and len(m.content[0].text.split()) == 4
        assert (m.usage.input_tokens, m.usage.cache_read_input_tokens, m.usage.output_tokens) == (
            prompt_len(turn1), 0, 4)

        # System and content as blocks render as the strings do.
        counted = await client.messages.count_tokens(
            model=MODEL, system=[{"type": "text", "text": LONG}],
            messages=[{"role": "user", "content": [{"type": "text", "text": "Summarize."}]}])
        assert counted.input_tokens == prompt_len(turn1)

        turn2 = [{"role": "user", "content": "Summarize."}, {"role": "assistant", "content": m.content[0].text},
                 {"role": "user", "content": "Shorter."}]
        m2 = await client.messages.create(model=MODEL, max_tokens=2, system=LONG, messages=turn2)
        assert m2.stop_reason == "max_tokens" and m2.usage.output_tokens == 2
        cached = m2.usage.cache_read_input_tokens
        assert cached is not None and m2.usage.input_tokens + cached == prompt_len(turn1[:1] + turn2)
        block = b.profile.block_size
        assert cached >= (prompt_len(turn1) // block - 1) * block > 0


async def test_messages_stream_events_in_order_parsed_by_the_anthropic_sdk():
    async with backend() as (s, b):
        client = anthropic.AsyncAnthropic(base_url=b.url, api_key="unused", max_retries=0)
        req = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "Hi there"}]}
        events = [e async for e in await client.messages.create(**req, stream=True)]
        assert [e.type for e in events] == (["message_start", "content_block_start"] + ["content_block_delta"] * 5
                                            + ["content_block_stop", "message_delta", "message_stop"])
        start = events[0].message
        assert start.usage.input_tokens == prompt_len(req["messages"]) and start.usage.output_tokens == 0
        deltas = [e.delta for e in events[2:7]]
        assert all(d.type == "text_delta" and len(d.text.split()) == 1 for d in deltas)
        assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 5

        async with client.messages.stream(**req) as stream:
            final = await stream.get_final_message()
        assert final.content[0].text == "".join(d.text for d in deltas)  # same prompt, same tokens
        assert final.usage.output_tokens == 5 and final.stop_reason == "max_tokens"
        assert final.usage.cache_read_input_tokens is not None
        assert final.usage.input_tokens + final.usage.cache_read_input_tokens == prompt_len(req["messages"])

        pairs = await raw_sse(s, b.url + "/v1/messages", {**req, "stream": True})
        assert all(ev == data["type"] for ev, data in pairs) and pairs[-1][0] == "message_stop"


async def test_messages_errors_in_anthropic_shape():
    async with backend() as (s, b):
        client = anthropic.AsyncAnthropic(base_url=b.url, api_key="unused", max_retries=0)
        with pytest.raises(anthropic.NotFoundError) as nf:
            await client.messages.create(model="nope", max_tokens=3, messages=[{"role": "user", "content": "x"}])
        assert nf.value.body["error"]["type"] == "not_found_error"
        with pytest.raises(anthropic.BadRequestError):
            await client.messages.count_tokens(model=MODEL, messages=[])
        ok = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]}
        for body in [{**ok, "max_tokens": None}, {**ok, "max_tokens": 0}, {**ok, "messages": []},
                     {**ok, "messages": [{"role": "system", "content": "x"}]},
                     {**ok, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
                     {**ok, "system": 7}, {**ok, "stream": "yes"}]:
            async with s.post(b.url + "/v1/messages", json=body) as r:
                assert r.status == 400, body
                err = await r.json()
                assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", body
                assert set(err["error"]) == {"type", "message"}
        m = await metrics(s, b.url)  # no refused request reached the engine
        assert value(m, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == 0

        async with s.post(b.url + "/admin/faults", json={"rate_limit_rate": 1.0, "retry_after_s": 3}) as r:
            assert r.status == 200
        with pytest.raises(anthropic.RateLimitError) as rl:
            await client.messages.create(**ok)
        assert rl.value.body["error"]["type"] == "rate_limit_error"
        assert rl.value.response.headers["Retry-After"] == "3"


# --- embeddings -----------------------------------------------------------------------


async def test_embeddings_with_the_openai_sdk_are_deterministic_unit_vectors():
    async with backend() as (s, b):
        client = openai.AsyncOpenAI(base_url=b.url + "/v1", api_key="unused", max_retries=0)
        texts = ["a b c", LONG, "a b c"]
        r = await client.embeddings.create(model=MODEL, input=texts)  # the SDK asks for base64
        assert r.object == "list" and r.model == MODEL and [d.index for d in r.data] == [0, 1, 2]
        vecs = [d.embedding for d in r.data]
        assert all(len(v) == 16 and abs(sum(x * x for x in v) - 1.0) < 1e-5 for v in vecs)
        assert vecs[0] == vecs[2] and vecs[0] != vecs[1]
        n = sum(tokenizer.count_tokens(t) for t in texts)
        assert r.usage.prompt_tokens == n and r.usage.total_tokens == n

        f = await client.embeddings.create(model=MODEL, input="a b c", encoding_format="float", dimensions=8)
        assert len(f.data) == 1 and len(f.data[0].embedding) == 8
        g = await client.embeddings.create(model=MODEL, input="a b c", encoding_format="float")
        assert g.data[0].embedding == vecs[0]  # the float32 values base64 carries

        # Token ids as input, and the prefix cache: LONG was seen, so its blocks hit.
        async with s.post(b.url + "/v1/embeddings", json={"model": MODEL, "input": [tokenizer.tokenize(LONG)]}) as h:
            body = await h.json()
        assert h.status == 200 and body["data"][0]["embedding"] == vecs[1]
        assert body["usage"]["completion_tokens"] == 0
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= tokenizer.count_tokens(LONG) - 2 * 16 > 0


async def test_embeddings_bad_requests_get_openai_errors():
    async with backend() as (s, b):
        client = openai.AsyncOpenAI(base_url=b.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            await client.embeddings.create(model="nope", input="x")
        for body, param in [({"model": MODEL}, "input"), ({"model": MODEL, "input": []}, "input"),
                            ({"model": MODEL, "input": [[1, 2], []]}, "input"),
                            ({"model": MODEL, "input": [1, -2]}, "body.input.1"),
                            ({"model": MODEL, "input": "x", "encoding_format": "hex"}, "encoding_format"),
                            ({"model": MODEL, "input": "x", "dimensions": 0}, "dimensions")]:
            async with s.post(b.url + "/v1/embeddings", json=body) as r:
                err = (await r.json())["error"]
                assert r.status == 400 and err["param"] == param, body
        async with s.post(b.url + "/v1/embeddings", json={"model": MODEL, "input": [10**9]}) as r:
            assert r.status == 400 and "out of vocabulary" in (await r.json())["error"]["message"]
        async with s.post(b.url + "/v1/embeddings", json={"model": MODEL, "input": LONG * 40}) as r:
            assert r.status == 400 and "maximum context length" in (await r.json())["error"]["message"]
        m = await metrics(s, b.url)  # no refused request reached the engine
        assert value(m, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == 0


# --- rerank, score, detokenize --------------------------------------------------------


async def test_rerank_and_score_in_vllms_shapes_cost_prefill_only():
    async with backend() as (s, b):
        docs = ["the river bank", "a dog", LONG]
        q = "Where is the fox?"
        for path in ("/v1/rerank", "/rerank"):
            async with s.post(b.url + path, json={"model": MODEL, "query": q, "top_n": 2,
                                                  "documents": [docs[0], {"text": docs[1]}, docs[2]]}) as r:
                assert r.status == 200
                body = await r.json()
            assert body["id"].startswith("rerank-") and body["model"] == MODEL
            res = body["results"]
            assert len(res) == 2 and res[0]["relevance_score"] >= res[1]["relevance_score"]
            assert all(0 < x["relevance_score"] < 1 and x["document"]["text"] == docs[x["index"]] for x in res)
            n = sum(tokenizer.count_tokens(q) + tokenizer.count_tokens(d) for d in docs)
            assert body["usage"]["total_tokens"] == n
        # The second call's pairs found the first call's blocks.
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

        async with s.post(b.url + "/v1/score", json={"model": MODEL, "text_1": q, "text_2": docs}) as r:
            assert r.status == 200
            sc = await r.json()
        assert sc["object"] == "list" and [d["index"] for d in sc["data"]] == [0, 1, 2]
        assert all(d["object"] == "score" for d in sc["data"])
        # the same pairs as the rerank: the same scores
        by_index = {x["index"]: x["relevance_score"] for x in res}
        assert all(sc["data"][i]["score"] == v for i, v in by_index.items())
        assert sc["usage"]["prompt_tokens"] == n and sc["usage"]["completion_tokens"] == 0

        async with s.post(b.url + "/v1/score", json={"model": MODEL, "text_1": ["a", "b"], "text_2": ["c", "d"]}) as r:
            assert r.status == 200 and len((await r.json())["data"]) == 2
        m = await metrics(s, b.url)  # 3 + 3 + 3 + 2 pooling requests, one output token each
        assert value(m, "vllm:request_generation_tokens", "vllm:request_generation_tokens_count") == 11
        assert value(m, "vllm:request_generation_tokens", "vllm:request_generation_tokens_sum") == 11


async def test_rerank_score_detokenize_bad_requests_and_faults():
    async with backend() as (s, b):
        cases = [("/v1/rerank", {"model": MODEL, "documents": ["a"]}, "query"),
                 ("/v1/rerank", {"model": MODEL, "query": "q", "documents": []}, "documents"),
                 ("/rerank", {"model": MODEL, "query": "q", "documents": ["a", 3]}, "documents.1"),
                 ("/v1/rerank", {"model": MODEL, "query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
                 ("/v1/score", {"model": MODEL, "text_1": "a"}, "text_2"),
                 ("/v1/score", {"model": MODEL, "text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
                 ("/detokenize", {"model": MODEL, "tokens": "abc"}, "tokens"),
                 ("/detokenize", {"model": MODEL, "tokens": [1, 2.5]}, "body.tokens.1")]
        for path, body, param in cases:
            async with s.post(b.url + path, json=body) as r:
                err = (await r.json())["error"]
                assert r.status == 400 and err["param"] == param and err["code"] == 400, (path, body)
        for path, body in [("/v1/rerank", {"model": "nope", "query": "q", "documents": ["a"]}),
                           ("/v1/score", {"model": "nope", "text_1": "a", "text_2": "b"}),
                           ("/detokenize", {"model": "nope", "tokens": [1]})]:
            async with s.post(b.url + path, json=body) as r:
                assert r.status == 404 and (await r.json())["error"]["param"] == "model"

        ids = tokenizer.tokenize("Hello there, world")
        async with s.post(b.url + "/detokenize", json={"model": MODEL, "tokens": ids}) as r:
            assert r.status == 200 and await r.json() == {"prompt": "Hello there, world"}
        async with s.post(b.url + "/tokenize", json={"model": MODEL, "prompt": "Hello there, world"}) as r:
            assert (await r.json())["tokens"] == ids

        async with s.post(b.url + "/admin/faults", json={"error_rate": 1.0, "error_status": 502}) as r:
            assert r.status == 200
        async with s.post(b.url + "/v1/score", json={"model": MODEL, "text_1": "a", "text_2": "b"}) as r:
            assert r.status == 502 and (await r.json())["error"]["code"] == 502
        assert b.faults_injected["error"] == 1
