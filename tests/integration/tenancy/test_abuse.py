"""The abuse test (issue 27): every hostile caller of the threat model at once, while
honest clients are served.

One gateway (on the lean protocol, and with ``listen.fast_path: false``) in front of a
scripted engine, with two keys and the usage ledger in a real valkey-server. At the same
time, all on 127.0.0.1 and each loop bounded:

- connections trickle heads and bodies a byte at a time;
- unauthenticated requests announce bodies of tens of MiB;
- a key sends concurrent streams that all carry one ``x-request-id``;
- that key sends engine-control fields (``kv_transfer_params``, ``priority``, ``rid``);
- that key reads a few events of slow streams and disconnects before the usage chunk;
- an honest key sends streamed and whole completions with the openai SDK.

Afterwards: every honest request was answered in full and is in the ledger exactly as
the engine counted it; no engine saw two running requests with one id, a caller's
engine-control field or a caller's key; the unauthenticated bodies were refused on
their heads; the trickling connections were cut; the disconnecting streams were charged
their prompt and the tokens relayed; no backend's breaker heard of any of it."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from tests.integration.tenancy.test_usage import ADMIN, ADMIN_KEY, counts, get, row
from tests.support.redis_server import redis_url
from tests.support.servers import ScriptedBackend, gateway_config, running_gateway, sse_chunk, wait_until
from tests.support.slow_clients import trickles

HONEST, MALLORY = "sk-abuse-honest-0123456789", "sk-abuse-mallory-012345678"
PROMPT, COMPLETION = 30, 5  # what the engine reports for every answer it completes
USAGE = {"prompt_tokens": PROMPT, "completion_tokens": COMPLETION, "total_tokens": PROMPT + COMPLETION}
SLOW_EVENTS = 40  # a "leave" stream: this many events, EVENT_GAP_S apart, usage last
EVENT_GAP_S = 0.05
READ_BEFORE_LEAVING = 3
N_HONEST, N_DUPLICATES, N_LEAVERS, N_BIG_BODIES = 24, 12, 6, 40
ENGINE_FIELDS = {"kv_transfer_params": {"remote_host": "10.0.0.9", "remote_port": 1},
                 "priority": -100, "rid": "someone-elses-request"}


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Engine:
    """The scripted engine's handler: whole answers and streams with ``usage`` (a
    stream's usage chunk only when asked for, as vLLM sends it); a prompt ``leave``
    streams slowly. Records each upstream request id it ran and any id that arrived
    while a request with that id was still running."""

    def __init__(self) -> None:
        self.running: set[str] = set()
        self.ids: list[str] = []
        self.clashes: list[str] = []

    async def __call__(self, backend: ScriptedBackend, request: web.Request,
                       body: dict[str, Any]) -> web.StreamResponse:
        rid = request.headers.get("x-request-id", "")
        self.ids.append(rid)
        if rid in self.running:
            self.clashes.append(rid)
        self.running.add(rid)
        try:
            return await self._answer(request, body)
        finally:
            self.running.discard(rid)

    async def _answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if not body.get("stream"):
            return web.json_response({"id": "c", "object": "chat.completion", "created": 0, "model": "m",
                                      "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                                   "finish_reason": "stop"}], "usage": USAGE})
        slow = body["messages"][0]["content"] == "leave"
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(SLOW_EVENTS if slow else COMPLETION):
            await resp.write(sse_chunk(i, f"t{i} "))
            if slow:
                await asyncio.sleep(EVENT_GAP_S)
        if (body.get("stream_options") or {}).get("include_usage"):
            last = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [],
                    "usage": USAGE}
            await resp.write(b"data: " + orjson.dumps(last) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _config(url: str, redis: str, fast_path: bool) -> Any:
    keys = [{"name": "honest", "key_sha256": _sha(HONEST), "tokens_per_minute": 10_000_000},
            {"name": "mallory", "key_sha256": _sha(MALLORY), "tokens_per_minute": 10_000_000}]
    return gateway_config([{"name": "b", "url": url, "models": ["m"]}], retries={"max_attempts": 1},
                          listen={"fast_path": fast_path, "head_timeout_s": 1.0, "body_timeout_s": 1.0,
                                  "body_min_bytes_per_s": 1_000_000, "max_connections_per_address": 250},
                          limits={"max_body_bytes": 64 * 1024 * 1024},
                          breaker={"failure_threshold": 1}, auth={"keys": keys},
                          admin={"key_sha256": _sha(ADMIN_KEY)},
                          usage={"flush_interval_s": 3600},
                          state={"url": redis, "namespace": f"abuse{int(fast_path)}", "timeout_s": 0.5})


async def _big_unauthenticated_body(port: int, path: str) -> bytes:
    """Announce a 48 MiB body without a valid key; returns what the gateway answered
    before it closed the connection, without waiting for the body (bounded wait)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"POST {path} HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer sk-guess\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {48 << 20}\r\n\r\n".encode())
        try:
            return await asyncio.wait_for(reader.read(-1), 20)
        except (TimeoutError, ConnectionError):
            return b""
    finally:
        writer.close()


async def _leave_early(client: openai.AsyncOpenAI) -> int:
    """A streamed request read for a few events, then closed; returns events read."""
    stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "leave"}],
                                                  stream=True, max_tokens=500)
    got = 0
    async for c in stream:
        assert c.choices and c.choices[0].delta.content == f"t{got} "
        got += 1
        if got == READ_BEFORE_LEAVING:
            break
    await stream.close()
    return got


async def _duplicate_id(http: aiohttp.ClientSession, url: str) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "dup"}], "stream": True}
    async with http.post(url + "/v1/chat/completions", json=body,
                         headers={"Authorization": f"Bearer {MALLORY}", "x-request-id": "dup-1"}) as r:
        assert r.status == 200 and r.headers["x-request-id"] == "dup-1"
        return await r.read()


async def _engine_field(http: aiohttp.ClientSession, url: str, field: str) -> tuple[int, dict]:
    body = {"model": "m", "messages": [{"role": "user", "content": "steer"}], field: ENGINE_FIELDS[field]}
    async with http.post(url + "/v1/chat/completions", json=body,
                         headers={"Authorization": f"Bearer {MALLORY}"}) as r:
        return r.status, orjson.loads(await r.read())


async def _honest(client: openai.AsyncOpenAI, i: int) -> str:
    """One honest request: streamed (half of them asking for usage) or whole."""
    messages = [{"role": "user", "content": "hi"}]
    if i % 3 == 2:
        r = await client.chat.completions.create(model="m", messages=messages)
        assert r.usage is not None and r.usage.completion_tokens == COMPLETION
        return r.choices[0].message.content or ""
    ask = i % 3 == 1
    stream = await client.chat.completions.create(model="m", messages=messages, stream=True,
                                                  stream_options={"include_usage": True} if ask else None)
    text, usage = "", None
    async for c in stream:
        if c.choices:
            text += c.choices[0].delta.content or ""
        else:
            usage = c.usage
    assert (usage is not None and usage.prompt_tokens == PROMPT) == ask  # the usage chunk only when asked
    return text


@pytest.mark.parametrize("fast_path", [True, False])
async def test_hostile_callers_at_once_leave_honest_clients_served_and_nothing_lost(fast_path):
    engine = Engine()
    be = ScriptedBackend(handler=engine)
    with redis_url() as redis:
        async with be.running(), running_gateway(_config(be.url, redis, fast_path)) as gw, \
                aiohttp.ClientSession() as http:
            port = int(gw.url.rsplit(":", 1)[1])
            connected: list[int] = []
            tricklers = [asyncio.ensure_future(t) for t in trickles(port, connected)]
            while len(connected) < len(tricklers):
                await asyncio.sleep(0.01)
            mallory = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=MALLORY, max_retries=0)
            honest = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=HONEST)
            try:
                hostile = asyncio.gather(
                    *[_big_unauthenticated_body(port, p) for p in ("/v1/chat/completions", "/v1/files")
                      for _ in range(N_BIG_BODIES // 2)],
                    *[_duplicate_id(http, gw.url) for _ in range(N_DUPLICATES)],
                    *[_engine_field(http, gw.url, f) for f in ENGINE_FIELDS],
                    *[_leave_early(mallory) for _ in range(N_LEAVERS)])
                answers = []
                for i in range(N_HONEST):  # a few at a time, while the hostile callers run
                    answers += await asyncio.gather(*(_honest(honest, 3 * i + j) for j in range(3)))
                got = await hostile
                cut = [await t for t in tricklers]
            finally:
                for t in tricklers:
                    t.cancel()

            big = got[:N_BIG_BODIES]
            duplicates = got[N_BIG_BODIES:N_BIG_BODIES + N_DUPLICATES]
            fields = got[N_BIG_BODIES + N_DUPLICATES:N_BIG_BODIES + N_DUPLICATES + len(ENGINE_FIELDS)]
            left = got[N_BIG_BODIES + N_DUPLICATES + len(ENGINE_FIELDS):]

            # honest clients: every answer whole
            assert answers == [("ok" if i % 3 == 2 else "".join(f"t{k} " for k in range(COMPLETION)))
                               for i in range(3 * N_HONEST)]
            # the unauthenticated bodies: refused on their heads
            assert [b[:13] for b in big] == [b"HTTP/1.1 401 "] * N_BIG_BODIES
            # the trickling connections: cut by the deadlines and the per-address cap
            assert all(cut), f"{cut.count(False)} of {len(cut)} trickling connections outlived the deadlines"
            # one caller id on concurrent requests: each attempt its own id, never two running at once
            want = b"".join(sse_chunk(k, f"t{k} ") for k in range(COMPLETION)) + b"data: [DONE]\n\n"
            assert duplicates == [want] * N_DUPLICATES
            dup_ids = [i for i in engine.ids if i.startswith("dup-1")]
            assert len(dup_ids) == N_DUPLICATES == len(set(dup_ids)) and "dup-1" not in dup_ids
            assert engine.clashes == []
            # engine-control fields: a 400 naming the field, and no engine saw one
            for field, (status, err) in zip(ENGINE_FIELDS, fields, strict=True):
                assert status == 400 and err["error"]["param"] == field, err
            for raw in be.bodies:
                assert not set(orjson.loads(raw)) & set(ENGINE_FIELDS), raw
            assert all(h.get("Authorization") in (None, "") for h in be.headers), "a caller's key reached the engine"
            assert left == [READ_BEFORE_LEAVING] * N_LEAVERS

            # nothing lost: every request that reached the engine settles once, in the ledger
            n_engine = 3 * N_HONEST + N_DUPLICATES + N_LEAVERS
            await wait_until(lambda: len(be.bodies) == n_engine and not engine.running, timeout_s=30)
            await gw.state.usage_sync.flush_once()
            status, report = await get(http, gw.url + "/admin/usage", ADMIN)
            assert status == 200, report
            assert counts(row(report, "honest")) == (3 * N_HONEST, 3 * N_HONEST * PROMPT, 0,
                                                     3 * N_HONEST * COMPLETION, 0)
            # mallory: the duplicate-id streams as the engine counted them (usage asked for
            # on its behalf); each stream it left charged its prompt (the gateway's estimate,
            # learned from usage as it comes, so at least a token) and the events relayed (at
            # least those it read; the engine may have sent a few more before the cut)
            m_requests, m_prompt, _, m_completion, m_errors = counts(row(report, "mallory"))
            assert (m_requests, m_errors) == (N_DUPLICATES + N_LEAVERS, N_LEAVERS)
            assert m_prompt >= N_DUPLICATES * PROMPT + N_LEAVERS
            assert N_LEAVERS * READ_BEFORE_LEAVING <= m_completion - N_DUPLICATES * COMPLETION < N_LEAVERS * SLOW_EVENTS
            # and no backend's breaker heard of any of it
            backend = gw.state.fleet.backends["b"]
            assert backend.breaker.state == "closed" and backend.breaker.opened_total == 0
