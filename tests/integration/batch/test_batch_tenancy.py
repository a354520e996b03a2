"""Batch work under the tenant rules (issue 27, point 8): in-process lines pass their
owner's limits and admission, ``x-turbo-priority: batch`` only from keys granted it and
only after the caller's own limits, per-key quotas on files and batches, expiry of
files and output files, per-owner listings, bulk validation of malformed lines and a
400 for a bad ``completion_window``. Real valkey-server, scripted backends."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from tests.integration.batch.test_batch import content_lines, jsonl, line, wait_batch
from tests.support.redis_server import redis_url
from tests.support.servers import (
    ScriptedBackend,
    completion_body,
    gateway_config,
    running_gateway,
)

KEYS = {"alice": "sk-alice-tenancy", "bob": "sk-bob-tenancy", "consumer": "sk-consumer-tenancy"}


@pytest.fixture(scope="module")
def redis():
    with redis_url() as url:
        yield url


def _sha(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


def tenancy_config(backend_url: str, redis: str, tmp_path: Path, *, keys: dict[str, dict[str, Any]] | None = None,
                   **batch: Any):
    """Client keys ``KEYS`` (each with its entry of ``keys`` merged in), the Batch API
    on ``redis``, one backend serving ``demo-model``."""
    keys = keys or {}
    return gateway_config([{"name": "b", "url": backend_url, "models": ["demo-model"]}],
                          state={"namespace": f"t{uuid.uuid4().hex[:8]}"},
                          auth={"keys": [{"name": n, "key_sha256": _sha(k), **keys.get(n, {})}
                                         for n, k in KEYS.items()]},
                          batch={"enabled": True, "redis_url": redis, "files_dir": str(tmp_path / "files"),
                                 "base_backoff_s": 0.01, "max_backoff_s": 0.05, **batch})


def client(gw, name: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEYS[name], max_retries=0)


class ConcurrencyBackend:
    """Answers each completion after ``hold_s``, counting the requests it holds at once."""

    def __init__(self, hold_s: float = 0.05) -> None:
        self.hold_s = hold_s
        self.now = 0
        self.peak = 0
        self.served = 0

    async def __call__(self, backend: ScriptedBackend, request: web.Request, body: dict[str, Any]):
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            await asyncio.sleep(self.hold_s)
        finally:
            self.now -= 1
        self.served += 1
        return web.json_response(completion_body(model=body.get("model", "m")))


async def test_in_process_batch_lines_pass_their_owners_limits(redis, tmp_path):
    counter = ConcurrencyBackend()
    async with ScriptedBackend(handler=counter).running() as be:
        cfg = tenancy_config(be.url, redis, tmp_path, keys={"alice": {"max_concurrent": 1}}, workers=8)
        async with running_gateway(cfg) as gw, client(gw, "alice") as alice:
            f = await alice.files.create(file=("in.jsonl", jsonl([line(i) for i in range(6)])), purpose="batch")
            b = await alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                           completion_window="24h")
            done = await wait_batch(alice, b.id, {"completed", "failed"})
            assert done.status == "completed" and done.request_counts.completed == 6, done
            # eight consumers, but alice's key holds one request at a time: the others waited
            assert counter.peak == 1 and counter.served == 6
            assert gw.state.limiter.rejected.get(("alice", "concurrent"), 0) > 0
            assert gw.state.batch_gate.admitted_total >= 6  # and each line passed the batch gate


async def test_batch_priority_header_only_from_keys_granted_it_and_after_their_limits(redis, tmp_path):
    async with ScriptedBackend().running() as be:
        cfg = tenancy_config(be.url, redis, tmp_path, keys={"consumer": {"batch_priority": True,
                                                                         "requests_per_minute": 1}}, workers=0)
        async with running_gateway(cfg) as gw, aiohttp.ClientSession() as http:
            gate = gw.state.batch_gate
            body = {"model": "demo-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

            async def post(name: str) -> int:
                async with http.post(gw.url + "/v1/chat/completions", json=body,
                                     headers={"Authorization": f"Bearer {KEYS[name]}",
                                              "x-turbo-priority": "batch"}) as r:
                    await r.read()
                    return r.status

            assert await post("alice") == 200
            assert gate.admitted_total == 0  # alice was not granted the batch class: served as interactive
            assert await post("consumer") == 200
            assert gate.admitted_total == 1
            assert await post("consumer") == 429  # over its own limit: refused before the gate
            assert gate.admitted_total == 1 and gate.in_flight == 0


@pytest.mark.parametrize("window", ["infh", "nanh", "-1h", "0s", "1e400d", "31d"])
async def test_a_bad_completion_window_is_a_400(redis, tmp_path, window):
    async with ScriptedBackend().running() as be:
        cfg = tenancy_config(be.url, redis, tmp_path)
        async with running_gateway(cfg) as gw, client(gw, "alice") as alice:
            f = await alice.files.create(file=("in.jsonl", jsonl([line(0)])), purpose="batch")
            with pytest.raises(openai.BadRequestError) as e:
                await alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                           completion_window=window)  # type: ignore[arg-type]
            assert e.value.body["param"] == "completion_window"


async def _script_calls(r: aioredis.Redis) -> int:
    stats = await r.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "eval"))


async def test_malformed_lines_are_recorded_in_bulk(redis, tmp_path):
    async with ScriptedBackend().running() as be:
        cfg = tenancy_config(be.url, redis, tmp_path, workers=1)
        r = aioredis.from_url(redis)
        async with running_gateway(cfg) as gw, client(gw, "alice") as alice:
            data = jsonl([b"{not json" for _ in range(1500)] + [line(0)])
            f = await alice.files.create(file=("in.jsonl", data), purpose="batch")
            before = await _script_calls(r)
            b = await alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                           completion_window="24h")
            done = await wait_batch(alice, b.id, {"completed", "failed"})
            calls = await _script_calls(r) - before
            assert done.request_counts.failed == 1500 and done.request_counts.completed == 1, done
            errors = await content_lines(alice, done.error_file_id)
            assert len(errors) == 1500 and all(e["error"]["code"] == "invalid_request" for e in errors)
            # a handful of script calls (start, two bulk records, the valid line's result), not one per line
            assert calls < 20, calls
        await r.aclose()


async def test_per_key_quotas_on_files_and_batches(redis, tmp_path):
    async with ScriptedBackend().running() as be:
        cfg = tenancy_config(be.url, redis, tmp_path, workers=0, max_files_per_key=2, max_bytes_per_key=1000,
                             max_active_batches_per_key=1)
        async with running_gateway(cfg) as gw, client(gw, "alice") as alice, client(gw, "bob") as bob:
            small = jsonl([line(0)])
            f1 = await alice.files.create(file=("a.jsonl", small), purpose="batch")
            f2 = await alice.files.create(file=("b.jsonl", small), purpose="batch")
            with pytest.raises(openai.RateLimitError) as e:  # a third file
                await alice.files.create(file=("c.jsonl", small), purpose="batch")
            assert e.value.body["code"] == "quota_exceeded"
            assert e.value.response.headers["x-should-retry"] == "false"
            await bob.files.create(file=("b.jsonl", small), purpose="batch")  # bob's quota is his own
            await alice.files.delete(f2.id)  # deleting gives the room back
            f3 = await alice.files.create(file=("c.jsonl", small), purpose="batch")
            await alice.files.delete(f3.id)
            with pytest.raises(openai.RateLimitError) as e:  # bytes: 1000 in all, one file holds some
                await alice.files.create(file=("big.jsonl", b"x" * 1000), purpose="batch")
            assert e.value.body["code"] == "quota_exceeded"
            # unfinished batches: one at a time (no consumer: the first stays open)
            b1 = await alice.batches.create(input_file_id=f1.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
            with pytest.raises(openai.RateLimitError) as e:
                await alice.batches.create(input_file_id=f1.id, endpoint="/v1/chat/completions",
                                           completion_window="24h")
            assert e.value.body["code"] == "quota_exceeded"
            await alice.batches.cancel(b1.id)
            await wait_batch(alice, b1.id, {"cancelled"})
            await alice.batches.create(input_file_id=f1.id, endpoint="/v1/chat/completions",
                                       completion_window="24h")


async def test_files_and_output_files_expire(redis, tmp_path):
    from gateway.batch.api import BATCH

    async with ScriptedBackend().running() as be:
        cfg = tenancy_config(be.url, redis, tmp_path, workers=2)
        async with running_gateway(cfg) as gw, client(gw, "alice") as alice:
            store = gw.app[BATCH].store
            f = await alice.files.create(file=("in.jsonl", jsonl([line(0)])), purpose="batch")
            assert f.expires_at == f.created_at + 30 * 86400  # purpose batch: OpenAI's 30 days
            kept = await alice.files.create(file=("notes.jsonl", b"{}\n"), purpose="user")
            assert kept.expires_at is None  # other purposes are kept until deleted
            short = await alice.files.create(file=("s.jsonl", b"{}\n"), purpose="user",
                                             expires_after={"anchor": "created_at", "seconds": 3600})
            assert short.expires_at == short.created_at + 3600
            with pytest.raises(openai.BadRequestError):
                await alice.files.create(file=("s.jsonl", b"{}\n"), purpose="user",
                                         expires_after={"anchor": "created_at", "seconds": 60})
            b = await alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                           completion_window="24h",
                                           output_expires_after={"anchor": "created_at", "seconds": 7200})
            done = await wait_batch(alice, b.id, {"completed"})
            out = await alice.files.retrieve(done.output_file_id)
            assert out.expires_at == out.created_at + 7200
            # the hour passes: move the file's expiry to the past, as the clock would
            await store.r.zadd(store.p + "files:exp", {short.id: 1})
            assert store.path(short.id).exists()

            async def gone() -> bool:
                try:
                    await alice.files.retrieve(short.id)
                except openai.NotFoundError:
                    return True
                return False

            deadline = asyncio.get_running_loop().time() + 10
            while not await gone():
                assert asyncio.get_running_loop().time() < deadline, "the expired file was never deleted"
                await asyncio.sleep(0.05)
            assert not store.path(short.id).exists()
            assert (await alice.files.retrieve(kept.id)).id == kept.id
            files, _ = await store.quota_used("alice")
            assert files == 3  # input, kept, output: the expired one gave its room back


async def _hmget_fields(r: aioredis.Redis, key: str) -> int:
    """Fields asked by the HMGETs of ``key`` in the slow log (every command is logged)."""
    n = 0
    for entry in await r.slowlog_get(10000):
        cmd = entry["command"].decode() if isinstance(entry["command"], bytes) else entry["command"]
        parts = cmd.split(" ")
        if parts[0].upper() != "HMGET" or parts[1] != key:
            continue
        n += len(parts) - 2
        if cmd.endswith("more arguments)"):  # the slow log keeps 32 arguments and counts the rest
            n += int(parts[-3].lstrip("(")) - 1
    return n


async def test_a_keys_listing_reads_its_own_records_only(redis, tmp_path):
    from gateway.batch.api import BATCH

    async with ScriptedBackend().running() as be:
        cfg = tenancy_config(be.url, redis, tmp_path, workers=0)
        r = aioredis.from_url(redis)
        async with running_gateway(cfg) as gw, client(gw, "alice") as alice, client(gw, "bob") as bob:
            store = gw.app[BATCH].store
            for i in range(60):
                await bob.files.create(file=(f"{i}.jsonl", b"{}\n"), purpose="user")
            mine = await alice.files.create(file=("a.jsonl", b"{}\n"), purpose="user")
            await r.config_set("slowlog-log-slower-than", 0)
            await r.config_set("slowlog-max-len", 10000)
            await r.slowlog_reset()
            try:
                listed = await alice.files.list()
                read = await _hmget_fields(r, store.p + "files")
            finally:
                await r.config_set("slowlog-log-slower-than", 10000)
                await r.slowlog_reset()
            assert [x.id for x in listed.data] == [mine.id]
            assert read == 1, read  # her one record, not bob's sixty
        await r.aclose()
