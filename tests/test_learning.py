"""Routing that keeps learning (virtual time, routing/ only, no sockets): a backend that
was slow for a while is measured again and gets its share back, exploration stays
bounded, a cold fleet finds its fast backends, non-streamed answers teach speeds, and a
backend whose engine metrics stopped answering is uncertain, not idle."""

from __future__ import annotations

import random
from collections import Counter

from routing.core import BackendSpec, DecisionCore, EngineSample, RouteRequest
from routing.load import BackendLoad
from routing.policies.estimated_ttft import PROBE_AFTER_S, estimate_ttft
from tests.test_router_model import VirtualFleet


def _prompt(rng: random.Random) -> str:
    return rng.randbytes(4000).hex()  # no prefix shared between requests


def test_a_backend_slow_for_a_while_gets_its_share_back():
    # two identical backends, light load: one alone could serve it all, so once "b" looks
    # slow, nothing but exploration sends it a request
    vf = VirtualFleet({"a": 20000.0, "b": 20000.0}, seed=0, decode_s=0.3)
    vf.rates["b"] = 2000.0  # slowed 10x for its first 20 requests
    rng = random.Random(0)
    names: list[str] = []
    restored_at = None
    for i in range(5000):  # 1,000 s: one probe per PROBE_AFTER_S while it looks slow
        names.append(vf.submit(_prompt(rng), i * 0.2))
        if restored_at is None and names.count("b") == 20:
            vf.rates["b"] = 20000.0
            restored_at = i
    assert restored_at is not None, "the slowed backend was never measured again"
    later = Counter(names[restored_at + 500:restored_at + 1500])  # 100 s after the restoration
    assert abs(later["a"] - later["b"]) <= 0.2 * max(later["a"], later["b"]), later


def test_exploration_of_a_truly_slow_backend_stays_bounded():
    vf = VirtualFleet({"a": 20000.0, "b": 2000.0}, seed=1, decode_s=0.3)
    for b in vf.fleet.backends.values():
        b.load = BackendLoad()  # no hints: both look alike at first
    rng = random.Random(1)
    n, gap = 3000, 0.2
    for i in range(n):
        vf.submit(_prompt(rng), i * gap)
    probes_at_most = n * gap / PROBE_AFTER_S + 5  # one per probe period, a few while it was being learned
    assert vf.assigned.count("b") <= probes_at_most, vf.assigned.count("b")


def test_a_cold_fleet_finds_its_fast_backends_within_50_requests():
    shares = []
    for seed in range(3):
        vf = VirtualFleet({"f1": 40000.0, "f2": 40000.0, "s1": 4000.0, "s2": 4000.0}, seed=seed, decode_s=0.3)
        for b in vf.fleet.backends.values():
            b.load = BackendLoad()  # no hints
        rng = random.Random(seed)
        for i in range(50):
            vf.submit(_prompt(rng), i * 0.02)
        shares.append((vf.prefill_tokens["f1"] + vf.prefill_tokens["f2"]) / sum(vf.prefill_tokens.values()))
    assert min(shares) >= 0.6, shares


def test_a_request_waiting_longer_than_predicted_says_the_backend_is_slower():
    core = DecisionCore([BackendSpec("b", frozenset({"m"}), prefill_tokens_per_s=10000.0)], "estimated_ttft")
    b = core.fleet.backends["b"]
    _, req = core.request("m", "x" * 40000, 10)
    _, res = core.route(req, 0.0)  # 10k tokens: about 1 s at the hinted rate
    probe = RouteRequest("m", prompt_tokens=1000, output_tokens=10, now=0.5)
    on_time = estimate_ttft(b, probe)[0]
    probe.now = 5.0  # still no first token 5 s later: the backend is 5x slower than it was thought
    late = estimate_ttft(b, probe)[0]
    assert late > 3 * on_time
    res.release(5.0)


def test_non_streamed_answers_teach_the_backends_speeds():
    core = DecisionCore([BackendSpec("fast", frozenset({"m"})), BackendSpec("slow", frozenset({"m"}))],
                        "round_robin")
    rates = {"fast": 20000.0, "slow": 4000.0}
    t = 0.0
    for i in range(40):
        _, req = core.request("m", f"{i} " + "x" * 4000 * (1 + i % 5), 16)
        d, res = core.route(req, t)
        total = 0.005 + req.prompt_tokens / rates[d.backend.name] + 15 * 0.02
        res.release(t + total, 16, whole=True)  # a whole answer: its first byte is its last
        t += 1.0
    fast, slow = core.fleet.backends["fast"].load, core.fleet.backends["slow"].load
    assert fast.ttft_fit.samples == slow.ttft_fit.samples == 20
    assert slow.ttft_fit.predict(4000) > 2 * fast.ttft_fit.predict(4000)  # 4.9x in truth, 1x unlearned
    assert fast.itl_fit.samples == slow.itl_fit.samples == 20


def test_stale_engine_metrics_count_as_uncertain_not_idle():
    core = DecisionCore([BackendSpec("b", frozenset({"m"}), prefill_tokens_per_s=10000.0)], "estimated_ttft")
    load = core.fleet.backends["b"].load
    load.metrics_max_age_s = 6.0
    req = RouteRequest("m", prompt_tokens=1000, output_tokens=10, now=1.0)
    load.observe_engine(EngineSample(0.0, waiting=0.0, running=0.0, kv_usage=0.0))  # "idle", then silence
    fresh = estimate_ttft(core.fleet.backends["b"], req)[0]
    req.now = 30.0
    stale = estimate_ttft(core.fleet.backends["b"], req)[0]
    assert stale == 2 * fresh  # counted up to twice while its metrics are stale
    assert load.metrics_staleness(30.0) == 1.0 and load.metrics_staleness(1.0) == 0.0


async def test_a_slow_backend_with_hung_metrics_gets_no_more_than_its_share_of_whole_answers():
    """Real sockets: three backends answering whole (non-streamed) completions, one 5x
    slower whose /metrics answered "idle" once and then stopped answering; the others
    report one request waiting. It must not take more than its fair share."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from tests.servers import completion_body, gateway_config, running_gateway

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
        async with running_gateway(cfg) as gw, aiohttp.ClientSession() as s:
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
        slow = apps["slow"][SERVED]["n"]
        assert slow <= 150 // 3, {n: a[SERVED]["n"] for n, a in apps.items()}
    finally:
        hang.set()
        for runner in runners:
            await runner.cleanup()


async def test_stale_engine_metrics_show_in_the_route_header_and_the_metrics():
    import asyncio

    import aiohttp
    from aiohttp import web
    from prometheus_client.parser import text_string_to_metric_families

    from tests.servers import ScriptedBackend, gateway_config, running_gateway

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
