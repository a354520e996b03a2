"""Drain on SIGTERM, reload on SIGHUP / file change / admin API, circuit breakers,
draining a backend, admission control. Real sockets on 127.0.0.1, no mocks."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import orjson
import pytest
import yaml
from aiohttp import web

from gateway.config import load_config
from gateway.server.app import STATE, create_app
from tests.support.servers import ScriptedBackend, free_port, gateway_config, running_gateway, sse_chunk, wait_until

ROOT = Path(__file__).resolve().parents[3]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
ADMIN_KEY = "admin-secret-for-tests"
ADMIN = {"key_sha256": hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_KEY}"}


def gated_stream(gate: asyncio.Event, started: asyncio.Event | None = None):
    """A backend handler that sends one chunk, waits for ``gate``, then finishes."""

    async def answer(b, request, body):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse_chunk(0, "first "))
        if started is not None:
            started.set()
        await gate.wait()
        await resp.write(sse_chunk(1, "last", finish="stop"))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    return answer


async def post(url: str, body: dict, path: str = "/v1/chat/completions", headers: dict | None = None):
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, json=body, headers=headers) as r:
            return r.status, r.headers.copy(), await r.read()


async def get(url: str, path: str, headers: dict | None = None):
    async with aiohttp.ClientSession() as s:
        async with s.get(url + path, headers=headers) as r:
            return r.status, await r.read()


# ---- SIGTERM drain and SIGHUP reload, through `python -m gateway` ----------------------


class GatewayProc:
    def __init__(self, cfg: dict, tmp: Path) -> None:
        self.port = free_port()
        self.path = tmp / "gw.yaml"
        self.write(cfg)
        self.stderr_path = tmp / "gw.stderr"
        self._err = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "gateway", "--config", str(self.path), "--port",
                                      str(self.port)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self._err)
        self.url = f"http://127.0.0.1:{self.port}"

    def write(self, cfg: dict) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(cfg))
        os.replace(tmp, self.path)

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    async def ready(self) -> None:
        async def ok() -> bool:
            try:
                return (await get(self.url, "/ready"))[0] == 200
            except aiohttp.ClientError:
                return False

        for _ in range(600):
            assert self.proc.poll() is None, self.stderr()
            if await ok():
                return
            await asyncio.sleep(0.05)
        raise AssertionError("gateway never became ready")

    async def refuses_connections(self) -> bool:
        try:
            _, w = await asyncio.open_connection("127.0.0.1", self.port)
        except OSError:
            return True
        w.close()
        return False

    async def wait_exit(self) -> int:
        return await asyncio.to_thread(self.proc.wait, 60)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._err.close()


def _proc_cfg(url: str, **extra) -> dict:
    return {"routing": {"policy": "round_robin", "scrape_interval_s": 0}, "health": {"interval_s": 60},
            "lifecycle": {"watch_config_s": 0}, "backends": [{"name": "a", "url": url, "models": ["m"]}], **extra}


@pytest.mark.slow
async def test_sighup_reloads_and_sigterm_drains_in_flight_stream(tmp_path):
    gate = asyncio.Event()
    started = asyncio.Event()
    async with ScriptedBackend(handler=gated_stream(gate, started)).running() as be:
        gw = GatewayProc(_proc_cfg(be.url), tmp_path)
        try:
            await gw.ready()
            async with aiohttp.ClientSession() as s:
                async with s.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
                    assert r.status == 200
                    first = await r.content.readuntil(b"\n\n")
                    assert b"first" in first
                    # SIGHUP with a new model: applied while the stream is in flight
                    cfg = _proc_cfg(be.url)
                    cfg["backends"][0]["models"] = ["m", "m2"]
                    gw.write(cfg)
                    gw.proc.send_signal(signal.SIGHUP)

                    async def has_m2() -> bool:
                        return b'"m2"' in (await get(gw.url, "/v1/models"))[1]

                    for _ in range(400):
                        if await has_m2():
                            break
                        await asyncio.sleep(0.05)
                    assert await has_m2()
                    # an invalid config is rejected with one log line; the running one stays
                    bad = _proc_cfg(be.url)
                    bad["backends"][0]["weight"] = -1
                    gw.write(bad)
                    gw.proc.send_signal(signal.SIGHUP)
                    await wait_until(lambda: "config reload (SIGHUP) rejected" in gw.stderr())
                    assert "backends.0.weight" in gw.stderr()
                    assert await has_m2()
                    # SIGTERM: stop accepting, finish the stream, exit 0
                    gw.proc.send_signal(signal.SIGTERM)
                    for _ in range(400):
                        if await gw.refuses_connections():
                            break
                        await asyncio.sleep(0.05)
                    assert await gw.refuses_connections()
                    assert gw.proc.poll() is None  # still draining
                    gate.set()
                    rest = await r.read()
            assert rest.endswith(b"data: [DONE]\n\n")
            assert await gw.wait_exit() == 0, gw.stderr()
            assert "draining" in gw.stderr() and "Traceback" not in gw.stderr()
        finally:
            gate.set()
            gw.close()


@pytest.mark.slow
async def test_sigterm_drain_timeout_cuts_streams_and_exits_0(tmp_path):
    gate = asyncio.Event()  # never set: the stream outlives the drain timeout
    async with ScriptedBackend(handler=gated_stream(gate)).running() as be:
        gw = GatewayProc(_proc_cfg(be.url, lifecycle={"drain_timeout_s": 0.5, "watch_config_s": 0}), tmp_path)
        try:
            await gw.ready()
            async with aiohttp.ClientSession() as s:
                async with s.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
                    await r.content.readuntil(b"\n\n")
                    gw.proc.send_signal(signal.SIGTERM)
                    try:
                        rest = await r.read()
                    except aiohttp.ClientPayloadError:
                        rest = b""
            assert b"[DONE]" not in rest
            assert await gw.wait_exit() == 0, gw.stderr()
        finally:
            gate.set()
            gw.close()


# ---- reload in process: file watch and admin API ------------------------------------------


@asynccontextmanager
async def gateway_from_file(path: Path):
    app = create_app(load_config(path), config_path=str(path))
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", app[STATE]
    finally:
        await runner.cleanup()


def _file_cfg(backends: list[dict], **extra) -> dict:
    return {"routing": {"policy": "round_robin", "scrape_interval_s": 0}, "health": {"interval_s": 60},
            "retries": {"base_backoff_s": 0.001, "max_backoff_s": 0.01}, "admin": ADMIN,
            "lifecycle": {"watch_config_s": 0.05}, "backends": backends, **extra}


async def test_config_file_change_swaps_backends_without_dropping_in_flight(tmp_path):
    gate, started = asyncio.Event(), asyncio.Event()
    path = tmp_path / "gw.yaml"
    async with ScriptedBackend(handler=gated_stream(gate, started)).running() as old, \
            ScriptedBackend().running() as new:
        path.write_text(yaml.safe_dump(_file_cfg([{"name": "old", "url": old.url, "models": ["m"]}])))
        async with gateway_from_file(path) as (url, state):
            held = asyncio.create_task(post(url, {**CHAT, "stream": True}))
            await started.wait()
            path.write_text(yaml.safe_dump(_file_cfg([{"name": "new", "url": new.url, "models": ["m"]}])))
            await wait_until(lambda: "new" in state.fleet.backends)
            assert "old" not in state.fleet.backends
            status, headers, _ = await post(url, CHAT)
            assert status == 200 and headers["x-turbo-backend"] == "new"
            gate.set()
            status, _, body = await held
            assert status == 200 and body.endswith(b"data: [DONE]\n\n")
            # an invalid file: rejected, the running config stays
            path.write_text("backends: [{name: x}]\n")
            await wait_until(lambda: state.reloads["rejected"] == 1)
            assert (await post(url, CHAT))[0] == 200
            # the admin API reports the same rejection as a 400, naming the field
            status, _, body = await post(url, {}, path="/admin/reload", headers=ADMIN_HEADERS)
            assert status == 400 and b"backends.0" in body


async def test_admin_endpoints_off_by_default_and_drain_a_backend(tmp_path):
    gate, started = asyncio.Event(), asyncio.Event()
    async with ScriptedBackend(handler=gated_stream(gate, started)).running() as a, ScriptedBackend().running() as b:
        backends = [{"name": "a", "url": a.url, "models": ["m"]}, {"name": "b", "url": b.url, "models": ["m"]}]
        async with running_gateway(gateway_config(backends)) as gw:  # no admin key: /admin is not there
            assert (await get(gw.url, "/admin/backends", ADMIN_HEADERS))[0] == 404
            assert (await post(gw.url, {}, path="/admin/backends/a/drain", headers=ADMIN_HEADERS))[0] == 404
        async with running_gateway(gateway_config(backends, admin=ADMIN)) as gw:
            assert (await get(gw.url, "/admin/backends"))[0] == 401
            assert (await get(gw.url, "/admin/backends", {"Authorization": "Bearer wrong"}))[0] == 401
            held = asyncio.create_task(post(gw.url, {**CHAT, "stream": True}))  # round robin: on `a`
            await started.wait()
            status, _, body = await post(gw.url, {}, path="/admin/backends/a/drain", headers=ADMIN_HEADERS)
            assert status == 200 and orjson.loads(body)["in_flight"] == 1
            for _ in range(4):  # no new request reaches a draining backend
                status, headers, _ = await post(gw.url, CHAT)
                assert status == 200 and headers["x-turbo-backend"] == "b"
            gate.set()
            assert (await held)[0] == 200  # ... and it finishes its own
            status, body = await get(gw.url, "/admin/backends", ADMIN_HEADERS)
            rows = {r["name"]: r for r in orjson.loads(body)["data"]}
            assert rows["a"]["draining"] is True and rows["a"]["in_flight"] == 0
            assert gw.metric("turbo_gateway_backend_draining", backend="a") == 1
            assert (await post(gw.url, {}, path="/admin/backends/a/undrain", headers=ADMIN_HEADERS))[0] == 200
            assert (await post(gw.url, {}, path="/admin/backends/zzz/drain", headers=ADMIN_HEADERS))[0] == 404
            assert (await post(gw.url, {}, path="/admin/reload", headers=ADMIN_HEADERS))[0] == 409
            assert gw.idle("a") and gw.idle("b")


# ---- circuit breaker -----------------------------------------------------------------------


async def test_breaker_opens_probes_half_open_and_closes():
    failing = {"on": True}

    async def flaky(b, request, body):
        if failing["on"]:
            return web.json_response({"error": {"message": "boom", "type": "server_error"}}, status=500)
        return web.json_response({"id": "x", "object": "chat.completion", "choices": []})

    async with ScriptedBackend(handler=flaky).running() as bad, ScriptedBackend().running() as good:
        cfg = gateway_config([{"name": "bad", "url": bad.url, "models": ["m"]},
                              {"name": "good", "url": good.url, "models": ["m"]}],
                             breaker={"failure_threshold": 2, "open_s": 0.2, "success_threshold": 1},
                             retries={"max_attempts": 1})
        async with running_gateway(cfg) as gw:
            br = gw.state.fleet.backends["bad"].breaker
            for _ in range(4):  # round robin: bad fails twice, then its breaker opens
                await post(gw.url, CHAT)
            assert br.state == "open" and len(bad.attempt_times) == 2
            for _ in range(3):
                _status, headers, _ = await post(gw.url, CHAT)
                if br.state == "open":
                    assert headers["x-turbo-backend"] == "good"
            failing["on"] = False  # the backend recovers: a half-open probe closes the breaker

            async def closes() -> None:
                while br.state != "closed":
                    await post(gw.url, CHAT)

            await asyncio.wait_for(closes(), 20)
            assert gw.metric("turbo_gateway_backend_breaker_opened_total", backend="bad") >= 1
            assert gw.idle("bad") and gw.idle("good")
            assert br.probing == 0


async def test_breaker_open_on_only_backend_is_503_with_retry_after():
    async def down(b, request, body):
        return web.json_response({"error": {"message": "boom", "type": "server_error"}}, status=503)

    async with ScriptedBackend(handler=down).running() as be:
        cfg = gateway_config([{"name": "only", "url": be.url, "models": ["m"]}],
                             breaker={"failure_threshold": 1, "open_s": 30}, retries={"max_attempts": 1})
        async with running_gateway(cfg) as gw:
            assert (await post(gw.url, CHAT))[0] == 503  # the backend's own 503
            status, headers, body = await post(gw.url, CHAT)
            assert status == 503 and int(headers["Retry-After"]) >= 1
            assert orjson.loads(body)["error"]["code"] == "no_backend_available"
            assert len(be.attempt_times) == 1


# ---- admission control ----------------------------------------------------------------------


async def test_admission_queues_when_saturated_then_503_with_retry_after():
    gate = asyncio.Event()
    async with ScriptedBackend(handler=gated_stream(gate)).running() as be:
        cfg = gateway_config([{"name": "only", "url": be.url, "models": ["m"]}],
                             admission={"max_in_flight_per_backend": 1, "queue_size": 1, "queue_timeout_s": 0.3})
        async with running_gateway(cfg) as gw:
            adm = gw.state.admission
            first = asyncio.create_task(post(gw.url, {**CHAT, "stream": True}))
            await wait_until(lambda: gw.in_flight("only") == 1)
            queued = asyncio.create_task(post(gw.url, {**CHAT, "stream": True}))
            await wait_until(lambda: adm.waiting == 1)
            status, headers, body = await post(gw.url, CHAT)  # the queue (size 1) is full
            assert status == 503 and headers["Retry-After"] == "1"
            assert orjson.loads(body)["error"]["code"] == "fleet_saturated"
            status, headers, _ = await queued  # its deadline passed while the backend stayed full
            assert status == 503 and "Retry-After" in headers
            queued = asyncio.create_task(post(gw.url, {**CHAT, "stream": True}))
            await wait_until(lambda: adm.waiting == 1)
            gate.set()  # room again: the waiter goes through
            assert (await first)[0] == 200 and (await queued)[0] == 200
            assert adm.waiting == 0 and adm.granted == 0
            assert gw.metric("turbo_gateway_admission_rejected_total", reason="queue_full") == 1
            assert gw.idle("only")


async def test_admission_is_fair_across_keys():
    from gateway.config import Admission
    from gateway.tenancy.admission import AdmissionControl
    from routing import BackendSpec, Fleet

    fleet = Fleet([BackendSpec("b", frozenset({"m"}))])
    adm = AdmissionControl(Admission(max_in_flight_per_backend=1, queue_size=100, queue_timeout_s=30), fleet)
    hold = fleet.reserve(fleet.backends["b"])
    order: list[str] = []

    async def one(key: str, prio: int = 0) -> None:
        await adm.admit("m", key, prio)
        order.append(key)
        r = fleet.reserve(fleet.backends["b"])  # routed: takes the backend's slot
        await asyncio.sleep(0)
        r.release()
        adm.pump()

    tasks = [asyncio.create_task(one("greedy")) for _ in range(5)]
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(one("polite")))
    tasks.append(asyncio.create_task(one("vip", prio=5)))
    await wait_until(lambda: adm.waiting == 7)
    hold.release()
    adm.pump()
    await asyncio.gather(*tasks)
    assert order[0] == "vip"  # the higher priority first
    assert order.index("polite") <= 2  # not behind all five of greedy's requests
