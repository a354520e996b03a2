"""Engine-metrics scraping over real sockets: the gateway learns a simulated vLLM
backend's KV capacity and load from its real /metrics endpoint."""

from __future__ import annotations

from loadtest.sim.server import SimBackendConfig, start_backends
from tests.support.servers import gateway_config, running_gateway, wait_until


async def test_gateway_learns_kv_capacity_from_vllm_metrics():
    backends, urls = await start_backends([SimBackendConfig(name="v", models=["m"], profile="demo", speed=20.0)])
    try:
        cfg = gateway_config([{"name": "v", "url": urls["v"], "models": ["m"]}],
                             routing={"policy": "estimated_ttft", "scrape_interval_s": 0.05})
        async with running_gateway(cfg) as gw:
            state = gw.state.fleet.backends["v"]
            await wait_until(lambda: state.load.kv_capacity_known and state.load.engine is not None)
            # the demo profile: 512 blocks of 16 tokens
            assert state.load.kv_capacity_tokens == 512 * 16
            assert gw.state.router.index.backends["v"].capacity_blocks == 512 * 16 // 64
            assert gw.state.scraper.ok["v"] is True
    finally:
        for b in backends:
            await b.cleanup()


async def test_a_scrape_that_times_out_is_logged_with_a_reason(caplog):
    """A ``/metrics`` that never answers ends in a timeout, whose own text is empty:
    the log line still says what went wrong."""
    import asyncio
    import logging

    from aiohttp import web

    done = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        await done.wait()
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/metrics", hang)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        cfg = gateway_config([{"name": "slow", "url": f"http://127.0.0.1:{port}", "models": ["m"]}],
                             routing={"scrape_interval_s": 0.05})
        with caplog.at_level(logging.INFO, logger="gateway.engine_signals.metrics_scraper"):
            async with running_gateway(cfg) as gw:
                await wait_until(lambda: gw.state.scraper.ok.get("slow") is False)
        line = next(r.getMessage() for r in caplog.records if "no engine metrics from backend slow" in r.getMessage())
        assert "()" not in line and "TimeoutError" in line
    finally:
        done.set()
        await runner.cleanup()
