"""A dead fleet fails fast: once every backend of a model sits behind an open circuit
breaker, a request is answered at once with 503 ``no_backend_available``, the probe's
time as ``Retry-After`` and ``x-should-retry: false``, instead of waiting for the
breaker (within ``retries.max_retry_after_s``) until ``retries.budget_s`` runs out.
Real sockets: the backend's port refuses connections."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from tests.support.servers import free_port, gateway_config, running_gateway

OPEN_S = 5.0
BODY = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


async def test_requests_to_a_dead_fleet_are_answered_before_the_breaker_probes():
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: every connect is refused
    cfg = gateway_config([{"name": "dead", "url": dead, "models": ["m"]}],
                         retries={"max_attempts": 3, "budget_s": 8.0, "max_retry_after_s": 10.0},
                         breaker={"failure_threshold": 2, "open_s": OPEN_S})
    async with running_gateway(cfg) as gw, aiohttp.ClientSession() as http:
        async def ask() -> tuple[int, dict, dict, float]:
            t = time.monotonic()
            async with http.post(gw.url + "/v1/chat/completions", json=BODY) as r:
                return r.status, dict(r.headers), await r.json(), time.monotonic() - t

        status, headers, body, _ = await ask()  # two refused connects open the breaker
        assert status == 502 and body["error"]["code"] == "connect"
        breaker = gw.state.fleet.backends["dead"].breaker
        assert breaker.state == "open"
        # concurrent clients of the dead fleet: each answered without waiting for the probe
        answers = await asyncio.gather(*(ask() for _ in range(4)))
        assert breaker.state == "open"  # nobody waited long enough to probe it
        for status, headers, body, took in answers:
            assert status == 503, body
            assert body["error"]["code"] == "no_backend_available"
            assert headers["x-should-retry"] == "false"
            assert 1 <= int(headers["Retry-After"]) <= OPEN_S + 1  # when the breaker lets a probe through
            assert took < OPEN_S  # answered before the probe, not after waiting for it
