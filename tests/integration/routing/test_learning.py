"""Routing that keeps learning, over real sockets on 127.0.0.1: a slow backend whose
engine metrics hung gets no more than its share, stale engine metrics show in the route
header and the metrics, and a cold gateway reads its engines' prefill rates."""

from __future__ import annotations


async def hung_metrics_share(stack) -> tuple[int, dict[str, int]]:
    """Real sockets: three backends answering whole (non-streamed) completions, one 5x
    slower whose /metrics answered "idle" once and then stopped answering; the others
    report one request waiting. 150 requests, 3 at a time, through the data plane that
    ``stack(cfg)`` starts (an async context manager yielding an object with ``url``).
    Returns the slow backend's count and every backend's."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from tests.support.servers import completion_body, gateway_config

    hang = asyncio.Event()
    SERVED = web.AppKey("served", dict)

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    def backend(delay_s: float, waiting: float, hangs: bool) -> web.Application:
        served = {"n": 0}

        async def chat(request: web.Request) -> web.Response:
            await request.read()
            served["n"] += 1
            await asyncio.sleep(delay_s)
            return web.json_response(completion_body("ok"))

        async def metrics(request: web.Request) -> web.Response:
            if hangs and metrics.calls:
                await hang.wait()  # too busy to answer (released at the end of the test)
            metrics.calls += 1
            return web.Response(text=f"vllm:num_requests_waiting {waiting}\nvllm:num_requests_running 0\n")

        metrics.calls = 0
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/health", ok)
        app[SERVED] = served
        return app

    apps = {"f1": backend(0.02, 1, False), "f2": backend(0.02, 1, False), "slow": backend(0.1, 0, True)}
    runners, urls = [], {}
    try:
        for name, app in apps.items():
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            urls[name] = f"http://127.0.0.1:{runner.addresses[0][1]}"
        cfg = gateway_config([{"name": n, "url": u, "models": ["m"]} for n, u in urls.items()],
                             routing={"policy": "estimated_ttft", "scrape_interval_s": 0.1})
        async with stack(cfg) as gw, aiohttp.ClientSession() as s:
            await asyncio.sleep(0.05)  # the first scrape: every backend's first sample
            sem = asyncio.Semaphore(3)

            async def one(i: int) -> None:
                async with sem:
                    async with s.post(gw.url + "/v1/chat/completions",
                                      json={"model": "m", "max_tokens": 8,
                                            "messages": [{"role": "user", "content": f"q{i} " + "x" * 2000}]}) as r:
                        assert r.status == 200
                        await r.read()

            await asyncio.gather(*(one(i) for i in range(150)))
        return apps["slow"][SERVED]["n"], {n: a[SERVED]["n"] for n, a in apps.items()}
    finally:
        hang.set()
        for runner in runners:
            await runner.cleanup()


async def test_a_slow_backend_with_hung_metrics_gets_no_more_than_its_share_of_whole_answers():
    from tests.support.servers import running_gateway

    slow, served = await hung_metrics_share(running_gateway)
    assert slow <= 150 // 3, served


async def test_stale_engine_metrics_show_in_the_route_header_and_the_metrics():
    import asyncio

    import aiohttp
    from aiohttp import web
    from prometheus_client.parser import text_string_to_metric_families

    from tests.support.servers import ScriptedBackend, gateway_config, running_gateway

    answered, release = asyncio.Event(), asyncio.Event()

    async def metrics(request: web.Request) -> web.Response:
        if answered.is_set():
            await release.wait()  # answered once, then stopped answering (until the test ends)
        answered.set()
        return web.Response(text="vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n")

    async with ScriptedBackend().running() as be:
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        murl = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            cfg = gateway_config([{"name": "b", "url": be.url, "models": ["m"]}],
                                 routing={"policy": "estimated_ttft", "scrape_interval_s": 0.05})
            async with running_gateway(cfg) as gw:
                gw.state.clients["b"].base_url = murl  # the scraper reads this engine's /metrics
                load = gw.state.fleet.backends["b"].load
                while load.engine is None or not load.metrics_staleness(asyncio.get_running_loop().time()):
                    await asyncio.sleep(0.05)  # bounded by the test's timeout: staleness comes within 0.3 s
                async with aiohttp.ClientSession() as s:
                    async with s.post(gw.url + "/v1/chat/completions",
                                      json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}) as r:
                        assert r.status == 200 and "metrics_stale=1" in r.headers["x-turbo-route"]
                    async with s.get(gw.url + "/metrics") as r:
                        text = await r.text()
                ages = [smp.value for fam in text_string_to_metric_families(text) for smp in fam.samples
                        if smp.name == "turbo_gateway_backend_metrics_age_seconds"]
                assert ages and ages[0] > 0.15  # older than 3 scrape intervals
        finally:
            release.set()
            await runner.cleanup()


async def test_a_cold_gateway_reads_its_engines_prefill_rates_and_sends_its_first_requests_to_the_fast_pair():
    """Real sockets: four simulated vLLM backends, two 10x faster than the others, that
    already served traffic (not through this gateway). The gateway starts cold, no
    hints; its scraper reads each engine's prefill counters from /metrics, and its first
    requests go to the fast pair."""
    import asyncio

    import aiohttp

    from loadtest.sim.server import SimBackendConfig, start_backends
    from tests.support.servers import gateway_config, running_gateway, wait_until

    speeds = {"f1": 10.0, "f2": 10.0, "s1": 1.0, "s2": 1.0}
    backends, urls = await start_backends([SimBackendConfig(name=n, models=["m"], profile="demo", speed=v)
                                           for n, v in speeds.items()])
    prompt = "word " * 1500  # 1,500 tokens: 60 ms of prefill at speed 1, 6 ms at speed 10
    try:
        async with aiohttp.ClientSession() as s:
            async def direct(url: str, i: int) -> None:  # another client's traffic, before the gateway
                async with s.post(url + "/v1/chat/completions",
                                  json={"model": "m", "max_tokens": 2,
                                        "messages": [{"role": "user", "content": f"warm {i} {prompt}"}]}) as r:
                    assert r.status == 200
                    await r.read()

            await asyncio.gather(*(direct(u, i) for u in urls.values() for i in range(4)))
            cfg = gateway_config([{"name": n, "url": u, "models": ["m"]} for n, u in urls.items()],
                                 routing={"policy": "estimated_ttft", "scrape_interval_s": 0.05})
            async with running_gateway(cfg) as gw:
                fleet = gw.state.fleet.backends
                await wait_until(lambda: all(b.load.prior_from == "engine" for b in fleet.values()))
                rates = {n: b.load.prefill_tokens_per_s for n, b in fleet.items()}
                assert min(rates["f1"], rates["f2"]) > 3 * max(rates["s1"], rates["s2"]), rates
                sem = asyncio.Semaphore(4)
                chosen: list[str] = []

                async def one(i: int) -> None:
                    async with sem:
                        async with s.post(gw.url + "/v1/chat/completions",
                                          json={"model": "m", "max_tokens": 2,
                                                "messages": [{"role": "user", "content": f"q{i} {prompt}"}]}) as r:
                            assert r.status == 200
                            await r.read()
                            route = dict(p.strip().split("=", 1) for p in r.headers["x-turbo-route"].split(";"))
                            chosen.append(route["backend"])

                # the first four at once, before any answer: the engines' rates alone decide
                await asyncio.gather(*(one(i) for i in range(4)))
                assert all(n.startswith("f") for n in chosen), chosen  # cold, without them: one on each
                await asyncio.gather(*(one(i) for i in range(4, 16)))
        assert sum(1 for n in chosen if n.startswith("f")) >= 14, chosen  # of the first 16: 16 when written
    finally:
        for b in backends:
            await b.cleanup()
