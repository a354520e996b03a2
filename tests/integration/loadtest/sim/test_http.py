"""The simulated engine over HTTP: real sockets on 127.0.0.1, OpenAI shapes, vLLM
metrics, prefix caching, the disaggregated two-step flow, fault injection, client
disconnect, and the fleet CLI. No wall-clock speed assertions: waits are on conditions
(bounded by a generous deadline); the only time bounds asserted are lower bounds that an
injected delay guarantees."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import load_config, parse_config
from loadtest.sim import tokenizer
from loadtest.sim.__main__ import main as sim_main
from loadtest.sim.fleet import gateway_config, load_fleet
from loadtest.sim.prompt import render_chat
from loadtest.sim.server import SimBackendConfig, start_backends
from tests.support.servers import running_gateway

ROOT = Path(__file__).resolve().parents[4]
MODEL = "sim-model"
LONG = "The quick brown fox jumps over the lazy dog near the river bank. " * 20  # ~260 tokens


@asynccontextmanager
async def backends(*specs: dict):
    cfgs = [SimBackendConfig.from_dict({"models": [MODEL], "speed": 50.0, **s}) for s in specs]
    bs, _ = await start_backends(cfgs)
    try:
        async with aiohttp.ClientSession() as session:
            yield (session, *bs)
    finally:
        for b in bs:
            await b.cleanup()


async def until(cond, timeout: float = 20.0) -> None:
    """Wait for ``cond()`` (sync or async) to become true; fail after ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        r = cond()
        if asyncio.iscoroutine(r):
            r = await r
        if r:
            return
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def post(session, url, path, body, **kw):
    async with session.post(url + path, json=body, **kw) as r:
        return r.status, r.headers.copy(), await r.read()


async def sse_events(resp: aiohttp.ClientResponse) -> list:
    out = []
    async for line in resp.content:
        if line.startswith(b"data: "):
            payload = line[6:].strip()
            out.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return out


async def metrics(session, url) -> dict:
    async with session.get(url + "/metrics") as r:
        assert r.status == 200
        return {f.name: f for f in text_string_to_metric_families(await r.text())}


def value(families: dict, family: str, sample: str | None = None, **labels) -> float:
    for s in families[family].samples:
        if s.name == (sample or family) and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError((family, sample, labels))


# --- OpenAI surface --------------------------------------------------------------------


async def test_chat_stream_and_completion_shapes():
    async with backends({"name": "a"}) as (s, b):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}], "max_completion_tokens": 5,
                "stream": True, "stream_options": {"include_usage": True}}
        async with s.post(b.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            ev = await sse_events(r)
        assert ev[-1] == "[DONE]"
        assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        content = list(ev[1:-2])
        assert len(content) == 5 and all(e["object"] == "chat.completion.chunk" for e in content)
        assert all(len(e["choices"][0]["delta"]["content"].split()) == 1 for e in content)
        assert [e["choices"][0]["finish_reason"] for e in content] == [None] * 4 + ["length"]
        usage_chunk = ev[-2]
        assert usage_chunk["choices"] == []
        prompt_tokens = len(tokenizer.tokenize(render_chat(body["messages"])))
        assert usage_chunk["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 5,
                                        "total_tokens": prompt_tokens + 5,
                                        "prompt_tokens_details": {"cached_tokens": 0}}

        status, _, raw = await post(s, b.url, "/v1/completions",
                                    {"model": MODEL, "prompt": "Once upon", "max_tokens": 3})
        resp = orjson.loads(raw)
        assert status == 200 and resp["object"] == "text_completion"
        assert len(resp["choices"][0]["text"].split()) == 3 and resp["usage"]["completion_tokens"] == 3
        assert resp["usage"]["prompt_tokens"] == tokenizer.count_tokens("Once upon")
        # token ids as the prompt
        status, _, raw = await post(s, b.url, "/v1/completions", {"model": MODEL, "prompt": [300, 301, 302],
                                                                   "max_tokens": 2})
        assert status == 200 and orjson.loads(raw)["usage"]["prompt_tokens"] == 3

        async with s.get(b.url + "/v1/models") as r:
            assert [m["id"] for m in (await r.json())["data"]] == [MODEL]
        async with s.get(b.url + "/health") as r:
            assert r.status == 200
        status, _, raw = await post(s, b.url, "/v1/completions", {"model": "nope", "prompt": "x"})
        assert status == 404 and set(orjson.loads(raw)["error"]) == {"message", "type", "param", "code"}
        status, _, raw = await post(s, b.url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**6})
        assert status == 400 and "maximum context length" in orjson.loads(raw)["error"]["message"]


async def test_a_generation_continued_from_its_text_goes_on_with_the_same_words():
    """The output is greedy, a function of the text before each token: the prompt
    followed by the first k words of an answer (a chat's last message continued, a text
    prompt extended) yields the rest of that answer, and counts the prompt's tokens as
    the first request's prompt plus those k tokens."""
    msgs = [{"role": "user", "content": "Tell me a story"}]
    async with backends({"name": "a"}, {"name": "b"}) as (s, a, b):
        _, _, raw = await post(s, a.url, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 20})
        whole = orjson.loads(raw)
        text = whole["choices"][0]["message"]["content"]
        part = "".join(" " + w for w in text.split(" ")[1:8])  # its first 7 words
        body = {"model": MODEL, "max_tokens": 13, "add_generation_prompt": False, "continue_final_message": True,
                "messages": [*msgs, {"role": "assistant", "content": part}]}
        _, _, raw = await post(s, b.url, "/v1/chat/completions", body)
        rest = orjson.loads(raw)
        assert part + rest["choices"][0]["message"]["content"] == text
        assert rest["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"] + 7
        status, _, raw = await post(s, b.url, "/v1/chat/completions", {**body, "add_generation_prompt": True})
        assert status == 400 and "continue_final_message" in orjson.loads(raw)["error"]["message"]

        _, _, raw = await post(s, a.url, "/v1/completions", {"model": MODEL, "prompt": "Once upon", "max_tokens": 9})
        text = orjson.loads(raw)["choices"][0]["text"]
        part = "".join(" " + w for w in text.split(" ")[1:4])
        _, _, raw = await post(s, b.url, "/v1/completions", {"model": MODEL, "prompt": "Once upon" + part,
                                                              "max_tokens": 6})
        assert part + orjson.loads(raw)["choices"][0]["text"] == text


async def test_return_token_ids_streams_vllms_ids_and_a_chats_ids_continue_it_as_a_prompt():
    """``return_token_ids`` (vLLM's chunk shapes: the prompt's ids on the first chunk,
    top-level for chat and in the choice for completions; each chunk's generated ids as
    its choice's ``token_ids``); a chat's prompt ids followed by the first k generated
    ids, sent as a completions prompt, yield the rest of the answer."""
    msgs = [{"role": "user", "content": "Tell me a story"}]
    async with backends({"name": "a"}, {"name": "b"}) as (s, a, b):
        body = {"model": MODEL, "messages": msgs, "max_tokens": 12, "stream": True, "return_token_ids": True}
        async with s.post(a.url + "/v1/chat/completions", json=body) as r:
            evs = [e for e in await sse_events(r) if e != "[DONE]"]
        prompt = evs[0]["prompt_token_ids"]
        assert prompt == tokenizer.tokenize(render_chat(msgs)) and "token_ids" not in evs[0]["choices"][0]
        ids = [i for e in evs[1:] for i in e["choices"][0]["token_ids"]]
        text = "".join(e["choices"][0]["delta"]["content"] for e in evs[1:])
        assert len(ids) == 12 and tokenizer.detokenize(ids) == text
        async with s.post(b.url + "/v1/completions", json={"model": MODEL, "prompt": prompt + ids[:5], "max_tokens": 7,
                                                          "stream": True, "return_token_ids": True}) as r:
            rest = [e for e in await sse_events(r) if e != "[DONE]"]
        assert rest[0]["choices"][0]["prompt_token_ids"] == prompt + ids[:5]
        assert [i for e in rest for i in e["choices"][0]["token_ids"]] == ids[5:]
        assert tokenizer.detokenize(ids[:5]) + "".join(e["choices"][0]["text"] for e in rest) == text
        assert b.stats()["paths"] == {"/v1/completions": 1}


async def test_bad_token_ids_get_vllms_400s():
    """A prompt of token ids is checked as vLLM 0.32 checks it: its request model
    (``list[Annotated[int, Field(ge=0)]]``, pydantic's lax integers) answers a negative
    or fractional id with a validation error naming its place, its renderer an id past
    the vocabulary with ``Token id N is out of vocabulary``; ``true`` and ``2.0`` are
    the integers 1 and 2 there, as in vLLM. Never a 500."""
    tiny = str(ROOT / "tests" / "support" / "data" / "tiny-tokenizer")
    async with backends({"name": "a"}, {"name": "t", "tokenizer": tiny}) as (s, b, t):
        cases = [
            ([1, 2, -5], "Input should be greater than or equal to 0", "Bad Request", "body.prompt.2"),
            ([[1, -2]], "Input should be greater than or equal to 0", "Bad Request", "body.prompt.0.1"),
            ([1.5, 2], "Input should be a valid integer, got a number with a fractional part", "Bad Request",
             "body.prompt.0"),
            ([3, "x"], "Input should be a valid integer", "Bad Request", "body.prompt.1"),
            ([99999999999], "Token id 99999999999 is out of vocabulary", "BadRequestError", None),
            ([tokenizer.VOCAB_SIZE], f"Token id {tokenizer.VOCAB_SIZE} is out of vocabulary", "BadRequestError",
             None),
        ]
        for prompt, message, etype, param in cases:
            status, _, raw = await post(s, b.url, "/v1/completions", {"model": MODEL, "prompt": prompt})
            assert status == 400, (prompt, raw)
            assert orjson.loads(raw)["error"] == {"message": message, "type": etype, "param": param, "code": 400}
        # the vocabulary is the backend's tokenizer's (8192 ids for the tiny one)
        status, _, raw = await post(s, t.url, "/v1/completions", {"model": MODEL, "prompt": [8191, 8192]})
        assert status == 400 and orjson.loads(raw)["error"]["message"] == "Token id 8192 is out of vocabulary"
        for prompt in ([True, 2], [1.0, 2], [1, 2]):
            status, _, raw = await post(s, t.url, "/v1/completions", {"model": MODEL, "prompt": prompt,
                                                                       "max_tokens": 1})
            assert status == 200 and orjson.loads(raw)["usage"]["prompt_tokens"] == 2
        for prompt in (["a", "b"], [[1], [2]]):  # a real batch: refused for that reason
            status, _, raw = await post(s, b.url, "/v1/completions", {"model": MODEL, "prompt": prompt})
            assert status == 400 and "batched prompts" in orjson.loads(raw)["error"]["message"]


async def test_eos_after_and_ignore_eos():
    async with backends({"name": "a", "eos_after": 3}) as (s, b):
        req = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": 10}
        resp = orjson.loads((await post(s, b.url, "/v1/completions", req))[2])
        assert resp["choices"][0]["finish_reason"] == "stop" and resp["usage"]["completion_tokens"] == 3
        resp = orjson.loads((await post(s, b.url, "/v1/completions", {**req, "ignore_eos": True}))[2])
        assert resp["choices"][0]["finish_reason"] == "length" and resp["usage"]["completion_tokens"] == 10
        async with s.post(b.url + "/v1/completions", json={**req, "stream": True}) as r:
            ev = await sse_events(r)
        assert ev[-2]["choices"][0]["finish_reason"] == "stop"  # EOS chunk: empty text
        assert sum(len(e["choices"][0]["text"].split()) for e in ev[:-1]) == 3


async def test_repeated_prompt_reports_cached_tokens():
    async with backends({"name": "a"}) as (s, b):
        req = {"model": MODEL, "messages": [{"role": "system", "content": LONG},
                                            {"role": "user", "content": "Summarize."}], "max_tokens": 2}
        first = orjson.loads((await post(s, b.url, "/v1/chat/completions", req))[2])["usage"]
        second = orjson.loads((await post(s, b.url, "/v1/chat/completions", req))[2])["usage"]
        assert first["prompt_tokens_details"]["cached_tokens"] == 0
        cached = second["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0 and cached % 16 == 0 and cached <= second["prompt_tokens"] - 1
        m = await metrics(s, b.url)
        assert value(m, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == cached
        assert value(m, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == 2 * first["prompt_tokens"]


async def test_a_session_between_turns_losing_its_blocks_is_counted():
    """A request's ``prompt_cache_key`` tags its blocks with its session: evicted once
    the session has nothing in the engine, they count in
    ``sim:kv_evictions_idle_session``; blocks of a request without one count only in
    ``sim:kv_evictions``."""
    async with backends({"name": "a", "profile_overrides": {"num_gpu_blocks": 24}}) as (s, b):
        turn = {"model": MODEL, "messages": [{"role": "user", "content": LONG}], "max_tokens": 1,
                "prompt_cache_key": "agent-1"}
        other = {"model": MODEL, "messages": [{"role": "user", "content": "Other words here. " * 60}],
                 "max_tokens": 1}

        async def evictions() -> tuple[float, float]:
            m = await metrics(s, b.url)
            return (value(m, "sim:kv_evictions", "sim:kv_evictions_total"),
                    value(m, "sim:kv_evictions_idle_session", "sim:kv_evictions_idle_session_total"))

        assert (await post(s, b.url, "/v1/chat/completions", turn))[0] == 200
        assert (await post(s, b.url, "/v1/chat/completions", other))[0] == 200  # evicts the waiting turn's blocks
        total, idle = await evictions()
        assert idle == total > 0
        assert (await post(s, b.url, "/v1/chat/completions", turn))[0] == 200  # back: evicts other's blocks
        total2, idle2 = await evictions()
        assert total2 > total and idle2 == idle


async def test_metrics_carry_vllm_names_and_types():
    async with backends({"name": "a", "profile": "h100-llama3-8b", "speed": 20.0}) as (s, b):
        for _ in range(2):
            async with s.post(b.url + "/v1/completions", json={"model": MODEL, "prompt": LONG, "max_tokens": 4,
                                                               "stream": True}) as r:
                await sse_events(r)
        m = await metrics(s, b.url)
    types = {
        "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge", "vllm:cache_config_info": "gauge",
        "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
        "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
        "vllm:num_preemptions": "counter", "vllm:request_success": "counter",
        "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
        "vllm:time_per_output_token_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
    }
    for name, typ in types.items():
        assert name in m and m[name].type == typ, name
    info = m["vllm:cache_config_info"].samples[0].labels
    assert info["block_size"] == "16" and int(info["num_gpu_blocks"]) == b.profile.num_gpu_blocks
    assert value(m, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == 2
    assert value(m, "vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == 6
    assert value(m, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count") == 2
    assert value(m, "vllm:generation_tokens", "vllm:generation_tokens_total") == 8
    prompt_tokens = tokenizer.count_tokens(LONG)
    assert value(m, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == 2 * prompt_tokens
    assert value(m, "vllm:request_success", "vllm:request_success_total", finished_reason="length") == 2
    assert value(m, "vllm:num_requests_running") == 0 and value(m, "vllm:kv_cache_usage_perc") == 0
    assert value(m, "vllm:num_requests_running", model_name=MODEL) == 0


# --- disaggregated prefill / decode ----------------------------------------------------------


async def test_disaggregated_two_step_flow():
    async with backends({"name": "p", "role": "prefill", "profile": "h100-llama3-8b-prefill"},
                        {"name": "d", "role": "decode", "profile": "h200-llama3-8b-decode"}) as (s, p, d):
        n = tokenizer.count_tokens(LONG)
        # Step 1: prefill, as vLLM's disagg proxy sends it.
        req = {"model": MODEL, "prompt": LONG, "max_tokens": 1, "stream": False,
               "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                      "remote_engine_id": None, "remote_block_ids": None,
                                      "remote_host": None, "remote_port": None}}
        status, _, raw = await post(s, p.url, "/v1/completions", req)
        pre = orjson.loads(raw)
        assert status == 200 and pre["usage"]["completion_tokens"] == 1
        kvp = pre["kv_transfer_params"]
        assert kvp["do_remote_prefill"] is True and kvp["do_remote_decode"] is False
        assert kvp["remote_engine_id"] == p.engine.engine_id
        assert (kvp["remote_host"], kvp["remote_port"]) == ("127.0.0.1", p.port)
        assert len(kvp["remote_block_ids"]) == -(-(n + 1) // 16) and kvp["remote_num_tokens"] == n
        assert len(kvp["remote_block_hashes"]) == n // 16
        assert p.engine.prefill_tokens_computed_total == n

        # Step 2: decode with the params; the prompt arrives by transfer, not recompute.
        body = {"model": MODEL, "prompt": LONG, "max_tokens": 6, "stream": True,
                "stream_options": {"include_usage": True}, "kv_transfer_params": kvp}
        async with s.post(d.url + "/v1/completions", json=body) as r:
            ev = await sse_events(r)
        usage = ev[-2]["usage"]
        assert usage["completion_tokens"] == 6 and usage["prompt_tokens"] == n
        assert usage["prompt_tokens_details"]["cached_tokens"] == n - 1  # all but the last prompt token
        assert d.engine.kv_transfer_tokens_total == n - 1
        assert d.engine.prefill_tokens_computed_total == 1
        # The decode instance continues the prefill's first token.
        first_text = "".join(e["choices"][0]["text"] for e in ev[:-2])
        assert first_text.startswith(pre["choices"][0]["text"])
        m = await metrics(s, d.url)
        assert value(m, "sim:kv_transfer_tokens", "sim:kv_transfer_tokens_total") == n - 1

        # A mixed request to the decode instance (no params) recomputes the prompt.
        await post(s, d.url, "/v1/completions", {"model": MODEL, "prompt": "fresh prompt " * 10, "max_tokens": 1})
        assert d.engine.prefill_tokens_computed_total > 1


# --- faults ----------------------------------------------------------------------------------


async def test_fault_error_rate_and_rate_limit_from_spec_and_admin():
    async with backends({"name": "a", "faults": {"error_rate": 1.0, "error_status": 503}}) as (s, b):
        req = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        status, _, raw = await post(s, b.url, "/v1/completions", req)
        assert status == 503 and orjson.loads(raw)["error"]["code"] == 503
        async with s.get(b.url + "/admin/faults") as r:
            assert (await r.json())["error_rate"] == 1.0

        status, _, raw = await post(s, b.url, "/admin/faults", {"rate_limit_rate": 1.0, "retry_after_s": 2})
        assert status == 200 and orjson.loads(raw)["error_rate"] == 0.0
        status, headers, raw = await post(s, b.url, "/v1/completions", req)
        assert status == 429 and headers["Retry-After"] == "2"
        assert orjson.loads(raw)["error"]["type"] == "RateLimitError"

        status, _, _ = await post(s, b.url, "/admin/faults", {"error_rat": 1})
        assert status == 400
        status, _, _ = await post(s, b.url, "/admin/faults", {})
        assert (await post(s, b.url, "/v1/completions", req))[0] == 200
        async with s.get(b.url + "/metrics") as r:
            text = await r.text()
        assert 'sim:faults_injected_total{engine="0",fault="error",model_name="sim-model"} 1.0' in text


async def test_fault_stall_and_hang_withhold_the_first_byte():
    async with backends({"name": "a", "faults": {"stall_s": 60}}) as (s, b):
        req = {"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True}
        task = asyncio.create_task(post(s, b.url, "/v1/completions", req))
        await until(lambda: b.faults_injected.get("stall") == 1)
        async with s.get(b.url + "/health") as r:  # the server itself is responsive
            assert r.status == 200
        assert not task.done()  # no status line yet
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

        await post(s, b.url, "/admin/faults", {"hang_rate": 1.0})
        task = asyncio.create_task(post(s, b.url, "/v1/completions", req))
        await until(lambda: b.faults_injected.get("hang") == 1)
        async with s.get(b.url + "/admin/stats") as r:
            assert (await r.json())["engine"]["num_requests_running"] == 0  # never reached the engine
        assert not task.done()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

        await post(s, b.url, "/admin/faults", {"stall_s": 0.05})
        assert (await post(s, b.url, "/v1/completions", req))[0] == 200


async def test_fault_close_after_chunks_truncates_the_stream():
    async with backends({"name": "a", "faults": {"close_after_chunks": 3}}) as (s, b):
        req = {"model": MODEL, "prompt": "x", "max_tokens": 20, "stream": True}
        got = []
        with pytest.raises((aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError)):
            async with s.post(b.url + "/v1/completions", json=req) as r:
                assert r.status == 200
                async for line in r.content:
                    if line.startswith(b"data: "):
                        got.append(line)
        assert len(got) == 3 and not any(b"[DONE]" in g for g in got)
        # Non-streamed: the connection closes with no answer.
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await post(s, b.url, "/v1/completions", {**req, "stream": False})
        await until(lambda: b.engine.kv_cache_usage == 0 and not b.engine.has_work())


async def test_fault_drip_delays_every_chunk():
    async with backends({"name": "a", "speed": 1000.0, "faults": {"drip_s": 0.05}}) as (s, b):
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        async with s.post(b.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 5,
                                                           "stream": True}) as r:
            ev = await sse_events(r)
        assert len(ev) == 6 and ev[-1] == "[DONE]"
        assert loop.time() - t0 >= 5 * 0.05  # a lower bound the injected delay guarantees
        assert b.faults_injected["drip"] == 1


async def test_fault_crash_and_restart_on_the_same_port():
    async with backends({"name": "a", "speed": 1.0}) as (s, b):
        port, engine_id = b.port, b.engine.engine_id
        await post(s, b.url, "/v1/completions", {"model": MODEL, "prompt": LONG, "max_tokens": 1})
        assert b.engine.kv.cached  # warm prefix cache
        # An in-flight stream is cut by the crash.
        r = await s.post(b.url + "/v1/completions", json={"model": MODEL, "prompt": "y", "max_tokens": 3000,
                                                          "stream": True})
        await r.content.readline()
        status, _, raw = await post(s, b.url, "/admin/crash", {"down_s": 60})
        assert status == 200 and orjson.loads(raw)["down_s"] == 60
        with pytest.raises((aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError)):
            async for _ in r.content:
                pass
        r.release()
        await until(lambda: not b.up.is_set())
        with pytest.raises(aiohttp.ClientConnectorError):
            async with s.get(b.url + "/health", headers={"Connection": "close"}):
                pass
        b.revive()
        await until(b.up.is_set)
        async with s.get(b.url + "/health") as resp:
            assert resp.status == 200
        assert b.port == port and b.engine.engine_id != engine_id and not b.engine.kv.cached  # cold restart
        assert b.crashes == 1


async def test_scheduled_crash_from_the_spec():
    async with backends({"name": "a", "faults": {"crash_after_s": 0, "crash_down_s": 60}}) as (s, b):
        await until(lambda: b.crashes == 1 and not b.up.is_set())
        b.revive()
        await until(b.up.is_set)
        assert (await post(s, b.url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}))[0] == 200


# --- disconnect ---------------------------------------------------------------------------


async def test_client_disconnect_aborts_and_frees_blocks():
    async with backends({"name": "a", "speed": 1.0}) as (s, b):
        r = await s.post(b.url + "/v1/completions", json={"model": MODEL, "prompt": LONG, "max_tokens": 3000,
                                                          "stream": True})
        await r.content.readline()  # first token arrived: the request holds KV blocks
        m = await metrics(s, b.url)
        assert value(m, "vllm:kv_cache_usage_perc") > 0 and value(m, "vllm:num_requests_running") == 1
        r.close()  # client goes away mid-stream

        async def freed():
            m = await metrics(s, b.url)
            return value(m, "vllm:kv_cache_usage_perc") == 0 and value(m, "vllm:num_requests_running") == 0

        await until(freed)
        m = await metrics(s, b.url)
        assert value(m, "vllm:request_success", "vllm:request_success_total", finished_reason="abort") == 1


# --- spec, fleet, CLI ---------------------------------------------------------------------------


def test_spec_validation_errors(capsys):
    with pytest.raises(ValueError, match="unknown field"):
        SimBackendConfig.from_dict({"name": "x", "itl_s": 0.01})
    with pytest.raises(ValueError, match="unknown profile"):
        SimBackendConfig.from_dict({"name": "x", "profile": "tpu"})
    with pytest.raises(ValueError, match="error_rate"):
        SimBackendConfig.from_dict({"name": "x", "faults": {"error_rate": 2}})
    assert sim_main(["--spec", '[{"name": "x", "role": "both"}]']) == 2
    assert "role" in capsys.readouterr().err


async def test_gateway_fronts_a_fleet_config(tmp_path):
    fleet = load_fleet(ROOT / "loadtest" / "fleets" / "demo.yaml")
    for b in fleet.backends:
        b.sim.speed = 50.0
    bs, urls = await start_backends([b.sim for b in fleet.backends])
    try:
        cfg = gateway_config(fleet, urls)
        cfg["listen"] = {"host": "127.0.0.1", "port": 0}
        async with running_gateway(parse_config(cfg)) as gw:
            async with aiohttp.ClientSession() as s:
                status, _, raw = await post(s, gw.url, "/v1/chat/completions",
                                            {"model": "demo-model", "max_tokens": 3, "ignore_eos": True,
                                             "messages": [{"role": "user", "content": "hello"}]})
        assert status == 200 and orjson.loads(raw)["usage"]["completion_tokens"] == 3
    finally:
        for b in bs:
            await b.cleanup()


@pytest.mark.slow
def test_fleet_cli_starts_six_backends_and_writes_gateway_config(tmp_path):
    out = tmp_path / "gw.yaml"
    proc = subprocess.Popen([sys.executable, "-m", "loadtest.sim", "--fleet", "loadtest/fleets/hetero6.yaml",
                             "--write-gateway-config", str(out), "--exit-on-stdin-eof"],
                            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        urls = json.loads(proc.stdout.readline())
        assert len(urls) == 6
        cfg = load_config(out)
        assert {b.name: b.url for b in cfg.backends} == urls
        assert {p.name: p.role for p in cfg.pools} == {"mixed": "mixed", "prefill": "prefill", "decode": "decode"}
        pools = {b.name: b.pool for b in cfg.backends}
        assert pools["prefill-h100"] == "prefill" and pools["decode-h200"] == "decode"
        assert all(b.hints.kv_capacity_tokens for b in cfg.backends)
        import urllib.request
        for name, url in urls.items():
            with urllib.request.urlopen(url + "/admin/stats", timeout=10) as r:
                stats = json.loads(r.read())
            assert stats["name"] == name
        roles = {}
        for name, url in urls.items():
            with urllib.request.urlopen(url + "/admin/stats", timeout=10) as r:
                roles[name] = json.loads(r.read())["role"]
        assert roles["prefill-h100"] == "prefill" and roles["decode-h200"] == "decode" and roles["h100-0"] == "mixed"
    finally:
        proc.stdin.close()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, proc.stderr.read().decode()


def test_calibration_bench_matches_the_profile_in_virtual_time():
    from loadtest.sim.calibrate import bench
    from loadtest.sim.profiles import get_profile
    p = get_profile("a100-llama3-8b")
    r = bench("a100-llama3-8b", 1, num_prompts=2)
    assert r["requests"] == 2
    # batch-1 decode step = overhead + one sequence's GEMM + its KV read (context ~1024..1152)
    lo = p.step_overhead_s + p.decode_s_per_seq + 1024 * p.kv_read_s_per_token
    hi = p.step_overhead_s + p.decode_s_per_seq + 1152 * p.kv_read_s_per_token
    assert lo <= r["tpot_s"] <= hi
    assert bench("a100-llama3-8b", 8, num_prompts=16)["output_tok_per_s"] > 4 * r["output_tok_per_s"]
