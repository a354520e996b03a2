"""Routing that keeps learning (virtual time, routing/ only, no sockets): a backend that
was slow for a while is measured again and gets its share back, exploration stays
bounded, a cold fleet finds its fast backends, non-streamed answers teach speeds, and a
backend whose engine metrics stopped answering is uncertain, not idle."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from routing.core import BackendSpec, BackendState, DecisionCore, EngineSample, RouteRequest
from routing.load import BackendLoad
from routing.policies.estimated_ttft import PROBE_AFTER_S, estimate_ttft
from tests.unit.routing.test_router_model import VirtualFleet


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

    from tests.support.servers import completion_body, gateway_config, running_gateway

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


def _lifetime_counters(rate: float, tokens: float = 2e6) -> tuple[float, float]:
    """An engine's prefill counters (seconds, uncached tokens) after it prefilled
    ``tokens`` at ``rate`` tokens/s."""
    return tokens / rate, tokens


def _cold_fleet_first_requests(engine_metrics: bool, seed: int, n: int = 20) -> list[str]:
    rates = {"f1": 40000.0, "f2": 40000.0, "s1": 4000.0, "s2": 4000.0}
    vf = VirtualFleet(rates, seed=seed, decode_s=0.3)
    for name, b in vf.fleet.backends.items():
        b.load = BackendLoad()  # no hints
        if engine_metrics:  # the scraper's first sample, before any request
            b.load.observe_engine_prefill(0.0, *_lifetime_counters(rates[name]))
    rng = random.Random(seed)
    for i in range(n):
        vf.submit(_prompt(rng), 0.1 + i * 0.02)
    return vf.assigned


def test_a_cold_fleet_whose_engines_show_their_rates_sends_its_first_requests_to_the_fast_pair():
    for seed in range(3):
        first = _cold_fleet_first_requests(True, seed)
        fast = sum(1 for n in first if n.startswith("f"))
        assert fast == 20, (seed, first)  # all of the first 20


def test_a_cold_fleet_without_engine_metrics_tries_its_slow_pair_first():
    # the reference of the test above: with nothing known, the slow pair gets some of
    # the first requests (2 or 3 of 20) before their waits tell it apart
    for seed in range(3):
        first = _cold_fleet_first_requests(False, seed)
        assert any(n.startswith("s") for n in first[:6]), (seed, first)


def test_engine_prefill_rate_seeds_a_backend_and_teaches_it_while_it_gets_no_traffic():
    load = BackendLoad()
    load.observe_engine_prefill(10.0, 0.0, 0.0)  # an engine that has prefilled nothing says nothing
    assert load.prior_from == "default" and load.engine_prefill_tokens_per_s is None
    load.observe_engine_prefill(12.0, 5.0, 50_000.0)  # 10k tokens/s since it started
    assert load.prior_from == "engine" and load.ttft_fit.samples == 0
    assert load.prefill_tokens_per_s == pytest.approx(10_000.0)
    load.observe_ttft(2000.0, 0.02 + 2000.0 / 10_000.0, now=13.0)  # a request of ours
    load.observe_engine_prefill(14.0, 6.0, 60_000.0)  # ours came since the last scrape: not taught
    assert load.ttft_fit.samples == 1
    load.observe_engine_prefill(16.0, 6.5, 70_000.0)  # none of ours since: 20k tokens/s is taught
    assert load.ttft_fit.samples == 2 and load.engine_prefill_tokens_per_s == pytest.approx(20_000.0)
    load.observe_engine_prefill(18.0, 1.0, 5_000.0)  # counters went back: the engine restarted
    assert load.engine_prefill_tokens_per_s == pytest.approx(5_000.0)
    for bad in (float("nan"), -1.0, float("inf")):
        load.observe_engine_prefill(20.0, bad, 1000.0)  # ignored, not a crash
    assert load.engine_prefill_tokens_per_s == pytest.approx(5_000.0)


def test_a_hint_outranks_the_engine_rate_as_the_prior():
    load = BackendLoad(prefill_tokens_per_s=10_000.0)
    load.observe_engine_prefill(0.0, *_lifetime_counters(30_000.0))
    assert load.prior_from == "hint" and load.ttft_fit.prior_slope == pytest.approx(1 / 10_000.0)
    assert load.ttft_fit.samples == 1  # the engine's rate is a sample instead
    assert 10_000.0 < load.prefill_tokens_per_s < 30_000.0


def test_an_engine_rate_below_the_fit_teaches_nothing():
    # requests prefilled together each count their shared steps: the engine's rate is a
    # lower bound, and a lower bound below the estimate says nothing new
    load = BackendLoad(prefill_tokens_per_s=30_000.0)
    load.observe_engine_prefill(0.0, *_lifetime_counters(10_000.0))
    assert load.ttft_fit.samples == 0 and load.prefill_tokens_per_s == pytest.approx(30_000.0)


def test_a_new_backend_starts_from_its_pool_peers_speed():
    vf = VirtualFleet({"a": 20000.0, "b": 20000.0}, seed=0, decode_s=0.3)
    for b in vf.fleet.backends.values():
        b.load = BackendLoad()  # no hints
    rng = random.Random(0)
    for i in range(40):
        vf.submit(_prompt(rng), i * 0.2)
    new = BackendState(BackendSpec("c", frozenset({"m"}), weight=2.0))  # a scale-out, twice as big
    vf.fleet.backends["c"] = new
    vf.router.refresh_speeds(10.0)
    peers = sorted(1.0 / b.load.ttft_fit.slope for n, b in vf.fleet.backends.items() if n != "c")
    assert new.load.prior_from == "peers"
    assert new.load.prefill_tokens_per_s == pytest.approx(2 * peers[0], rel=1e-6)


def _engine_counters_after(counters: dict[str, list[float]], name: str, rate: float, tokens: float) -> tuple:
    c = counters[name]
    c[0] += tokens / rate
    c[1] += tokens
    return tuple(c)


def test_a_backend_without_our_traffic_whose_engine_got_faster_wins_traffic_back():
    """Two identical backends; "b" is slow from 20 s to 80 s of virtual time, then as
    fast as before. Its engine serves other clients all along, so its metrics show its
    prefill rate. While slow it gets none of our traffic; once its metrics show it fast
    again it gets its share back within a few scrapes, without waiting for the next
    silence probe (one every 30 s while it looks slow)."""
    def run(engine_metrics: bool) -> tuple[list[str], list[str], list[float]]:
        vf = VirtualFleet({"a": 20000.0, "b": 20000.0}, seed=0, decode_s=0.3)
        for b in vf.fleet.backends.values():
            b.load = BackendLoad()
        counters = {"a": [0.0, 0.0], "b": [0.0, 0.0]}
        rng = random.Random(0)
        times = []
        for i in range(600):  # 120 s, a request every 0.2 s
            t = i * 0.2
            if t == 20.0:
                vf.rates["b"] = 2000.0
            elif t == 80.0:
                vf.rates["b"] = 20000.0
            if engine_metrics and i % 10 == 0:  # a scrape every 2 s; others' traffic: 10k tokens per interval
                for name, b in vf.fleet.backends.items():
                    b.load.observe_engine_prefill(t, *_engine_counters_after(counters, name, vf.rates[name], 1e4))
            vf.submit(_prompt(rng), t)
            times.append(t)
        return vf.assigned, vf.reasons, times

    names, reasons, times = run(True)
    slow = [n for n, t in zip(names, times) if 30.0 <= t < 80.0]
    assert slow.count("b") <= 2, slow.count("b")  # starved but for its silence probes
    after = [n for n, t in zip(names, times) if 80.0 <= t < 90.0]
    assert after.count("b") >= 10, after  # of 50, within 10 s (5 scrapes): 15 when written
    # without engine metrics, the same 10 s give it at most a probe
    names, reasons, times = run(False)
    assert [n for n, t in zip(names, times) if 80.0 <= t < 90.0].count("b") <= 1


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


def test_a_cold_replica_starts_from_what_another_replica_learned():
    # the shared store's RemoteLoad.speeds: (prefill tokens/s, overhead s, ITL base s, ITL per stream s, samples)
    load = BackendLoad()
    load.remote.speeds = [(30_000.0, 0.01, 0.015, 0.0002, 200)]
    assert load.prefill_tokens_per_s == pytest.approx((2 * 8000.0 + 200 * 30_000.0) / 202)  # its 2 prior samples
    load.observe_engine_prefill(0.0, *_lifetime_counters(25_000.0))  # its engine's rate seeds its own prior
    assert load.prefill_tokens_per_s == pytest.approx((2 * 25_000.0 + 200 * 30_000.0) / 202)
