"""The request metrics' labels name the backend and pool that answered: after a retry,
after a reload that moves a backend to another pool, and after one that renames it.
Real sockets on 127.0.0.1."""

from __future__ import annotations

from aiohttp import web

from gateway.ops.config_reload import apply_config
from tests.integration.server.test_adversarial_probes import _P, BODY, exchange, post
from tests.support.servers import ScriptedBackend, gateway_config, running_gateway


async def test_retry_and_reload_label_the_backend_and_pool_that_answered():
    """A retry after the first route answers from the second backend (metrics say so);
    a reload that moves a backend to another pool, and one that renames it, label the
    next answers with the new pool and name."""

    async def broken(b, request, body):
        return web.json_response({"error": {"message": "down"}}, status=503)

    async with ScriptedBackend(handler=broken).running() as bad, ScriptedBackend().running() as good:
        backends = [{"name": "bad", "url": bad.url, "models": ["m"], "pool": "p1"},
                    {"name": "good", "url": good.url, "models": ["m"], "pool": "p1"}]
        pools = [{"name": "p1"}, {"name": "p2"}]
        cfg = gateway_config(backends, pools=pools, routing={"policy": "round_robin", "scrape_interval_s": 0})
        async with running_gateway(cfg) as gw:
            for _ in range(2):  # round robin: one of them starts on "bad" and is retried
                got, _ = await exchange(gw.url, [post(_P, BODY)], 1, wait_s=5, check_close=False)
                assert got.done[0][0] == 200 and got.done[0][1]["x-turbo-backend"] == "good"
            assert gw.metric("turbo_gateway_requests_total", model="m", backend="good", status="200") == 2
            assert gw.metric("turbo_gateway_requests_total", model="m", backend="bad", status="200") == 0
            assert gw.metric("turbo_gateway_pool_requests_total", pool="p1", status="200") == 2

            moved = [{**backends[1], "pool": "p2"}]
            apply_config(gw.app, gateway_config(moved, pools=pools,
                                                routing={"policy": "round_robin", "scrape_interval_s": 0}))
            got, _ = await exchange(gw.url, [post(_P, BODY)], 1, wait_s=5, check_close=False)
            assert got.done[0][0] == 200
            assert gw.metric("turbo_gateway_pool_requests_total", pool="p2", status="200") == 1
            assert gw.metric("turbo_gateway_pool_ttft_seconds_count", pool="p2") == 1
            assert gw.metric("turbo_gateway_pool_requests_total", pool="p1", status="200") == 2

            renamed = [{**moved[0], "name": "fresh"}]
            apply_config(gw.app, gateway_config(renamed, pools=pools,
                                                routing={"policy": "round_robin", "scrape_interval_s": 0}))
            got, _ = await exchange(gw.url, [post(_P, BODY)], 1, wait_s=5, check_close=False)
            assert got.done[0][0] == 200 and got.done[0][1]["x-turbo-backend"] == "fresh"
            assert gw.state.fleet.backends["fresh"].name == "fresh"
            assert gw.metric("turbo_gateway_requests_total", model="m", backend="fresh", status="200") == 1
            assert gw.idle("fresh")
