"""The usage ledger (gateway/tenancy/usage_ledger.py): two replicas sharing a real valkey-server add
up exactly, a Redis outage (the server stopped and started again on its port) loses no
count, a flush whose reply was lost applies once, the buffer's bound, the admin
endpoint's filters, a key's own usage, cost from prices, batch lines and batch
``usage``. Real sockets: gateways on loopback ports, a scripted backend."""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import aiohttp
import openai
import orjson
import pytest
import redis.exceptions
from aiohttp import web

from gateway.config import Price
from gateway.ops.metrics import key_label
from gateway.tenancy.usage_ledger import HOUR_S, cost_nanos
from tests.support.redis_server import ValkeyProcess, frozen_redis, redis_url
from tests.support.servers import ScriptedBackend, gateway_config, running_gateway, sse_chunk, wait_until

KEYS = {"alpha": "sk-usage-alpha-0123456789", "beta": "sk-usage-beta-9876543210"}
ADMIN_KEY = "sk-usage-admin-000000000"
PRICES = {"m": {"input": 2.0, "cached_input": 0.5, "output": 8.0}}
# what the backend reports: a whole answer and a stream (usage in its last event)
JSON_USAGE = {"prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107,
              "prompt_tokens_details": {"cached_tokens": 40}, "completion_tokens_details": {"reasoning_tokens": 2}}
STREAM_USAGE = {"prompt_tokens": 50, "completion_tokens": 3, "total_tokens": 53}


def sha(k: str) -> str:
    return hashlib.sha256(k.encode()).hexdigest()


def bearer(k: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {k}"}


ADMIN = bearer(ADMIN_KEY)


async def answer(backend: ScriptedBackend, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    """200 with ``usage`` (JSON or a stream), or 400 when the prompt says ``fail``."""
    model = body.get("model", "m")
    if body["messages"][0]["content"] == "fail":
        return web.json_response({"error": {"message": "refused", "type": "invalid_request_error", "param": None,
                                            "code": None}}, status=400)
    if not body.get("stream"):
        return web.json_response({"id": "c", "object": "chat.completion", "created": 0, "model": model,
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                               "finish_reason": "stop"}], "usage": JSON_USAGE})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(3):
        await resp.write(sse_chunk(i, f"t{i} ", model=model))
    last = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": model, "choices": [],
            "usage": STREAM_USAGE}
    await resp.write(b"data: " + orjson.dumps(last) + b"\n\ndata: [DONE]\n\n")
    await resp.write_eof()
    return resp


def config(backend_url: str, *, url: str | None, namespace: str = "", keys: bool = True, models=("m",),
           **usage: Any):
    extra: dict[str, Any] = {"admin": {"key_sha256": sha(ADMIN_KEY)}, "usage": {"prices": PRICES, **usage}}
    if keys:
        extra["auth"] = {"keys": [{"name": n, "key_sha256": sha(k)} for n, k in KEYS.items()]}
    if url is not None:
        extra["state"] = {"url": url, "namespace": namespace or f"t{uuid.uuid4().hex[:8]}", "timeout_s": 0.2}
    return gateway_config([{"name": "b", "url": backend_url, "models": list(models)}], **extra)


async def chat(http: aiohttp.ClientSession, gw, key: str | None, *, stream: bool = False, content: str = "hi",
               model: str = "m") -> int:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": content}], "stream": stream}
    async with http.post(gw.url + "/v1/chat/completions", json=body,
                         headers=bearer(key) if key else None) as r:
        await r.read()
        return r.status


async def get(http: aiohttp.ClientSession, url: str, headers: dict | None = None, **params: Any):
    async with http.get(url, params=params, headers=headers) as r:
        return r.status, orjson.loads(await r.read())


def settled(gw) -> int:
    """Requests this gateway finished (turbo_gateway_requests_total, every label)."""
    return int(sum(s.value for fam in gw.state.metrics.registry.collect() if fam.name == "turbo_gateway_requests"
                   for s in fam.samples if s.name == "turbo_gateway_requests_total"))


def row(report: dict, key: str, model: str = "m") -> dict:
    return next(r for r in report["by_key_model"] if r["key"] == key and r["model"] == model)


def counts(r: dict) -> tuple:
    return (r["requests"], r["prompt_tokens"], r["cached_prompt_tokens"], r["completion_tokens"], r["errors"])


async def test_two_replicas_sum_exactly_with_cost_and_token_counters():
    with redis_url() as url:
        async with ScriptedBackend(handler=answer).running() as be:
            cfg = config(be.url, url=url, flush_interval_s=3600)  # flushed by the test, not by the clock
            async with running_gateway(cfg) as a, running_gateway(cfg) as b, aiohttp.ClientSession() as http:
                A, B = KEYS["alpha"], KEYS["beta"]
                sent = [chat(http, a, A) for _ in range(5)] + [chat(http, a, A, stream=True) for _ in range(3)]
                sent += [chat(http, a, B) for _ in range(2)] + [chat(http, b, A) for _ in range(4)]
                sent += [chat(http, b, B, stream=True) for _ in range(3)]
                sent += [chat(http, b, B, content="fail") for _ in range(2)]
                statuses = await asyncio.gather(*sent)
                assert statuses.count(200) == 17 and statuses.count(400) == 2
                await wait_until(lambda: settled(a) == 10 and settled(b) == 9)
                for gw in (a, b):
                    await gw.state.usage_sync.flush_once()
                    assert gw.state.usage.buffered() == 0
                status, report = await get(http, a.url + "/admin/usage", ADMIN)
                assert status == 200
                # alpha: 9 whole answers and 3 streams; beta: 2 whole, 3 streams, 2 refused by the backend
                assert counts(row(report, "alpha")) == (12, 9 * 100 + 3 * 50, 9 * 40, 9 * 7 + 3 * 3, 0)
                assert counts(row(report, "beta")) == (7, 2 * 100 + 3 * 50, 2 * 40, 2 * 7 + 3 * 3, 2)
                assert counts(report["totals"]) == (19, 1400, 440, 95, 2)
                # (uncached * 2 + cached * 0.5 + completion * 8) per million: 196e-6 whole, 124e-6 a stream
                assert row(report, "alpha")["cost"] == pytest.approx((9 * 196 + 3 * 124) / 1e6, abs=1e-12)
                assert row(report, "beta")["cost"] == pytest.approx((2 * 196 + 3 * 124) / 1e6, abs=1e-12)
                hour = int(time.time() // HOUR_S) * HOUR_S
                assert {r["hour"] for r in report["data"]} <= {hour, hour - HOUR_S}  # the test may span an hour
                assert (await get(http, b.url + "/admin/usage", ADMIN))[1]["totals"] == report["totals"]

                def tokens(kind: str, key: str) -> float:
                    return sum(gw.metric("turbo_gateway_key_tokens_total", key_name=key_label("hashed", key), model="m",
                                             kind=kind)
                               for gw in (a, b))

                assert (tokens("prompt", "alpha"), tokens("cached_prompt", "alpha"), tokens("completion", "alpha")) \
                    == (1050, 360, 72)
                assert (tokens("prompt", "beta"), tokens("completion", "beta")) == (350, 23)
                print("usage ledger excerpt:", orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())


@pytest.mark.slow
async def test_redis_outage_loses_no_count():
    server = ValkeyProcess(persistent=True)
    server.start()
    try:
        async with ScriptedBackend(handler=answer).running() as be:
            cfg = config(be.url, url=server.url, keys=False, flush_interval_s=0.05)
            async with running_gateway(cfg) as a, running_gateway(cfg) as b, aiohttp.ClientSession() as http:
                both = (a, b)
                assert all(s == 200 for s in await asyncio.gather(*(chat(http, gw, None) for gw in both * 3)))
                await wait_until(lambda: all(settled(gw) == 3 and gw.state.usage.buffered() == 0 for gw in both))
                server.stop()
                # traffic goes on without Redis: counted, buffered (the flushes fail)
                sent = [chat(http, gw, None, stream=True) for gw in both * 4] + [chat(http, a, None, content="fail")]
                statuses = await asyncio.gather(*sent)
                assert statuses.count(200) == 8 and statuses.count(400) == 1
                await wait_until(lambda: settled(a) == 8 and settled(b) == 7)
                await wait_until(lambda: all(gw.metric("turbo_gateway_usage_store_up") == 0 for gw in both))
                assert a.state.usage.buffered() >= 1 and b.state.usage.buffered() >= 1
                status, body = await get(http, a.url + "/admin/usage", ADMIN)
                assert status == 503 and body["error"]["code"] == "usage_store_unavailable"
                server.start()  # same port, same data
                await wait_until(lambda: all(gw.state.usage.buffered() == 0
                                             and gw.metric("turbo_gateway_usage_store_up") == 1 for gw in both))
                status, report = await get(http, b.url + "/admin/usage", ADMIN)
                assert status == 200
                assert counts(row(report, "anonymous")) == (15, 6 * 100 + 8 * 50, 6 * 40, 6 * 7 + 8 * 3, 1)
                assert sum(gw.metric("turbo_gateway_usage_dropped_requests_total") for gw in both) == 0
    finally:
        server.cleanup()


async def test_a_flush_whose_reply_was_lost_applies_once():
    """Redis applied a flush but its answer never came: the same flush is sent again
    (same sequence number, same counts) and the marker makes it a no-op."""
    with redis_url() as url:
        async with ScriptedBackend(handler=answer).running() as be:
            async with running_gateway(config(be.url, url=url, flush_interval_s=3600)) as gw, \
                    aiohttp.ClientSession() as http:
                assert await chat(http, gw, KEYS["alpha"]) == 200
                await wait_until(lambda: settled(gw) == 1)
                sync, ledger = gw.state.usage_sync, gw.state.usage
                buffered = {b: list(v) for b, v in ledger.pending.items()}
                await sync.flush_once()
                ledger.flushing = buffered  # as if the reply had been lost: retried as it was
                await sync.flush_once()
                assert ledger.buffered() == 0
                report = (await get(http, gw.url + "/admin/usage", ADMIN))[1]
                assert counts(report["totals"]) == (1, 100, 40, 7, 0)
                assert await chat(http, gw, KEYS["alpha"]) == 200  # the next flush is a new one, applied
                await wait_until(lambda: settled(gw) == 2)
                await sync.flush_once()
                assert counts((await get(http, gw.url + "/admin/usage", ADMIN))[1]["totals"]) == (2, 200, 80, 14, 0)


async def test_buffer_bound_drops_new_entries_and_counts_them():
    """Redis answers nothing: with room for one (key, model, hour) entry, a second
    model's request is dropped and counted; the buffered model still counts, and a
    flush that gets no answer keeps it buffered."""
    async with frozen_redis() as (url, _held):
        async with ScriptedBackend(handler=answer).running() as be:
            # flushed by the test, not by the clock: a flush between the requests would
            # move the first one's entry to ``flushing`` and the third would start another
            cfg = config(be.url, url=url, models=("m", "m2"), max_buffered_buckets=1, flush_interval_s=3600)
            async with running_gateway(cfg) as gw, aiohttp.ClientSession() as http:
                A = KEYS["alpha"]
                assert [await chat(http, gw, A), await chat(http, gw, A, model="m2"), await chat(http, gw, A)] \
                    == [200, 200, 200]
                await wait_until(lambda: settled(gw) == 3)
                with pytest.raises(redis.exceptions.TimeoutError):  # the frozen Redis never answers
                    await gw.state.usage_sync.flush_once()
                assert gw.metric("turbo_gateway_usage_dropped_requests_total") == 1
                assert gw.metric("turbo_gateway_usage_buffered_buckets") == 1
                led = gw.state.usage
                assert not led.pending  # the failed flush keeps its counts, to retry them as they are
                (entry, v), = led.flushing.items()
                assert entry[:2] == ("alpha", "m") and v[0] == 2


async def test_admin_filters_and_a_key_sees_only_its_own_usage():
    with redis_url() as url:
        async with ScriptedBackend(handler=answer).running() as be:
            cfg = config(be.url, url=url, models=("m", "m2"), flush_interval_s=3600)
            async with running_gateway(cfg) as gw, aiohttp.ClientSession() as http:
                A, B = KEYS["alpha"], KEYS["beta"]
                h = int(time.time() // HOUR_S)
                h1, h2 = h - 3, h - 2
                clock = [h1 * HOUR_S + 10.0]
                gw.state.usage.clock = lambda: clock[0]  # the ledger's hour, chosen by the test
                assert [await chat(http, gw, A), await chat(http, gw, A)] == [200, 200]
                clock[0] = h2 * HOUR_S + 10.0
                assert [await chat(http, gw, A, model="m2"), await chat(http, gw, B)] == [200, 200]
                await wait_until(lambda: settled(gw) == 4)
                await gw.state.usage_sync.flush_once()
                admin = gw.url + "/admin/usage"

                async def requests(**params: Any) -> dict[tuple[str, str, int], int]:
                    status, report = await get(http, admin, ADMIN, **params)
                    assert status == 200, report
                    return {(r["key"], r["model"], r["hour"] // HOUR_S): r["requests"] for r in report["data"]}

                every = {("alpha", "m", h1): 2, ("alpha", "m2", h2): 1, ("beta", "m", h2): 1}
                assert await requests() == every  # default: the last 24 hours
                assert await requests(key="alpha") == {k: v for k, v in every.items() if k[0] == "alpha"}
                assert await requests(key="alpha", model="m2") == {("alpha", "m2", h2): 1}
                assert await requests(model="m") == {("alpha", "m", h1): 2, ("beta", "m", h2): 1}
                assert await requests(since=h2 * HOUR_S) == {("alpha", "m2", h2): 1, ("beta", "m", h2): 1}
                assert await requests(until=h2 * HOUR_S) == {("alpha", "m", h1): 2}  # until is exclusive
                iso = datetime.fromtimestamp(h2 * HOUR_S + 1800, UTC).isoformat()
                assert await requests(since=iso) == await requests(since=h2 * HOUR_S)  # rounded down to its hour
                assert await requests(since=(h - 100) * HOUR_S, until=(h - 50) * HOUR_S) == {}
                assert await requests(key="nobody") == {}
                for bad in ({"since": "yesterday"}, {"since": h2 * HOUR_S, "until": h1 * HOUR_S},
                            {"until": "-5"}, {"since": "nan"}):
                    status, body = await get(http, admin, ADMIN, **bad)
                    assert status == 400 and body["error"]["param"] in ("since", "until"), bad
                async with http.get(admin + "?model=m&model=m2", headers=ADMIN) as r:  # one model per request
                    body = orjson.loads(await r.read())
                    assert r.status == 400 and body["error"]["param"] == "model"
                assert (await get(http, admin))[0] == 401
                assert (await get(http, admin, bearer(A)))[0] == 401  # a client key is not the admin key
                # a key's own usage
                own = gw.url + "/v1/usage"
                status, mine = await get(http, own, bearer(A))
                assert status == 200 and {r["key"] for r in mine["data"]} == {"alpha"}
                assert counts(mine["totals"]) == (3, 300, 120, 21, 0)
                status, mine = await get(http, own, bearer(A), model="m2")
                assert counts(mine["totals"]) == (1, 100, 40, 7, 0)
                status, theirs = await get(http, own, bearer(B))
                assert counts(theirs["totals"]) == (1, 100, 40, 7, 0) and row(theirs, "beta")
                status, body = await get(http, own, bearer(A), key="beta")
                assert status == 403 and body["error"]["code"] == "permission_denied"
                assert (await get(http, own, bearer(A), key="alpha"))[0] == 200
                assert (await get(http, own))[0] == 401
                assert (await get(http, own, ADMIN))[0] == 401


async def test_in_process_ledger_without_redis_counts_anonymous_callers():
    async with ScriptedBackend(handler=answer).running() as be:
        async with running_gateway(config(be.url, url=None, keys=False)) as gw, aiohttp.ClientSession() as http:
            assert gw.state.usage_sync is None
            assert [await chat(http, gw, None), await chat(http, gw, None, stream=True)] == [200, 200]
            await wait_until(lambda: settled(gw) == 2)
            status, report = await get(http, gw.url + "/admin/usage", ADMIN)
            assert status == 200 and counts(row(report, "anonymous")) == (2, 150, 40, 10, 0)
            assert report["totals"]["cost"] == pytest.approx((196 + 124) / 1e6, abs=1e-12)
            assert (await get(http, gw.url + "/v1/usage"))[1]["totals"] == report["totals"]


def test_cost_from_prices():
    p = Price(input=3.0, output=15.0)  # no cached_input price: cached tokens at the input price
    assert cost_nanos(p, 1_000_000, 250_000, 2_000_000) == 33_000_000_000  # 3 + 30 currency units
    q = Price(input=1.25, cached_input=0.125, output=10.0)
    assert cost_nanos(q, 1000, 600, 10) == round((400 * 1.25 + 600 * 0.125 + 10 * 10.0) * 1000)
    assert cost_nanos(None, 1000, 0, 10) == 0


def test_prices_for_an_unserved_model_are_a_config_error():
    from gateway.config import ConfigError

    with pytest.raises(ConfigError, match=r"usage.prices: no backend serves 'gpt-x'"):
        gateway_config([{"name": "b", "url": "http://127.0.0.1:1", "models": ["m"]}],
                       usage={"prices": {"gpt-x": {"input": 1, "output": 2}}})
    with pytest.raises(ConfigError, match=r"usage.prices.m.input"):
        gateway_config([{"name": "b", "url": "http://127.0.0.1:1", "models": ["m"]}],
                       usage={"prices": {"m": {"input": -1, "output": 2}}})


async def test_batch_lines_count_under_the_owner_and_fill_the_batch_usage(tmp_path):
    from tests.integration.batch.test_batch import CLIENT_KEYS, admin_batch_config, jsonl, line, submit, wait_batch

    with redis_url() as url:
        async with ScriptedBackend(handler=answer).running() as be:
            cfg = admin_batch_config([{"name": "b", "url": be.url, "models": ["demo-model"]}], url, tmp_path,
                                     workers=4)
            async with running_gateway(cfg) as gw, aiohttp.ClientSession() as http:
                alice = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=CLIENT_KEYS["alice"], max_retries=0)
                b = await submit(alice, jsonl([line(i) for i in range(3)] + [line(3, "fail")]))
                b = await wait_batch(alice, b.id, {"completed"})
                assert (b.request_counts.completed, b.request_counts.failed) == (3, 1)
                u = b.usage  # three answered lines' usage; the refused one has none
                assert (u.input_tokens, u.input_tokens_details.cached_tokens, u.output_tokens,
                        u.output_tokens_details.reasoning_tokens, u.total_tokens) == (300, 120, 21, 6, 321)
                await wait_until(lambda: settled(gw) == 4)
                status, mine = await get(http, gw.url + "/v1/usage", bearer(CLIENT_KEYS["alice"]))
                assert status == 200
                assert counts(row(mine, "alice", "demo-model")) == (4, 300, 120, 21, 1)
                await alice.close()


async def test_a_usage_query_reads_at_most_max_query_hours():
    import redis.asyncio as aioredis

    async with ScriptedBackend(handler=answer).running() as be:
        with redis_url() as url:
            r = aioredis.from_url(url)
            async with running_gateway(config(be.url, url=url)) as gw, \
                    aiohttp.ClientSession() as http:
                before = int((await r.info("commandstats")).get("cmdstat_hgetall", {}).get("calls", 0))
                status, report = await get(http, gw.url + "/v1/usage", bearer(KEYS["alpha"]), since=0)
                read = int((await r.info("commandstats")).get("cmdstat_hgetall", {}).get("calls", 0)) - before
                assert status == 200, report
                # usage.max_query_hours (31 days), not the 90 days of retention; the answer says where it started
                assert report["until"] - report["since"] == 744 * HOUR_S
                assert read < 800, read  # 744 hours and the background loops' own reads (2160 unbounded)
            await r.aclose()
