"""Batch work under the tenant rules (issue 27, point 8): in-process lines pass their
owner's limits and admission, ``x-turbo-priority: batch`` only from keys granted it and
only after the caller's own limits, per-key quotas on files and batches, expiry of
files and output files, per-owner listings, bulk validation of malformed lines and a
400 for a bad ``completion_window``. Real valkey-server, scripted backends."""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from tests.integration.batch.test_batch import content_lines, jsonl, line, wait_batch
from tests.support.redis_server import redis_url
from tests.support.servers import ScriptedBackend, completion_body, gateway_config, running_gateway, wait_until

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
