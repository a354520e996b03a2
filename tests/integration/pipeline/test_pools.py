"""Pools: long prompts to the prefill pool, and the disaggregated two-step flow with
a fallback, against simulated prefill and decode engines over HTTP."""

from __future__ import annotations

import aiohttp
import orjson

from loadtest.sim.server import SimBackendConfig, start_backends
from routing import BackendSpec, Fleet, Router, RouteRequest, make_policy
from tests.support.servers import free_port, gateway_config, running_gateway


def _fleet(*roles: tuple[str, str]) -> Router:
    return Router(Fleet([BackendSpec(n, frozenset({"m"}), pool=r, role=r) for n, r in roles]),
                  make_policy("estimated_ttft"))


def test_plan_by_pools_and_prompt_length():
    long, short = RouteRequest("m", prompt_tokens=20_000), RouteRequest("m", prompt_tokens=100)
    pd = _fleet(("p", "prefill"), ("d", "decode"))
    assert pd.plan(long, 0.0, 8192).kind == "disaggregated"
    assert pd.plan(short, 0.0, 8192).roles == frozenset({"decode"})
    pdm = _fleet(("p", "prefill"), ("d", "decode"), ("x", "mixed"))
    assert pdm.plan(short, 0.0, 8192).roles == frozenset({"mixed"})
    pm = _fleet(("p", "prefill"), ("x", "mixed"))
    assert pm.plan(long, 0.0, 8192).roles == frozenset({"prefill"})
    assert pm.plan(short, 0.0, 8192).roles == frozenset({"mixed"})
    assert _fleet(("x", "mixed")).plan(long, 0.0, 8192).roles is None


def test_cached_prefix_makes_a_long_prompt_short():
    r = _fleet(("p", "prefill"), ("x", "mixed"))
    hashes = tuple(range(300))
    r.index.record("x", hashes, now=0.0)
    req = RouteRequest("m", prompt_tokens=20_000, block_hashes=hashes, tokens_per_block=64)
    plan = r.plan(req, 1.0, 8192)
    assert plan.roles == frozenset({"mixed"}) and plan.uncached_tokens == 20_000 - 300 * 64


async def _chat(url: str, content: str, **extra) -> tuple[int, dict, bytes]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", json={"model": "m", "max_tokens": 4, "ignore_eos": True,
                                                              "messages": [{"role": "user", "content": content}],
                                                              **extra}) as r:
            return r.status, r.headers.copy(), await r.read()


LONG = "lorem ipsum dolor sit amet " * 200  # ~1,300 emulator tokens, ~5,400 bytes


async def test_disaggregated_flow_through_the_gateway():
    backends, urls = await start_backends([
        SimBackendConfig(name="pf", models=["m"], profile="demo", speed=20.0, role="prefill"),
        SimBackendConfig(name="dc", models=["m"], profile="demo", speed=20.0, role="decode")])
    sims = {b.cfg.name: b for b in backends}
    try:
        cfg = gateway_config([{"name": "pf", "url": urls["pf"], "models": ["m"], "pool": "prefill"},
                              {"name": "dc", "url": urls["dc"], "models": ["m"], "pool": "decode"}],
                             pools=[{"name": "prefill", "role": "prefill"}, {"name": "decode", "role": "decode"}],
                             routing={"policy": "estimated_ttft", "long_prompt_tokens": 256,
                                      "scrape_interval_s": 0})
        async with running_gateway(cfg) as gw:
            for stream in (False, True):
                status, headers, body = await _chat(gw.url, f"{stream} " + LONG, stream=stream)
                assert status == 200, body
                assert headers["x-turbo-backend"] == "dc"
            # the decode engine received the prompt's KV by transfer instead of computing it
            assert sims["dc"].engine.kv_transfer_tokens_total > 1000
            assert sims["pf"].engine.prompt_tokens_total > 1000
            assert gw.metric("turbo_gateway_disaggregated_total", outcome="ok") == 2
            # the same long prompt again: the decode backend now holds its prefix (the
            # transferred KV), so it is no longer "long" and skips the prefill leg
            status, headers, _ = await _chat(gw.url, "False " + LONG)
            assert status == 200 and headers["x-turbo-backend"] == "dc"
            assert gw.metric("turbo_gateway_disaggregated_total", outcome="ok") == 2
            assert "reason=" in headers["x-turbo-route"]
            # a short prompt skips the prefill pool: the decode backend prefills it locally
            before = sims["pf"].engine.prompt_tokens_total
            status, headers, _ = await _chat(gw.url, "hi")
            assert status == 200 and headers["x-turbo-backend"] == "dc"
            assert sims["pf"].engine.prompt_tokens_total == before
            assert gw.idle("pf") and gw.idle("dc")
    finally:
        for b in backends:
            await b.cleanup()


async def test_failed_prefill_leg_falls_back_to_decode_backend():
    backends, urls = await start_backends([SimBackendConfig(name="dc", models=["m"], profile="demo", speed=20.0,
                                                            role="decode")])
    try:
        cfg = gateway_config([{"name": "pf", "url": f"http://127.0.0.1:{free_port()}", "models": ["m"],
                               "pool": "prefill"},
                              {"name": "dc", "url": urls["dc"], "models": ["m"], "pool": "decode"}],
                             pools=[{"name": "prefill", "role": "prefill"}, {"name": "decode", "role": "decode"}],
                             routing={"long_prompt_tokens": 256, "scrape_interval_s": 0},
                             health={"unhealthy_threshold": 100})
        async with running_gateway(cfg) as gw:
            status, headers, body = await _chat(gw.url, LONG)
            assert status == 200, body
            assert headers["x-turbo-backend"] == "dc"
            assert orjson.loads(body)["usage"]["completion_tokens"] == 4
            assert backends[0].engine.kv_transfer_tokens_total == 0  # recomputed locally
            assert gw.metric("turbo_gateway_disaggregated_total", outcome="fallback") == 1
            assert gw.idle("pf") and gw.idle("dc")
    finally:
        for b in backends:
            await b.cleanup()


def _two_pools(canary_url: str, stable_url: str, weight: float) -> dict:
    return dict(backends=[{"name": "stable", "url": stable_url, "models": ["m"], "pool": "main"},
                          {"name": "canary", "url": canary_url, "models": ["m"], "pool": "canary"}],
                pools=[{"name": "main"}, {"name": "canary"}],
                routing={"policy": "least_requests", "scrape_interval_s": 0,
                         "canaries": [{"model": "m", "stable_pool": "main", "canary_pool": "canary",
                                       "canary_weight": weight}]})


async def test_canary_split_by_weight_with_per_pool_metrics():
    import random

    from tests.support.servers import ScriptedBackend

    async with ScriptedBackend().running() as stable, ScriptedBackend().running() as canary:
        spec = _two_pools(canary.url, stable.url, 0.2)
        cfg = gateway_config(spec.pop("backends"), **spec)
        async with running_gateway(cfg) as gw:
            gw.state.router.set_canaries(gw.state.router.canaries, random.Random(4))
            for i in range(200):
                status, _, _ = await _chat(gw.url, f"q{i}")
                assert status == 200
            n_canary = len(canary.attempt_times)
            assert len(stable.attempt_times) + n_canary == 200
            assert 20 <= n_canary <= 60  # 20% of 200 = 40
            assert gw.metric("turbo_gateway_pool_requests_total", pool="canary", status="200") == n_canary
            assert gw.metric("turbo_gateway_pool_requests_total", pool="main", status="200") == 200 - n_canary
            assert gw.metric("turbo_gateway_pool_ttft_seconds_count", pool="canary") == n_canary


async def test_failing_canary_falls_back_to_the_stable_pool():
    from aiohttp import web

    from tests.support.servers import ScriptedBackend

    async def broken(b, request, body):
        return web.json_response({"error": {"message": "canary is broken"}}, status=503)

    async with ScriptedBackend().running() as stable, ScriptedBackend(handler=broken).running() as canary:
        spec = _two_pools(canary.url, stable.url, 1.0)  # every request tries the canary first
        cfg = gateway_config(spec.pop("backends"), **spec)
        async with running_gateway(cfg) as gw:
            for i in range(5):
                status, headers, _ = await _chat(gw.url, f"q{i}")
                assert status == 200 and headers["x-turbo-backend"] == "stable"
            assert len(canary.attempt_times) >= 1
            assert gw.metric("turbo_gateway_canary_fallbacks_total", reason="status_503") >= 1
            assert gw.idle("canary") and gw.idle("stable")


def test_canary_config_is_checked():
    import pytest

    from gateway.config import ConfigError, parse_config

    spec = _two_pools("http://127.0.0.1:1", "http://127.0.0.1:2", 0.1)
    spec["routing"]["canaries"][0]["canary_pool"] = "nowhere"
    with pytest.raises(ConfigError, match="no backend in pool 'nowhere' serves it"):
        parse_config(spec)
