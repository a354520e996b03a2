"""Active health checks: thresholds both ways, against a real server whose /health
the test flips."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from gateway.config import HealthChecks, Timeouts
from gateway.engine_signals.health_checks import HealthChecker
from gateway.upstream.client import BackendClient
from routing import BackendSpec, Fleet


async def test_unhealthy_and_healthy_thresholds():
    status = {"code": 200}

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=status["code"])

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    fleet = Fleet([BackendSpec("b", frozenset({"m"}))])
    state = fleet.backends["b"]
    try:
        async with aiohttp.ClientSession() as session:
            checker = HealthChecker(HealthChecks(unhealthy_threshold=2, healthy_threshold=3),
                                    [BackendClient(state, url, session, Timeouts())], {"b": "/health"})
            await checker.check_all()
            assert state.healthy and checker.ready()
            status["code"] = 503
            await checker.check_all()
            assert state.healthy  # one failure is not enough
            await checker.check_all()
            assert not state.healthy and not checker.ready()
            status["code"] = 200
            for _ in range(2):
                await checker.check_all()
                assert not state.healthy  # fewer than 3 passes in a row
            await checker.check_all()
            assert state.healthy and checker.ready()
    finally:
        await runner.cleanup()
