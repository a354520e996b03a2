"""Fault injection over the simulated fleet (loadtest/sim): one backend of three
misbehaves, a mixed burst (streamed and not) goes through the gateway, and for each
fault: no retryable request is lost, a stream cut mid-answer is continued on another
backend (or, with ``migration`` off, ends with a clean error event), the rest get the
right status, and every in-flight and limiter counter is back to zero afterwards."""

from __future__ import annotations

import asyncio
import hashlib

import aiohttp
import orjson
import pytest

from loadtest.sim.server import SimBackendConfig, start_backends
from tests.support.servers import gateway_config, running_gateway, wait_until

KEY = "sk-fault-suite"
N = 24


async def _one(session: aiohttp.ClientSession, url: str, i: int) -> tuple[int, bool, bytes]:
    stream = i % 2 == 0
    body = {"model": "m", "max_tokens": 8, "ignore_eos": True, "stream": stream,
            "messages": [{"role": "user", "content": f"request {i}"}]}
    async with session.post(url + "/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {KEY}"}) as r:
        return r.status, stream, await r.read()


FAULTS = {
    "hang": ({"hang_rate": 1.0}, "all_ok"),
    "stall_before_first_byte": ({"stall_s": 5.0}, "all_ok"),
    "storm_429": ({"rate_limit_rate": 1.0, "retry_after_s": 30}, "all_ok"),
    "error_503": ({"error_rate": 1.0, "error_status": 503}, "all_ok"),
    "killed_mid_stream": ({"close_after_chunks": 3}, "all_ok"),  # streams continued elsewhere (migration)
    "killed_mid_stream_no_migration": ({"close_after_chunks": 3}, "streams_may_cut"),
    "slow_drip": ({"drip_s": 0.02}, "all_ok"),
    "dies_and_comes_back": ({"crash_after_s": 0.0, "crash_down_s": 0.5}, "all_ok"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
async def test_fault(fault):
    faults, expect = FAULTS[fault]
    backends, urls = await start_backends(
        [SimBackendConfig(name=n, models=["m"], profile="demo", speed=50.0) for n in ("f0", "f1", "f2")])
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(urls["f0"] + "/admin/faults", json=faults) as r:
                assert r.status == 200, await r.text()
        cfg = gateway_config(
            [{"name": n, "url": u, "models": ["m"]} for n, u in urls.items()],
            timeouts={"ttft_s": 1.0, "idle_s": 2.0}, breaker={"failure_threshold": 2, "open_s": 0.5},
            retries={"max_attempts": 3, "max_retry_after_s": 1},
            migration={"enabled": fault != "killed_mid_stream_no_migration"},
            auth={"keys": [{"name": "suite", "key_sha256": hashlib.sha256(KEY.encode()).hexdigest(),
                            "max_concurrent": N}]})
        async with running_gateway(cfg) as gw:
            async with aiohttp.ClientSession() as s:
                results = await asyncio.gather(*(_one(s, gw.url, i) for i in range(N)))
            for status, stream, body in results:
                if expect == "all_ok" or not stream:
                    assert status == 200, (fault, status, body[:200])
                    if stream:
                        assert body.endswith(b"data: [DONE]\n\n")
                    else:
                        assert orjson.loads(body)["choices"]
                else:  # cut after bytes reached the client: an error event, never a fake finish
                    assert status == 200
                    if not body.endswith(b"data: [DONE]\n\n"):
                        last = body.rstrip().rsplit(b"\n", 1)[-1]
                        assert orjson.loads(last[5:])["error"]["code"] == "disconnected"
            if fault != "slow_drip":  # the fault really happened
                assert _sum(gw, "turbo_gateway_upstream_errors_total", backend="f0") >= 1
            if fault == "killed_mid_stream_no_migration":
                assert _sum(gw, "turbo_gateway_stream_errors_total", backend="f0") >= 1
            if fault == "killed_mid_stream":
                assert _sum(gw, "turbo_gateway_stream_migrations_total") >= 1
            for name in urls:
                await wait_until(lambda name=name: gw.idle(name))
            assert gw.state.limiter.usage["suite"].concurrent == 0
            assert gw.state.admission.waiting == 0
            if fault == "dies_and_comes_back":  # the crashed backend rejoins once it is back
                async with aiohttp.ClientSession() as s:
                    async def rejoined() -> None:
                        while gw.state.fleet.backends["f0"].breaker.state != "closed" or \
                                gw.metric("turbo_gateway_requests_total", model="m", backend="f0", status="200") == 0:
                            await _one(s, gw.url, 1)
                    await asyncio.wait_for(rejoined(), 30)
    finally:
        for b in backends:
            await b.cleanup()


def _sum(gw, name: str, **labels: str) -> float:
    total = 0.0
    for metric in gw.state.metrics.registry.collect():
        for sample in metric.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total
