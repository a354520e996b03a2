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
