"""Batch API and queue consumers (gateway/batch/): the openai SDK end to end, crash
safety with a SIGKILLed consumer, retries and the error file, cancel, expiry, malformed
lines, the local ``run`` mode and the admission gate. Real valkey-server, simulated or
scripted backends on loopback ports."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest
import redis.asyncio as aioredis
import yaml
from aiohttp import web

from gateway.batch.api import BATCH
from gateway.config import ConfigError, parse_config
from loadtest.sim.server import SimBackendConfig, start_backends
from tests.redis_server import redis_url
from tests.servers import ScriptedBackend, completion_body, gateway_config, running_gateway, wait_until


@pytest.fixture(scope="module")
def redis():
    with redis_url() as url:
        yield url


def batch_config(backends: list[dict[str, Any]], redis: str, tmp_path: Path, **batch: Any):
    return gateway_config(backends, state={"namespace": f"t{uuid.uuid4().hex[:8]}"},
                          batch={"enabled": True, "redis_url": redis, "files_dir": str(tmp_path / "files"),
                                 "base_backoff_s": 0.01, "max_backoff_s": 0.05, **batch})


def line(i: int | str, content: str = "Say something.", max_tokens: int = 4, model: str = "demo-model") -> bytes:
    return orjson.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": model, "messages": [{"role": "user", "content": content}],
                                  "max_tokens": max_tokens}})


def jsonl(lines: list[bytes]) -> bytes:
    return b"\n".join(lines) + b"\n"


async def sim_fleet(n: int = 2, speed: float = 20.0):
    return await start_backends([SimBackendConfig(name=f"sim-{i}", models=["demo-model"], profile="demo", speed=speed)
                                 for i in range(n)])


async def wait_batch(client: openai.AsyncOpenAI, bid: str, statuses: set[str], timeout_s: float = 30.0):
    out = {}

    async def poll() -> bool:
        out["b"] = await client.batches.retrieve(bid)
        return out["b"].status in statuses

    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await poll():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"batch {bid} stuck in {out['b'].status}: {out['b'].request_counts}")
        await asyncio.sleep(0.05)
    return out["b"]


async def submit(client: openai.AsyncOpenAI, data: bytes, window: str = "24h"):
    f = await client.files.create(file=("input.jsonl", data), purpose="batch")
    assert f.purpose == "batch" and f.bytes == len(data) and f.id.startswith("file-")
    return await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window=window,
                                       metadata={"job": "test"})


async def content_lines(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    data = (await client.files.content(file_id)).content
    return [orjson.loads(x) for x in data.splitlines()]


def sdk(gw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)


async def test_sdk_batch_of_200_lines(redis, tmp_path):
    backends, urls = await sim_fleet()
    cfg = batch_config([{"name": n, "url": u, "models": ["demo-model"]} for n, u in urls.items()], redis, tmp_path,
                       workers=16)
    try:
        async with running_gateway(cfg) as gw, sdk(gw) as client:
            b = await submit(client, jsonl([line(i) for i in range(200)]))
            assert b.status == "validating" and b.endpoint == "/v1/chat/completions" and b.metadata == {"job": "test"}
            seen_progress = set()

            async def progressed() -> bool:
                r = await client.batches.retrieve(b.id)
                seen_progress.add(r.request_counts.completed)
                return r.status == "completed"

            while not await progressed():
                await asyncio.sleep(0.02)
            done = await client.batches.retrieve(b.id)
            assert done.request_counts.total == 200 and done.request_counts.completed == 200
            assert done.request_counts.failed == 0 and done.error_file_id is None
            assert done.in_progress_at and done.finalizing_at and done.completed_at
            assert len(seen_progress) > 2  # request_counts moved while it ran
            out = await content_lines(client, done.output_file_id)
            assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(200))
            for o in out:
                assert o["id"].startswith("batch_req_") and o["error"] is None
                assert o["response"]["status_code"] == 200 and o["response"]["request_id"]
                assert len(o["response"]["body"]["choices"][0]["message"]["content"].split()) == 4
            listed = await client.batches.list(limit=10)
            assert b.id in [x.id for x in listed.data]
            meta = await client.files.retrieve(done.output_file_id)
            assert meta.purpose == "batch_output"
            assert gw.app[BATCH].gate.admitted_total >= 200  # every line passed the batch admission gate
            assert all(gw.idle(n) for n in urls)
    finally:
        for be in backends:
            await be.cleanup()


async def test_failures_and_timeouts_are_retried_then_go_to_the_error_file(redis, tmp_path):
    seen: dict[str, int] = {}

    async def handler(backend, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        text = body["messages"][0]["content"]
        seen[text] = seen.get(text, 0) + 1
        if text.startswith("fail"):
            return web.json_response({"error": {"message": "engine overloaded", "type": "server_error",
                                                "param": None, "code": "overloaded"}}, status=503)
        if text.startswith("flaky") and seen[text] < 3:
            return web.json_response({"error": {"message": "try again", "type": "server_error"}}, status=502)
        if text.startswith("slow"):
            await asyncio.sleep(60)
        return web.json_response(completion_body("ok", model="demo-model"))

    async with ScriptedBackend(handler=handler).running() as be:
        cfg = batch_config([{"name": "b", "url": be.url, "models": ["demo-model"]}], redis, tmp_path, workers=8,
                           request_timeout_s=1.0, max_attempts=3)
        # one gateway attempt per batch attempt, and no circuit breaker ejecting the only
        # backend (this test is about the batch retry policy, not the gateway's)
        update: dict[str, Any] = {"retries": cfg.retries.model_copy(update={"max_attempts": 1})}
        if "breaker" in type(cfg).model_fields:
            update["breaker"] = cfg.breaker.model_copy(update={"failure_threshold": 0})
        cfg = cfg.model_copy(update=update)
        lines = ([line(i, f"ok {i}") for i in range(6)] + [line("fail-a", "fail a"), line("fail-b", "fail b")]
                 + [line("flaky", "flaky x"), line("slow", "slow x")])
        async with running_gateway(cfg) as gw, sdk(gw) as client:
            b = await submit(client, jsonl(lines))
            done = await wait_batch(client, b.id, {"completed"})
            assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (10, 7, 3)
            out = {o["custom_id"]: o for o in await content_lines(client, done.output_file_id)}
            errs = {o["custom_id"]: o for o in await content_lines(client, done.error_file_id)}
            assert set(out) == {f"req-{i}" for i in range(6)} | {"req-flaky"}
            assert set(errs) == {"req-fail-a", "req-fail-b", "req-slow"}
            for k in ("req-fail-a", "req-fail-b"):  # the backend's own status and error body
                assert errs[k]["response"]["status_code"] == 503
                assert errs[k]["response"]["body"]["error"]["message"] == "engine overloaded"
            assert errs["req-slow"]["response"] is None and errs["req-slow"]["error"]["code"] == "timeout"
            assert seen["fail a"] == seen["fail b"] == seen["slow x"] == 3  # max_attempts, never more
            assert seen["flaky x"] == 3


async def test_cancel_stops_new_work(redis, tmp_path):
    release = asyncio.Event()
    started = []

    async def handler(backend, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        started.append(body["messages"][0]["content"])
        await release.wait()
        return web.json_response(completion_body("ok", model="demo-model"))

    async with ScriptedBackend(handler=handler).running() as be:
        cfg = batch_config([{"name": "b", "url": be.url, "models": ["demo-model"]}], redis, tmp_path, workers=4)
        async with running_gateway(cfg) as gw, sdk(gw) as client:
            b = await submit(client, jsonl([line(i, f"line {i}") for i in range(30)]))
            await wait_until(lambda: len(started) == 4)
            c = await client.batches.cancel(b.id)
            assert c.status == "cancelling" and c.cancelling_at
            release.set()  # the lines in flight finish; no new line starts
            done = await wait_batch(client, b.id, {"cancelled"})
            assert done.cancelled_at and done.request_counts.total == 30
            assert done.request_counts.completed == len(started) == 4
            out = await content_lines(client, done.output_file_id)
            assert len(out) == 4 and len({o["custom_id"] for o in out}) == 4
            finished = await submit(client, jsonl([b"{bad"]))
            await wait_batch(client, finished.id, {"completed"})
            with pytest.raises(openai.ConflictError):  # a finished batch cannot be cancelled
                await client.batches.cancel(finished.id)


async def test_expired_completion_window(redis, tmp_path):
    never = asyncio.Event()

    async def handler(backend, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        await never.wait()
        return web.json_response(completion_body())

    async with ScriptedBackend(handler=handler).running() as be:
        cfg = batch_config([{"name": "b", "url": be.url, "models": ["demo-model"]}], redis, tmp_path, workers=2,
                           request_timeout_s=5)
        async with running_gateway(cfg) as gw, sdk(gw) as client:
            b = await submit(client, jsonl([line(i) for i in range(6)]), window="1s")
            done = await wait_batch(client, b.id, {"expired"})
            assert done.expired_at and done.output_file_id is None
            errs = await content_lines(client, done.error_file_id)
            assert sorted(e["custom_id"] for e in errs) == [f"req-{i}" for i in range(6)]
            assert {e["error"]["code"] for e in errs} == {"batch_expired"}


async def test_malformed_lines_get_a_clear_error_and_the_rest_proceed(redis, tmp_path):
    backends, urls = await sim_fleet(1)
    cfg = batch_config([{"name": n, "url": u, "models": ["demo-model"]} for n, u in urls.items()], redis, tmp_path,
                       workers=4)
    data = jsonl([line(0), b"{not json", orjson.dumps({"method": "POST", "url": "/v1/chat/completions", "body": {}}),
                  line(0), orjson.dumps({"custom_id": "wrong-url", "method": "POST", "url": "/v1/embeddings",
                                         "body": {"model": "demo-model"}}),
                  line(5), line(6, model="no-such-model")])
    try:
        async with running_gateway(cfg) as gw, sdk(gw) as client:
            b = await submit(client, data)
            done = await wait_batch(client, b.id, {"completed"})
            assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (7, 2, 5)
            out = await content_lines(client, done.output_file_id)
            assert sorted(o["custom_id"] for o in out) == ["req-0", "req-5"]
            errs = await content_lines(client, done.error_file_id)
            msgs = [e["error"]["message"] if e["error"] else e["response"]["body"]["error"]["message"] for e in errs]
            assert msgs[0].startswith("Line 2: not valid JSON")
            assert msgs[1] == "Line 3: `custom_id` must be a non-empty string."
            assert msgs[2] == "Line 4: duplicate `custom_id` 'req-0' (first on line 1)."
            assert msgs[3].startswith("Line 5: `url` must be '/v1/chat/completions'")
            assert errs[4]["custom_id"] == "req-6" and errs[4]["response"]["status_code"] == 404
    finally:
        for be in backends:
            await be.cleanup()


async def test_api_errors_are_openai_shaped(redis, tmp_path):
    cfg = batch_config([{"name": "b", "url": "http://127.0.0.1:9", "models": ["demo-model"]}], redis, tmp_path)
    async with running_gateway(cfg) as gw, sdk(gw) as client:
        with pytest.raises(openai.NotFoundError):
            await client.batches.retrieve("batch_nope")
        with pytest.raises(openai.BadRequestError) as e:
            await client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions",
                                        completion_window="24h")
        assert e.value.body["param"] == "input_file_id"
        f = await client.files.create(file=("x.jsonl", line(1)), purpose="batch")
        with pytest.raises(openai.BadRequestError):
            await client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
        with pytest.raises(openai.BadRequestError):
            await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="soon")
        assert (await client.files.content(f.id)).content == line(1)
        assert f.id in [x.id for x in (await client.files.list()).data]
        assert (await client.files.delete(f.id)).deleted
        with pytest.raises(openai.NotFoundError):
            await client.files.retrieve(f.id)


def test_batch_needs_redis():
    with pytest.raises(ConfigError, match="batch.enabled needs Redis"):
        parse_config({"backends": [{"name": "a", "url": "http://x", "models": ["m"]}], "batch": {"enabled": True}})


async def test_admission_gate_defers_batch_when_interactive_ttft_is_over_slo(redis, tmp_path):
    cfg = batch_config([{"name": "b", "url": "http://127.0.0.1:9", "models": ["demo-model"]}], redis, tmp_path,
                       ttft_slo_s=0.5, admission_wait_s=0.05)
    async with running_gateway(cfg) as gw:
        gate = gw.app[BATCH].gate
        load = gw.state.fleet.backends["b"].load
        now = asyncio.get_running_loop().time()
        assert gate.interactive_ttft_s("demo-model", now) < 0.5
        load.queued_prefill_tokens = 1e7  # a deep interactive queue: the estimate is far over the SLO
        async with aiohttp.ClientSession() as http:
            r = await http.post(gw.url + "/v1/chat/completions", data=line(1).split(b'"body":')[1][:-1],
                                headers={"Content-Type": "application/json", "x-turbo-priority": "batch"})
            assert r.status == 429 and (await r.json())["error"]["code"] == "batch_deferred"
            assert r.headers["Retry-After"]
        assert gate.deferred_total == 1 and gate.in_flight == 0
        assert gw.metric("turbo_gateway_batch_deferred_total") == 1
        load.queued_prefill_tokens = 0.0


async def test_local_run_mode_with_resume(tmp_path):
    fail = {"on": True}

    async def handler(backend, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if fail["on"] and body["messages"][0]["content"] == "bad":
            return web.json_response({"error": {"message": "nope"}}, status=503)
        return web.json_response(completion_body("ok", model="demo-model"))

    from gateway.batch.cli import run_local

    async with ScriptedBackend(handler=handler).running() as be:
        data = jsonl([line(i) for i in range(5)] + [line("x", "bad")])
        out = tmp_path / "out.jsonl"
        args = argparse.Namespace(output=str(out), errors=None, concurrency=3, timeout=5.0, max_attempts=2,
                                  api_key=None, quiet=True, target=be.url + "/v1")
        assert await run_local(data, args) == 1
        first = [orjson.loads(x) for x in out.read_bytes().splitlines()]
        assert sorted(o["custom_id"] for o in first) == [f"req-{i}" for i in range(5)]
        errs = [orjson.loads(x) for x in Path(f"{out}.errors.jsonl").read_bytes().splitlines()]
        assert [e["custom_id"] for e in errs] == ["req-x"] and errs[0]["response"]["status_code"] == 503
        n_before = len(be.bodies)
        fail["on"] = False
        assert await run_local(data, args) == 0  # resume: only the failed line runs again
        assert len(be.bodies) == n_before + 1
        again = [orjson.loads(x) for x in out.read_bytes().splitlines()]
        assert sorted(o["custom_id"] for o in again) == sorted([f"req-{i}" for i in range(5)] + ["req-x"])


@pytest.mark.slow
async def test_sigkill_one_of_two_consumers_loses_and_duplicates_nothing(redis, tmp_path):
    backends, urls = await sim_fleet(2, speed=4.0)
    cfg = batch_config([{"name": n, "url": u, "models": ["demo-model"]} for n, u in urls.items()], redis, tmp_path,
                       visibility_timeout_s=1.0)
    procs: list[subprocess.Popen] = []
    logs = [tmp_path / "consumer-a.log", tmp_path / "consumer-b.log"]
    try:
        async with running_gateway(cfg) as gw, sdk(gw) as client:
            path = tmp_path / "batch.yaml"
            data = cfg.model_dump(mode="json", exclude_none=True)
            data["batch"]["gateway_url"] = gw.url
            path.write_text(yaml.safe_dump(data))
            for log in logs:
                procs.append(subprocess.Popen([sys.executable, "-m", "gateway.batch", "--config", str(path),
                                               "--workers", "8"], stdout=subprocess.DEVNULL,
                                              stderr=open(log, "wb"), cwd=os.getcwd()))
            b = await submit(client, jsonl([line(i, f"line {i}", max_tokens=24) for i in range(200)]))
            r = aioredis.from_url(redis)
            queue = gw.app[BATCH].store.queue
            await wait_until(lambda: logs[0].read_bytes().count(b"batch consumer") >= 1, timeout_s=20)
            name_a = logs[0].read_text().split("batch consumer ")[1].split(":")[0]

            async def a_holds_lines_after_progress() -> bool:
                cur = await client.batches.retrieve(b.id)
                pend = await r.xpending_range(queue, "consumers", min="-", max="+", count=100, consumername=name_a)
                return cur.request_counts.completed >= 30 and len(pend) >= 4

            deadline = asyncio.get_running_loop().time() + 30
            while not await a_holds_lines_after_progress():
                assert asyncio.get_running_loop().time() < deadline, "consumer A never held lines"
                await asyncio.sleep(0.02)
            procs[0].send_signal(signal.SIGKILL)
            procs[0].wait(10)
            done = await wait_batch(client, b.id, {"completed"}, timeout_s=60)
            out = await content_lines(client, done.output_file_id)
            ids = [o["custom_id"] for o in out]
            assert len(ids) == 200 and set(ids) == {f"req-{i}" for i in range(200)}  # none missing or twice
            assert done.request_counts.completed == 200 and done.request_counts.failed == 0
            assert b"reclaimed" in logs[1].read_bytes()  # B took over what A held
            await r.aclose()
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(10)
        for be in backends:
            await be.cleanup()

