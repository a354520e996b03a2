"""A stream survives its backend (docs/failure-contract.md, "After the first byte").

Simulated backends (loadtest/sim) whose greedy output is a function of the prompt's
text, so that a generation continued elsewhere goes on with the same words: a backend
cut mid-stream (``close_after_chunks``, a crash, a stall past the idle timeout), the
openai SDK (or raw aiohttp, to see the bytes) as the client through the gateway's own
data plane. The client gets one uninterrupted answer equal to an uninterrupted run's,
with one usage; the ledger charges both legs; the breaker hears of the failure; requests
that cannot be continued faithfully, a stream past ``migration.max_per_request`` and a
gateway with migration off end with the error event as before.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from loadtest.sim.server import SimBackendConfig, start_backends
from tests.support.chat_cases import TINY
from tests.support.servers import RunningGateway, gateway_config, running_gateway, wait_until

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me a long story."}]
N = 24  # max_tokens of every request
CUT = 6  # the faulty backend closes the connection after this many events (a chat's role chunk and 5 tokens)


@asynccontextmanager
async def fleet(names: tuple[str, ...] = ("a", "b"), faults: dict[str, dict[str, Any]] | None = None,
                tokenizer: str | None = None, backend: dict[str, Any] | None = None,
                **overrides: Any) -> AsyncIterator[tuple[RunningGateway, dict[str, str]]]:
    """Simulated backends ``names`` (the first one is routed to first: round robin in
    config order) with ``faults`` per name, behind a gateway configured with ``overrides``;
    ``tokenizer``: the model's (the backends' and the gateway's ``models.m.tokenizer``);
    ``backend``: fields of every backend's config."""
    backends, urls = await start_backends(
        [SimBackendConfig(name=n, models=["m"], profile="demo", speed=50.0, tokenizer=tokenizer) for n in names])
    try:
        async with aiohttp.ClientSession() as s:
            for name, f in (faults or {}).items():
                async with s.post(urls[name] + "/admin/faults", json=f) as r:
                    assert r.status == 200, await r.text()
        if tokenizer is not None:
            overrides["models"] = {"m": {"tokenizer": tokenizer}}
        cfg = gateway_config([{"name": n, "url": u, "models": ["m"], **(backend or {})} for n, u in urls.items()],
                             **overrides)
        async with running_gateway(cfg) as gw:
            yield gw, urls
            for name in urls:
                await wait_until(lambda name=name: gw.idle(name))
    finally:
        for b in backends:
            await b.cleanup()


async def sdk_chat(url: str, **extra: Any) -> tuple[str, list[Any], Any]:
    """One streamed chat answer through the openai SDK: its text, its chunks, its usage."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=N, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True}, **extra)
        chunks = [c async for c in stream]
    finally:
        await client.close()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks, chunks[-1].usage


async def uninterrupted(url: str, faults: dict[str, Any]) -> str:
    """The reference: the chat answer of the backend at ``url`` with its faults lifted,
    which are then set back to ``faults``."""
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/admin/faults", json={}) as r:
            assert r.status == 200
        expected, _, _ = await sdk_chat(url)
        async with s.post(url + "/admin/faults", json=faults) as r:
            assert r.status == 200
    return expected


async def raw(url: str, path: str, body: dict[str, Any]) -> bytes:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        assert r.status == 200
        return await r.read()


def events(body: bytes) -> list[Any]:
    return [orjson.loads(line[5:]) for line in body.split(b"\n")
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]"]


def ledger(gw: RunningGateway) -> list[int]:
    """The usage ledger's sums: [requests, prompt, cached, completion, errors, cost]."""
    total = [0] * 6
    for v in gw.state.usage.buckets.values():
        total = [a + b for a, b in zip(total, v, strict=True)]
    return total


@pytest.mark.parametrize("fast", [True, False], ids=["fast_path", "aiohttp"])
async def test_a_chat_stream_cut_mid_answer_is_continued_into_one_answer(fast):
    async with fleet(faults={"a": {"close_after_chunks": CUT}}, listen={"fast_path": fast}) as (gw, urls):
        expected, _, ref_usage = await sdk_chat(urls["b"])  # uninterrupted, straight from an engine
        text, chunks, usage = await sdk_chat(gw.url)
        assert text == expected and len(expected.split()) == N
        assert len({(c.id, c.created, c.model) for c in chunks}) == 1  # one stream: the first leg's identity
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.role) == 1  # one start of the answer
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == \
            (ref_usage.prompt_tokens, N, ref_usage.prompt_tokens + N)
        assert gw.metric("turbo_gateway_stream_migrations_total", model="m", reason="disconnected") == 1
        assert gw.metric("turbo_gateway_stream_errors_total", backend="a", reason="disconnected") == 0
        assert gw.metric("turbo_gateway_upstream_errors_total", backend="a", reason="disconnected") == 1
        assert gw.state.fleet.backends["a"].breaker.failures == 1  # the breaker heard of it
        assert gw.metric("turbo_gateway_requests_total", model="m", backend="b", status="200") == 1
        requests, prompt, _, completion, errors, _ = ledger(gw)
        relayed = CUT - 1  # tokens the first leg relayed
        # both legs: the first's prompt and its tokens, the continuation's prompt (the first's plus
        # those tokens) and the rest of the answer
        assert (requests, completion, errors) == (1, N, 0)
        assert prompt > ref_usage.prompt_tokens + relayed


async def test_a_completions_stream_is_continued_with_a_comment_and_the_same_bytes_around_it():
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": N, "stream": True, "ignore_eos": True}
    async with fleet(faults={"a": {"close_after_chunks": CUT}}) as (gw, urls):
        expected = "".join(e["choices"][0]["text"] for e in events(await raw(urls["b"], "/v1/completions", body)))
        got = await raw(gw.url, "/v1/completions", body)
        before, sep, after = got.partition(b": migrated from a to b\n\n")
        assert sep and before.endswith(b"\n\n") and after.startswith(b"data: ")
        assert got.count(b"data: [DONE]") == 1 and got.endswith(b"data: [DONE]\n\n")
        evs = events(got)
        assert "".join(e["choices"][0]["text"] for e in evs) == expected
        assert len(events(before)) == CUT and len({(e["id"], e["created"], e["model"]) for e in evs}) == 1
        assert all("usage" not in e for e in evs)  # the client did not ask for usage: it gets none
        assert gw.state.fleet.backends["a"].breaker.failures == 1


async def test_a_backend_that_crashes_mid_stream_is_continued():
    """The engine dies (every connection dropped, its state lost) after some tokens
    reached the client."""
    async with fleet(faults={"a": {"drip_s": 0.02}}) as (gw, urls):
        expected, _, _ = await sdk_chat(urls["b"])
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        stream = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=N, stream=True,
                                                      extra_body={"ignore_eos": True})
        parts = []
        async with aiohttp.ClientSession() as s:
            async for c in stream:
                parts.append(c.choices[0].delta.content or "")
                if len(parts) == 4:
                    async with s.post(urls["a"] + "/admin/crash", json={"down_s": 0.2}) as r:
                        assert r.status == 200
        await client.close()
        assert "".join(parts) == expected
        assert gw.metric("turbo_gateway_stream_migrations_total", model="m", reason="disconnected") == 1


async def test_a_backend_that_goes_silent_mid_stream_is_continued_after_the_idle_timeout():
    async with fleet(faults={"a": {"stall_after_chunks": CUT}}, timeouts={"idle_s": 0.3}) as (gw, urls):
        expected, _, _ = await sdk_chat(urls["b"])
        text, _, usage = await sdk_chat(gw.url)
        assert text == expected and usage.completion_tokens == N
        assert gw.metric("turbo_gateway_stream_migrations_total", model="m", reason="idle_timeout") == 1
        assert gw.metric("turbo_gateway_upstream_errors_total", backend="a", reason="idle_timeout") == 1


INELIGIBLE = {
    "logprobs": {"logprobs": True},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
    "forced_tool_call": {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                         "tool_choice": "required"},
}


@pytest.mark.parametrize("case", list(INELIGIBLE))
async def test_a_request_that_cannot_be_continued_faithfully_keeps_the_error_event(case):
    body = {"model": "m", "messages": MESSAGES, "max_tokens": N, "stream": True, "ignore_eos": True,
            **INELIGIBLE[case]}
    async with fleet(faults={"a": {"close_after_chunks": CUT}}) as (gw, _):
        got = await raw(gw.url, "/v1/chat/completions", body)
        assert b"[DONE]" not in got and b": migrated" not in got
        assert events(got)[-1]["error"]["code"] == "disconnected"
        assert gw.metric("turbo_gateway_stream_migrations_total", model="m", reason="disconnected") == 0
        assert gw.metric("turbo_gateway_stream_errors_total", backend="a", reason="disconnected") == 1


@pytest.mark.parametrize("migration", [{"enabled": False}, {"models": {"m": 0}}])
async def test_migration_turned_off_keeps_the_error_event(migration):
    async with fleet(faults={"a": {"close_after_chunks": CUT}}, migration=migration) as (gw, _):
        with pytest.raises(openai.APIError, match="closed the connection mid-response"):
            await sdk_chat(gw.url)
        assert gw.metric("turbo_gateway_stream_migrations_total", model="m", reason="disconnected") == 0
        assert gw.metric("turbo_gateway_stream_errors_total", backend="a", reason="disconnected") == 1
        requests, _, _, completion, errors, _ = ledger(gw)
        assert (requests, completion, errors) == (1, CUT - 1, 1)  # charged what was relayed


async def test_continuations_stop_at_max_per_request():
    """Every backend cuts its streams after 10 events (a role chunk and 9 tokens): two
    continuations finish an answer of ``N`` tokens on three backends, one does not."""
    cut = {n: {"close_after_chunks": 10} for n in ("a", "b", "c")}
    async with fleet(("a", "b", "c"), cut, migration={"max_per_request": 2}) as (gw, urls):
        expected = await uninterrupted(urls["a"], cut["a"])
        text, _, usage = await sdk_chat(gw.url)
        assert text == expected and usage.completion_tokens == N
        assert gw.metric("turbo_gateway_stream_migrations_total", model="m", reason="disconnected") == 2
    async with fleet(("a", "b", "c"), cut, migration={"max_per_request": 1}) as (gw, _):
        with pytest.raises(openai.APIError):
            await sdk_chat(gw.url)
        assert gw.metric("turbo_gateway_stream_migrations_total", model="m", reason="disconnected") == 1
        assert gw.metric("turbo_gateway_stream_errors_total", backend="c", reason="disconnected") == 1
        requests, _, _, completion, errors, _ = ledger(gw)
        assert (requests, completion, errors) == (1, 18, 1)  # 9 tokens relayed by each leg


async def test_a_stream_whose_only_backend_died_ends_with_the_error_event():
    """No backend can continue it (the only one is down): the continuation's attempts
    fail before a byte, and the stream ends with the error event, charged what the first
    leg relayed."""
    async with fleet(("a",)) as (gw, urls):
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        stream = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=200, stream=True,
                                                      extra_body={"ignore_eos": True})
        got = 0
        with pytest.raises(openai.APIError):
            async with aiohttp.ClientSession() as s:
                async for _ in stream:
                    got += 1
                    if got == 3:
                        async with s.post(urls["a"] + "/admin/crash", json={"down_s": 30}) as r:
                            assert r.status == 200
        await client.close()
        assert 3 <= got < 200
        assert gw.metric("turbo_gateway_stream_migrations_total", model="m", reason="disconnected") == 0
        assert gw.metric("turbo_gateway_upstream_errors_total", backend="a", reason="disconnected") == 1
        requests, _, _, completion, errors, _ = ledger(gw)
        assert (requests, errors) == (1, 1) and completion >= 2


@pytest.mark.parametrize("room, continued", [(500, False), (20_000, True)])
async def test_a_stream_is_continued_only_while_its_bytes_fit_max_kept_bytes(room, continued):
    """``max_tokens`` (24) does not bound the stream within ``room`` at 1 KiB a token, so
    its reads are counted: the cut comes after about 1.2 kB, past 500 bytes (let go: the
    error event) and within 20,000 (continued)."""
    async with fleet(faults={"a": {"close_after_chunks": CUT}}, migration={"max_kept_bytes": room}) as (gw, urls):
        if continued:
            expected, _, _ = await sdk_chat(urls["b"])
            text, _, usage = await sdk_chat(gw.url)
            assert text == expected and usage.completion_tokens == N
        else:
            with pytest.raises(openai.APIError, match="closed the connection mid-response"):
                await sdk_chat(gw.url)
        assert gw.metric("turbo_gateway_stream_migrations_total", model="m", reason="disconnected") == int(continued)
        assert gw.metric("turbo_gateway_stream_errors_total", backend="a", reason="disconnected") == int(not continued)


async def sdk_messages(url: str) -> tuple[str, list[Any], Any]:
    """One streamed Anthropic Messages answer through the anthropic SDK: its text, its
    events and its final message."""
    import anthropic

    client = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)
    try:
        async with client.messages.stream(model="m", max_tokens=N, system=MESSAGES[0]["content"],
                                          messages=[MESSAGES[1]], extra_body={"ignore_eos": True}) as stream:
            got = [e async for e in stream]
            final = await stream.get_final_message()
    finally:
        await client.close()
    return "".join(b.text for b in final.content if b.type == "text"), got, final


async def test_a_messages_stream_cut_mid_answer_is_continued_into_one_answer():
    """Anthropic Messages: the continuation is the request with the text relayed as a
    last assistant message (prefill), its message_start and first block start dropped,
    its message_delta counting the whole answer."""
    async with fleet(faults={"a": {"close_after_chunks": CUT}}) as (gw, urls):
        expected, _, ref = await sdk_messages(urls["b"])  # uninterrupted, straight from an engine
        text, got, final = await sdk_messages(gw.url)
        assert text == expected and len(expected.split()) == N
        kinds = [e.type for e in got]
        assert kinds.count("message_start") == 1 and kinds.count("content_block_start") == 1
        assert kinds.count("message_stop") == 1 and kinds[-1] == "message_stop"
        assert final.stop_reason == "max_tokens" and final.usage.output_tokens == N
        assert final.usage.input_tokens == ref.usage.input_tokens
        assert gw.metric("turbo_gateway_stream_migrations_total", model="m", reason="disconnected") == 1
        requests, prompt, _, completion, errors, _ = ledger(gw)
        assert (requests, completion, errors) == (1, N, 0)
        assert prompt > ref.usage.input_tokens  # both legs' prompts


async def test_a_messages_stream_that_must_call_a_tool_keeps_the_error_event():
    body = {"model": "m", "max_tokens": N, "stream": True, "ignore_eos": True, "messages": [MESSAGES[1]],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "any"}}
    async with fleet(faults={"a": {"close_after_chunks": CUT}}) as (gw, _):
        got = await raw(gw.url, "/v1/messages", body)
        assert b"message_stop" not in got and b": migrated" not in got
        assert b"event: error" in got
        assert gw.metric("turbo_gateway_stream_migrations_total", model="m", reason="disconnected") == 0


async def paths(url: str) -> dict[str, int]:
    """The requests a simulated backend admitted, by path."""
    async with aiohttp.ClientSession() as s, s.get(url + "/admin/stats") as r:
        return (await r.json())["paths"]


@pytest.mark.parametrize("engine_ids", [True, False], ids=["engine_ids", "retokenized"])
async def test_with_the_tokenizer_a_chat_stream_is_continued_by_token_ids(engine_ids, caplog):
    """With the model's tokenizer the continuation is a completions request whose prompt
    is the prompt's ids then the answer's (the engine's own, streamed because the backend
    says it can, or the text re-tokenized), rewritten into chat chunks: the same answer
    as an uninterrupted run, one stream, the whole usage."""
    caplog.set_level(logging.INFO, logger="gateway.pipeline")
    async with fleet(faults={"a": {"close_after_chunks": CUT}}, tokenizer=str(TINY),
                     backend={"return_token_ids": engine_ids}) as (gw, urls):
        expected, _, ref_usage = await sdk_chat(urls["b"])
        text, chunks, usage = await sdk_chat(gw.url)
        assert text == expected and len(expected.split()) == N
        assert len({(c.id, c.created, c.model, c.object) for c in chunks}) == 1
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.role) == 1
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == \
            (ref_usage.prompt_tokens, N, ref_usage.prompt_tokens + N)
        assert (await paths(urls["b"])).get("/v1/completions") == 1
        resent = "engine token ids" if engine_ids else "token ids"
        assert any(f"resent as {resent})" in r.getMessage() for r in caplog.records)
        # the engine's ids reach the client when the backend is asked for them, on both legs
        with_ids = [c for c in chunks if c.choices and c.choices[0].delta.content]
        assert all(bool((c.choices[0].model_extra or {}).get("token_ids")) == engine_ids for c in with_ids)
        assert gw.metric("turbo_gateway_stream_migrations_total", model="m", reason="disconnected") == 1
        requests, prompt, _, completion, errors, _ = ledger(gw)
        assert (requests, completion, errors) == (1, N, 0)
        # both legs' exact prompts: the first's, and the continuation's (it plus the CUT - 1 tokens relayed)
        assert prompt == 2 * ref_usage.prompt_tokens + CUT - 1


async def test_with_the_tokenizer_a_chat_stream_is_continued_twice_by_token_ids():
    cut = {n: {"close_after_chunks": 10} for n in ("a", "b", "c")}
    async with fleet(("a", "b", "c"), cut, tokenizer=str(TINY), backend={"return_token_ids": True},
                     migration={"max_per_request": 2}) as (gw, urls):
        expected = await uninterrupted(urls["a"], cut["a"])
        text, _, usage = await sdk_chat(gw.url)
        assert text == expected and usage.completion_tokens == N
        assert gw.metric("turbo_gateway_stream_migrations_total", model="m", reason="disconnected") == 2
        assert (await paths(urls["c"])).get("/v1/completions") == 1


async def test_with_the_tokenizer_a_completions_stream_is_continued_by_token_ids():
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": N, "stream": True, "ignore_eos": True}
    async with fleet(faults={"a": {"close_after_chunks": CUT}}, tokenizer=str(TINY),
                     backend={"return_token_ids": True}) as (gw, urls):
        expected = "".join(e["choices"][0]["text"] for e in events(await raw(urls["b"], "/v1/completions", body)))
        got = await raw(gw.url, "/v1/completions", body)
        evs = events(got)
        assert "".join(e["choices"][0]["text"] for e in evs) == expected
        assert len({(e["id"], e["created"], e["model"]) for e in evs}) == 1
        assert got.count(b": migrated from a to b") == 1 and got.endswith(b"data: [DONE]\n\n")
        assert gw.metric("turbo_gateway_stream_migrations_total", model="m", reason="disconnected") == 1


async def test_with_the_tokenizer_a_chat_with_tools_keeps_the_text_continuation(caplog):
    """The engine parses a chat's tool calls; a completions request would not: a request
    with ``tools`` is continued as a chat (``continue_final_message``)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    caplog.set_level(logging.INFO, logger="gateway.pipeline")
    async with fleet(faults={"a": {"close_after_chunks": CUT}}, tokenizer=str(TINY)) as (gw, urls):
        expected, _, _ = await sdk_chat(urls["b"], tools=tools)
        text, _, usage = await sdk_chat(gw.url, tools=tools)
        assert text == expected and usage.completion_tokens == N
        assert any("resent as text)" in r.getMessage() for r in caplog.records)
        assert (await paths(urls["b"])).get("/v1/completions") is None
        assert (await paths(urls["b"]))["/v1/chat/completions"] == 2


async def sdk_responses(url: str, **extra: Any) -> tuple[list[Any], Any]:
    """One streamed Responses answer through the openai SDK: its events and its final response."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    try:
        stream = await client.responses.create(model="m", instructions=MESSAGES[0]["content"],
                                               input=MESSAGES[1]["content"], max_output_tokens=N, stream=True,
                                               extra_body={"ignore_eos": True}, **extra)
        got = [e async for e in stream]
    finally:
        await client.close()
    return got, got[-1].response


async def test_with_the_tokenizer_a_responses_stream_is_continued_by_token_ids(caplog):
    """The Responses API has no partial assistant message to continue: with the model's
    tokenizer, the conversation rendered as routing tokenized it, followed by the ids of
    the text relayed, goes to /v1/completions, its chunks rewritten into Responses events
    numbered on; the client gets one answer equal to an uninterrupted run's, one
    ``response.completed`` with the whole usage, and the turn is kept for the next one."""
    caplog.set_level(logging.INFO, logger="gateway.pipeline")
    async with fleet(faults={"a": {"close_after_chunks": CUT}}, tokenizer=str(TINY)) as (gw, urls):
        _, ref = await sdk_responses(urls["b"])
        got, final = await sdk_responses(gw.url)
        assert final.output_text == ref.output_text and len(ref.output_text.split()) == N
        assert "".join(e.delta for e in got if e.type == "response.output_text.delta") == ref.output_text
        kinds = [e.type for e in got]
        assert kinds.count("response.created") == 1 and kinds.count("response.output_item.added") == 1
        assert kinds.count("response.output_text.done") == 1 and kinds[-1] == "response.completed"
        assert [e.sequence_number for e in got] == list(range(len(got)))
        assert final.id == got[0].response.id and final.status == "incomplete"
        assert final.incomplete_details.reason == "max_output_tokens"
        assert (final.usage.input_tokens, final.usage.output_tokens) == (ref.usage.input_tokens, N)
        assert (await paths(urls["b"])).get("/v1/completions") == 1
        logged = [m for r in caplog.records if (m := re.search(r"\((\d+) tokens relayed, resent as token ids\)",
                                                               r.getMessage()))]
        relayed = int(logged[0].group(1))  # the first leg's text events, one token each
        assert len(logged) == 1 and 0 < relayed < N
        assert sum(1 for e in got if e.type == "response.output_text.delta") == N
        assert gw.metric("turbo_gateway_stream_migrations_total", model="m", reason="disconnected") == 1
        requests, prompt, _, completion, errors, _ = ledger(gw)
        assert (requests, completion, errors) == (1, N, 0)
        assert prompt == 2 * ref.usage.input_tokens + relayed  # both legs' exact prompts
        # the turn was kept whole: the next one names it
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        async with aiohttp.ClientSession() as s, s.post(urls["a"] + "/admin/faults", json={}) as r:
            assert r.status == 200
        nxt = await client.responses.create(model="m", input="And then?", previous_response_id=final.id,
                                            max_output_tokens=4)
        await client.close()
        assert nxt.status in ("completed", "incomplete") and nxt.usage.input_tokens > final.usage.input_tokens + N


async def test_without_a_tokenizer_a_responses_stream_keeps_the_error_event():
    async with fleet(faults={"a": {"close_after_chunks": CUT}}) as (gw, _):
        with pytest.raises(openai.APIError):
            await sdk_responses(gw.url)
        assert gw.metric("turbo_gateway_stream_migrations_total", model="m", reason="disconnected") == 0
        assert gw.metric("turbo_gateway_stream_errors_total", backend="a", reason="disconnected") == 1


async def test_with_the_tokenizer_a_messages_stream_is_continued_by_token_ids(caplog):
    """Messages by token ids: the continuation's completions chunks rewritten into
    content_block_delta events, the block's stop, one message_delta with the whole
    answer's output tokens, message_stop; no [DONE]."""
    caplog.set_level(logging.INFO, logger="gateway.pipeline")
    async with fleet(faults={"a": {"close_after_chunks": CUT}}, tokenizer=str(TINY)) as (gw, urls):
        expected, _, ref = await sdk_messages(urls["b"])
        text, got, final = await sdk_messages(gw.url)
        assert text == expected and len(expected.split()) == N
        kinds = [e.type for e in got]
        assert kinds.count("message_start") == 1 and kinds.count("content_block_start") == 1
        assert kinds.count("content_block_stop") == 1 and kinds.count("message_stop") == 1
        assert kinds[-1] == "message_stop"
        assert final.stop_reason == "max_tokens" and final.usage.output_tokens == N
        assert final.usage.input_tokens == ref.usage.input_tokens
        assert (await paths(urls["b"])).get("/v1/completions") == 1
        assert any("resent as token ids)" in r.getMessage() for r in caplog.records)
        requests, _, _, completion, errors, _ = ledger(gw)
        assert (requests, completion, errors) == (1, N, 0)
    body = {"model": "m", "max_tokens": N, "stream": True, "ignore_eos": True, "messages": [MESSAGES[1]]}
    async with fleet(faults={"a": {"close_after_chunks": CUT}}, tokenizer=str(TINY)) as (gw, _):
        got = await raw(gw.url, "/v1/messages", body)
        assert got.count(b": migrated from a to b\n\n") == 1 and b"[DONE]" not in got
        assert got.endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
