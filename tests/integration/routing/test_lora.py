"""Models and LoRA adapters: discovery from backends' /v1/models (models: auto), the
simulator's adapters (vLLM's endpoints, metric and scheduling), and LoRA-aware routing."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from gateway.config import ConfigError
from gateway.engine_signals.health_checks import parse_models_list
from loadtest.sim.engine import Engine
from loadtest.sim.profiles import get_profile
from loadtest.sim.server import SimBackendConfig, start_backends
from routing.core import ServedModel
from tests.support.servers import gateway_config, running_gateway, wait_until

VLLM_MODELS = {"object": "list", "data": [
    {"id": "llama", "object": "model", "owned_by": "vllm", "root": "/m/llama", "parent": None, "max_model_len": 8192},
    {"id": "sql-lora", "object": "model", "owned_by": "vllm", "root": "/a/sql", "parent": "llama",
     "max_model_len": None}]}
SGLANG_MODELS = {"object": "list", "data": [
    {"id": "qwen", "object": "model", "owned_by": "sglang", "root": "/m/qwen", "max_model_len": 32768}]}
LLAMACPP_MODELS = {"object": "list", "models": [{"name": "tiny.gguf", "model": "tiny.gguf"}], "data": [
    {"id": "tiny.gguf", "object": "model", "owned_by": "llamacpp", "meta": {"n_ctx_train": 2048, "n_vocab": 32000}}]}


def test_parse_models_list_reads_vllm_sglang_and_llamacpp_shapes():
    assert parse_models_list(VLLM_MODELS) == [ServedModel("llama", None, 8192), ServedModel("sql-lora", "llama")]
    assert parse_models_list(SGLANG_MODELS) == [ServedModel("qwen", None, 32768)]
    # llama.cpp's n_ctx_train is the training context, not the served one
    assert parse_models_list(LLAMACPP_MODELS) == [ServedModel("tiny.gguf")]
    odd = {"data": [{"id": ""}, {"id": 3}, "x", {"id": "a", "max_model_len": True}, {"id": "a"},
                    {"id": "b", "max_model_len": -1, "parent": "b"}]}
    assert parse_models_list(odd) == [ServedModel("a"), ServedModel("b")]
    for bad in ([], {"data": {}}, {"object": "list"}, "x"):
        with pytest.raises(ValueError, match="no `data` array"):
            parse_models_list(bad)


def test_models_auto_in_config():
    cfg = gateway_config([{"name": "a", "url": "http://127.0.0.1:1", "models": "auto"},
                          {"name": "b", "url": "http://127.0.0.1:2", "models": ["m", "auto"]}],
                         routing={"fallbacks": {"discovered-x": [{"model": "discovered-y"}]}})
    a, b = cfg.backends
    assert (a.discover, a.static_models, b.discover, b.static_models) == (True, [], True, ["m"])
    with pytest.raises(ConfigError, match="listed twice"):
        gateway_config([{"name": "a", "url": "http://127.0.0.1:1", "models": ["m", "m"]}])
    with pytest.raises(ConfigError, match=r"kv_events.base_model must be set"):
        gateway_config([{"name": "a", "url": "http://127.0.0.1:1", "models": "auto",
                         "kv_events": {"endpoint": "tcp://127.0.0.1:5557"}}])
    with pytest.raises(ConfigError, match="is served by no backend"):  # no backend discovers: checked
        gateway_config([{"name": "a", "url": "http://127.0.0.1:1", "models": ["m"]}],
                       routing={"fallbacks": {"m": [{"model": "n"}]}})


async def test_a_simulated_backend_with_models_auto_serves_the_simulators_model_and_adapters():
    """``models: [auto]`` on a ``simulate:`` backend: the simulator serves its default
    model, ``demo-model``, with the section's adapters, and ``auto`` discovers them all;
    its KV events (wired by the gateway) key base-model blocks under that model."""
    cfg = gateway_config([{"name": "s", "models": ["auto"], "simulate": {
        "speed": 50.0, "lora": {"adapters": ["ops-lora"], "load_s": 0.01}, "kv_events": {}}}],
        health={"interval_s": 0.05})
    assert cfg.backends[0].simulate_entry() == {"name": "s", "models": [], "simulate": cfg.backends[0].simulate}
    async with running_gateway(cfg) as gw, aiohttp.ClientSession() as s:
        fleet = gw.state.fleet
        await wait_until(lambda: {"demo-model", "ops-lora"} <= set(fleet.by_model))
        async with s.get(gw.url + "/v1/models") as r:
            cards = {m["id"]: m for m in (await r.json())["data"]}
        assert cards["ops-lora"]["parent"] == "demo-model" and "parent" not in cards["demo-model"]
        assert await _complete(s, gw.url, "ops-lora") == (200, "s")
        assert await _complete(s, gw.url, "demo-model") == (200, "s")
        assert gw.state.cfg.backends[0].kv_events.base_model == "demo-model"


async def _complete(s: aiohttp.ClientSession, url: str, model: str) -> tuple[int, str | None]:
    async with s.post(url + "/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 2}) as r:
        await r.read()
        return r.status, r.headers.get("x-turbo-backend")


async def test_adapters_loaded_and_unloaded_are_routed_without_reload():
    sims, urls = await start_backends([
        SimBackendConfig(name="b0", models=["base"], speed=50.0, lora={"adapters": ["a1"], "load_s": 0.05}),
        SimBackendConfig(name="b1", models=["base"], speed=50.0, lora={"adapters": [], "load_s": 0.05})])
    try:
        cfg = gateway_config([{"name": n, "url": urls[n], "models": "auto"} for n in ("b0", "b1")],
                             health={"interval_s": 0.05})
        async with running_gateway(cfg) as gw, aiohttp.ClientSession() as s:
            fleet = gw.state.fleet
            await wait_until(lambda: "a1" in fleet.by_model)
            async with s.get(gw.url + "/v1/models") as r:
                cards = {m["id"]: m for m in (await r.json())["data"]}
            assert cards["base"]["max_model_len"] == 4096 and "parent" not in cards["base"]
            # an adapter's context length is its base model's
            assert cards["a1"]["parent"] == "base" and cards["a1"]["max_model_len"] == 4096
            assert [b.name for b in fleet.by_model["a1"]] == ["b0"]
            assert await _complete(s, gw.url, "a1") == (200, "b0")
            assert (await _complete(s, gw.url, "a2"))[0] == 404

            async with s.post(urls["b1"] + "/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": "/a2"}) as r:
                assert r.status == 200
            await wait_until(lambda: "a2" in fleet.by_model)
            assert [b.name for b in fleet.by_model["a2"]] == ["b1"]
            assert await _complete(s, gw.url, "a2") == (200, "b1")

            async with s.post(urls["b0"] + "/v1/unload_lora_adapter", json={"lora_name": "a1"}) as r:
                assert r.status == 200
            await wait_until(lambda: "a1" not in fleet.by_model)
            assert (await _complete(s, gw.url, "a1"))[0] == 404
            async with s.get(gw.url + "/v1/models") as r:
                assert sorted(m["id"] for m in (await r.json())["data"]) == ["a2", "base"]
            assert sims[0].http_requests == 1  # the 404s were answered by the gateway
    finally:
        for b in sims:
            await b.cleanup()


async def test_a_backend_whose_models_cannot_be_read_keeps_the_last_ones():
    """An SGLang-shaped /v1/models served by a real server the test flips to 500."""
    answer = {"status": 200, "body": SGLANG_MODELS}

    async def models(request: web.Request) -> web.Response:
        return web.json_response(answer["body"], status=answer["status"])

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        cfg = gateway_config([{"name": "s", "url": url, "models": ["pinned", "auto"]}], health={"interval_s": 0.05})
        async with running_gateway(cfg) as gw:
            fleet, health = gw.state.fleet, gw.state.health
            await wait_until(lambda: "qwen" in fleet.by_model)
            assert fleet.models() == ["pinned", "qwen"] and fleet.describe("qwen").max_model_len == 32768
            answer["status"] = 500
            await wait_until(lambda: health.discovery_ok.get("s") is False)
            assert fleet.models() == ["pinned", "qwen"] and fleet.backends["s"].healthy
            answer.update(status=200, body={"object": "list", "data": []})
            await wait_until(lambda: health.discovery_ok.get("s") is True)
            await wait_until(lambda: "qwen" not in fleet.by_model)
            assert fleet.models() == ["pinned"]  # the configured model stays
    finally:
        await runner.cleanup()


def _lora_engine(max_loras: int, max_cpu_loras: int) -> Engine:
    e = Engine(get_profile("demo"), speed=1.0)
    e.enable_lora(max_loras, max_cpu_loras, load_s=0.5, swap_s=0.01)
    return e


def test_sim_engine_schedules_at_most_max_lora_adapters_per_batch():
    e = _lora_engine(1, 2)
    e.add_request("r1", [1, 2, 3], 4, arrival_time=0.0, lora="x")
    e.add_request("r2", [4, 5, 6], 4, arrival_time=0.0, lora="y")
    e.add_request("r3", [7, 8, 9], 4, arrival_time=0.0, lora="x")
    e.add_request("r4", [7, 8, 9], 4, arrival_time=0.0)  # the base model needs no slot
    dt, _ = e.step(0.0)
    assert sorted(r.req_id for r in e.running) == ["r1", "r3", "r4"]
    assert [r.req_id for r in e.waiting] == ["r2"]  # its adapter found no slot; it keeps its place
    assert e.lora_in_use() == ({"x"}, {"y"})
    assert e.lora_loads == 1 and dt >= 0.5  # x's weights were read in this step
    t = dt
    while e.has_work():
        t += e.step(t)[0]
    assert e.lora_loads == 2 and list(e.cpu_loras) == ["x", "y"]
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        Engine(get_profile("demo")).add_request("r", [1], 1, arrival_time=0.0, lora="x")


def test_sim_engine_reads_an_evicted_adapter_again():
    e = _lora_engine(1, 1)
    t = 0.0
    for i, name in enumerate(["x", "y", "x"]):
        e.add_request(f"r{i}", [1, 2, 3], 2, arrival_time=t, lora=name)
        while e.has_work():
            t += e.step(t)[0]
    assert e.lora_loads == 3  # host memory holds one adapter: x was evicted by y


async def test_sim_lora_endpoints_and_metric():
    sims, urls = await start_backends([SimBackendConfig(name="b0", models=["base"], speed=50.0,
                                                        lora={"adapters": ["a1"], "max_lora": 2})])
    u = urls["b0"]
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(u + "/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": "/a1"}) as r:
                assert r.status == 400 and "already been loaded" in (await r.json())["error"]["message"]
            async with s.post(u + "/v1/unload_lora_adapter", json={"lora_name": "zz"}) as r:
                assert r.status == 404
            async with s.post(u + "/v1/load_lora_adapter", json={}) as r:
                assert r.status == 400
            async with s.post(u + "/v1/completions", json={"model": "a1", "prompt": "hi", "max_tokens": 2}) as r:
                assert r.status == 200 and (await r.json())["model"] == "a1"
            async with s.get(u + "/metrics") as r:
                text = await r.text()
        line = next(x for x in text.splitlines() if x.startswith("vllm:lora_requests_info{"))
        assert 'max_lora="2"' in line and 'running_lora_adapters=""' in line
        assert "sim:lora_loads_total" in text
    finally:
        for b in sims:
            await b.cleanup()


def _lora_core(n: int, lora_load_s: float | None = None):
    from routing.core import BackendSpec, DecisionCore
    core = DecisionCore([BackendSpec(f"b{i}", frozenset(), discover=True, lora_load_s=lora_load_s)
                         for i in range(n)], "estimated_ttft")
    for b in core.fleet.backends.values():
        core.set_served_models(b, [ServedModel("base", None, 4096), ServedModel("x", "base"),
                                   ServedModel("y", "base")])
    return core


def _route(core, model: str, now: float = 1.0) -> str:
    _, req = core.request(model, "word " * 400, 16)
    decision, _ = core.route(req, now)
    return decision.backend.name


def test_an_adapter_stays_where_it_is_at_work_and_spreads_under_load():
    core = _lora_core(3)
    first = [_route(core, "x") for _ in range(10)]
    assert len(set(first)) == 1  # a load elsewhere costs more than this queue
    more = [_route(core, "x") for _ in range(60)]
    counts = {b: (first + more).count(b) for b in set(first + more)}
    assert len(counts) > 1  # its queue grew past the cost of a load: it spread
    # without a load cost, every request goes to the emptiest backend at once
    core = _lora_core(3, lora_load_s=0.0)
    assert len({_route(core, "x") for _ in range(3)}) == 3


def test_engine_reported_adapters_steer_routing():
    from routing.core import LoraActivity
    core = _lora_core(3)
    b = core.fleet.backends
    core.set_lora_activity(b["b2"], LoraActivity(frozenset({"x"}), frozenset(), 1, at=1.0))
    core.set_lora_activity(b["b0"], LoraActivity(frozenset({"y"}), frozenset(), 1, at=1.0))
    core.set_lora_activity(b["b1"], LoraActivity(frozenset(), frozenset(), 1, at=1.0))
    assert _route(core, "x") == "b2"  # already at work there
    assert _route(core, "y") == "b0"
    # b0 and b2 hold their one adapter slot: a third adapter's request goes to b1's free
    # slot although b1 carries more queued prefill (three base-model requests)
    for name in ("b0", "b1", "b2"):
        core.set_served_models(b[name], [*b[name].discovered.values(), ServedModel("z", "base")])
    for i in range(3):
        _, req = core.request("base", " ".join(f"w{i}-{j}" for j in range(400)), 16)  # no shared prefix
        core.reserve(req, b["b1"], 1.0)
    assert b["b1"].load.queued_prefill_tokens > 3 * b["b0"].load.queued_prefill_tokens
    assert _route(core, "z") == "b1"
    # stale engine metrics are not believed: only this process's own streams count
    assert b["b2"].active_adapters(1.0 + 60.0) == ({"x"}, None)


def _estimates(core, model: str, prompt: str, now: float):
    """A request for ``model`` and every backend's estimated TTFT for it at ``now`` (s),
    as the policy will see them when it is routed at ``now``."""
    from routing.policies.estimated_ttft import estimate_ttft
    _, req = core.request(model, prompt, 16)
    match = core.router.match(req, now)  # the match route makes at ``now``
    return req, {b.name: estimate_ttft(b, req, match)[0] for b in core.fleet.backends.values()}


def _one_at_a_time(core, adapter: str, n: int, start: float) -> list[str]:
    """Route ``n`` requests for ``adapter``, one a second from ``start``, each ending
    before the next comes; the backends that served them."""
    served = []
    for i in range(n):
        now = start + i
        _, req = core.request(adapter, "word " * 400, 16)
        decision, res = core.route(req, now)
        res.first_token(now + 0.05)
        res.release(now + 0.5, 16)
        served.append(decision.backend.name)
    return served


def test_a_lightly_loaded_adapter_stays_on_one_backend_and_the_same_one_everywhere():
    homes = set()
    for _ in range(2):  # two gateway replicas, sharing nothing
        core = _lora_core(4)
        served = _one_at_a_time(core, "x", 40, 1.0)
        assert len(set(served)) == 1
        assert core.fleet.adapter_sets.members("x") == (served[0],)
        homes.add(served[0])
    assert len(homes) == 1  # an idle fleet's tie goes to the adapter's rendezvous choice


def test_an_adapter_set_grows_only_past_a_load_and_shrinks_when_load_falls():
    from routing.lora import share_bound
    core = _lora_core(4)
    sets = core.fleet.adapter_sets
    load_s = core.fleet.backends["b0"].load.lora_load_s
    held, reasons, sizes = [], [], []
    for i in range(80):  # heavy load: none of these requests ends
        members = sets.members("x")
        req, est = _estimates(core, "x", f"request {i} " + "word " * 400, 1.0)
        decision, res = core.route(req, 1.0)
        held.append(res)
        reasons.append(decision.reason)
        chosen = decision.backend.name
        if members:
            best_in = min(est[m] for m in members)
            best_out = min([t for name, t in est.items() if name not in members], default=None)
            # x is all the traffic: its share of the requests never stops the set growing
            assert share_bound("x", [(None, b) for b in core.fleet.backends.values()]) == 4
            if chosen in members:  # the set was not saturated: an outsider had not won by a load
                assert best_out is None or best_in - best_out <= load_s
                assert est[chosen] <= best_in * 1.02 + 0.0005
            else:  # the best outsider won by more than a load on top of its own
                assert best_in - best_out > load_s and est[chosen] == best_out
        sizes.append(len(sets.members("x")))
    assert sizes[0] == 1 and sizes == sorted(sizes) and sizes[-1] >= 3  # grew with the queue, never shrank
    assert reasons[0] == "adapter_home" and "adapter_grow" in reasons and "adapter_set" in reasons
    grown = sets.members("x")
    for res in held:  # the load falls: every request ends
        res.first_token(2.0)
        res.release(3.0, 16)
    served = _one_at_a_time(core, "x", len(grown) + 5, 4.0)  # light load again
    (kept,) = sets.members("x")  # one idle member left per request, down to one
    assert kept in grown and served[-5:] == [kept] * 5


def test_an_adapter_with_a_small_share_grows_only_off_an_overloaded_backend():
    core = _lora_core(4)
    b = core.fleet.backends
    decision, _ = core.route(core.request("y", "word " * 400, 16)[1], 1.0)
    home = decision.backend.name
    assert decision.reason == "adapter_home"

    def base(name: str, words: int, n: int) -> None:
        for i in range(n):
            _, req = core.request("base", " ".join(f"{name}{i}-{j}" for j in range(words)), 16)
            core.reserve(req, b[name], 1.0)

    # the home's queue is long (long prompts) but it holds no more requests than the others
    base(home, 4000, 3)
    for name in b:
        if name != home:
            base(name, 50, 4)
    req, est = _estimates(core, "y", "word " * 400, 1.0)
    outside = min(t for name, t in est.items() if name != home)
    assert est[home] - outside > b[home].load.lora_load_s  # saturated: the queues alone would grow the set
    decision, _ = core.route(req, 1.0)
    assert (decision.backend.name, decision.reason) == (home, "adapter_set")  # y's share fits on one backend
    # now the home holds far more requests than the mean: the set may grow
    base(home, 50, 12)
    decision, _ = core.route(core.request("y", "word " * 400, 16)[1], 1.0)
    assert decision.reason == "adapter_grow" and decision.backend.name != home
    assert core.fleet.adapter_sets.members("y") == (home, decision.backend.name)


def test_a_base_model_request_is_routed_by_its_estimate_alone():
    core = _lora_core(3)
    held = [core.route(core.request("x", "word " * 400, 16)[1], 1.0)[1] for _ in range(6)]
    assert len(core.fleet.adapter_sets.members("x")) >= 1
    for i in range(9):
        req, est = _estimates(core, "base", f"base {i} " * 200, 1.0)
        decision, res = core.route(req, 1.0)
        held.append(res)
        assert core.router.match(req, 1.0).adapter_set is None and decision.reason in {"least_load", "tie",
                                                                                        "prefix_hit"}
        assert est[decision.backend.name] <= min(est.values()) * 1.02 + 0.0005
    assert "base" not in core.fleet.adapter_sets.sets


async def test_an_adapter_gathers_spreads_and_gathers_again_on_simulated_engines():
    """Through the gateway, on three simulated vLLM engines serving adapter a1: one
    request at a time stays on one backend; a burst of concurrent requests spreads it;
    once they all ended, requests one at a time bring it back to one backend."""
    import asyncio

    from loadtest.sim.fleet import profile_hints

    specs = [SimBackendConfig(name=f"b{i}", models=["base"], speed=0.2,
                              lora={"adapters": ["a1"], "max_lora": 2, "load_s": 0.0}) for i in range(3)]
    sims, urls = await start_backends(specs)
    try:
        cfg = gateway_config([{"name": c.name, "url": urls[c.name], "models": "auto", "hints": profile_hints(c)}
                              for c in specs],
                             health={"interval_s": 0.05},
                             routing={"policy": "estimated_ttft", "scrape_interval_s": 0})
        async with running_gateway(cfg) as gw, aiohttp.ClientSession() as s:
            fleet = gw.state.fleet
            await wait_until(lambda: len(fleet.by_model.get("a1", ())) == 3)

            async def complete(i: int) -> str:
                body = {"model": "a1", "prompt": f"request {i} " + "word " * 300, "max_tokens": 4, "stream": True}
                async with s.post(gw.url + "/v1/completions", json=body) as r:
                    await r.read()
                    assert r.status == 200
                    return r.headers["x-turbo-backend"]

            light = [await complete(i) for i in range(6)]
            assert len(set(light)) == 1 and fleet.adapter_sets.members("a1") == (light[0],)
            burst = await asyncio.gather(*(complete(100 + i) for i in range(24)))
            assert len(set(burst)) > 1 and len(fleet.adapter_sets.members("a1")) > 1
            await wait_until(lambda: all(b.in_flight == 0 for b in fleet.backends.values()))
            after = [await complete(200 + i) for i in range(6)]
            assert len(fleet.adapter_sets.members("a1")) == 1 and len(set(after[-3:])) == 1
    finally:
        for b in sims:
            await b.cleanup()


def test_scraper_reads_the_latest_lora_requests_info_series():
    from gateway.engine_signals.metrics_scraper import parse_engine_metrics
    text = """# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters="c",waiting_lora_adapters="d,e"} 1.8e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.6e9
"""
    m = parse_engine_metrics(text)
    assert (m.lora_running, m.lora_waiting, m.max_lora) == ({"c"}, {"d", "e"}, 4)
    assert parse_engine_metrics("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n").lora_running \
        is None  # not a LoRA engine: nothing said


async def test_gateway_scrapes_the_adapters_at_work_on_a_simulated_vllm():
    sims, urls = await start_backends([SimBackendConfig(name="b0", models=["base"], speed=1.0,
                                                        lora={"adapters": ["a1"], "max_lora": 2})])
    try:
        cfg = gateway_config([{"name": "b0", "url": urls["b0"], "models": "auto"}],
                             health={"interval_s": 0.05}, routing={"policy": "estimated_ttft",
                                                                    "scrape_interval_s": 0.05})
        async with running_gateway(cfg) as gw, aiohttp.ClientSession() as s:
            backend = gw.state.fleet.backends["b0"]
            await wait_until(lambda: "a1" in gw.state.fleet.by_model)
            body = {"model": "a1", "prompt": "hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
            async with s.post(gw.url + "/v1/completions", json=body) as r:
                assert r.status == 200
                await r.content.readline()  # the stream has started: the engine runs a1
                await wait_until(lambda: backend.lora is not None and "a1" in backend.lora.running)
                assert backend.lora.max_lora == 2 and backend.adapter_streams == {"a1": 1}
            await wait_until(lambda: backend.in_flight == 0)
            assert backend.adapter_streams == {}
    finally:
        for b in sims:
            await b.cleanup()


async def test_a_prompt_that_cannot_fit_is_refused_before_it_is_sent():
    """With the model's tokenizer (exact counts) and its max_model_len read from the
    backend's /v1/models, a prompt too long for every backend gets OpenAI's 400
    ``context_length_exceeded`` from the gateway; the engine never sees it."""
    import openai

    from routing.tokenizer import load_tokenizer
    from tests.support.chat_cases import TINY

    sims, urls = await start_backends([SimBackendConfig(name="s", models=["tiny"], speed=50.0,
                                                        profile_overrides={"max_model_len": 256})])
    try:
        cfg = gateway_config([{"name": "s", "url": urls["s"], "models": "auto"}], health={"interval_s": 0.05},
                             models={"tiny": {"tokenizer": str(TINY)}})
        async with running_gateway(cfg) as gw:
            await wait_until(lambda: gw.state.fleet.context_limit("tiny") == 256)
            tok = load_tokenizer(TINY)
            prompt = "word " * 300
            n = len(tok.encode(prompt, True))
            assert n > 256
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
            async with client:
                with pytest.raises(openai.BadRequestError) as e:
                    await client.completions.create(model="tiny", prompt=prompt, max_tokens=4)
                err = e.value.body
                assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
                assert "maximum context length is 256 tokens" in err["message"] and f"({n} in the" in err["message"]
                short = "word " * 100
                m = len(tok.encode(short, True))
                with pytest.raises(openai.BadRequestError, match="maximum context length"):  # prompt fits, output not
                    await client.completions.create(model="tiny", prompt=short, max_tokens=256 - m + 1)
                r = await client.completions.create(model="tiny", prompt=short, max_tokens=256 - m)  # exactly fits
                assert r.usage.prompt_tokens == m
            assert sims[0].http_requests == 1  # only the one that fit reached the engine
    finally:
        for b in sims:
            await b.cleanup()


def test_the_context_limit_is_known_only_when_every_backend_reports_it():
    from routing.core import BackendSpec, DecisionCore
    core = DecisionCore([BackendSpec("a", frozenset(), discover=True), BackendSpec("b", frozenset(), discover=True)],
                        "round_robin")
    a, b = core.fleet.backends["a"], core.fleet.backends["b"]
    core.set_served_models(a, [ServedModel("m", None, 1000), ServedModel("x", "m")])
    core.set_served_models(b, [ServedModel("m")])
    assert core.fleet.context_limit("m") is None and core.context_exceeded("m", 5000, None) is None
    core.set_served_models(b, [ServedModel("m", None, 2000)])
    assert core.fleet.context_limit("m") == 2000  # it fits on b: not refused
    assert core.context_exceeded("m", 1999, None) is None and core.context_exceeded("m", 2000, None) == 2000
    assert core.context_exceeded("m", 1000, 1000) is None and core.context_exceeded("m", 1000, 1001) == 2000
    assert core.fleet.context_limit("x") == 1000  # an adapter's is its parent's
    assert core.fleet.context_limit("nope") is None


async def test_an_adapter_is_loaded_on_demand_once_and_then_routed_there():
    """``lora.dynamic``: the gateway loads an adapter named in ``models`` on the backend
    routing chose (vLLM's /v1/load_lora_adapter on a simulated engine), once for
    concurrent requests, and keeps sending it there."""
    import asyncio

    sims, urls = await start_backends([
        SimBackendConfig(name=f"b{i}", models=["base"], speed=20.0, lora={"load_s": 0.5}) for i in range(2)])
    try:
        cfg = gateway_config([{"name": n, "url": urls[n], "models": ["base"], "lora": {"dynamic": True}}
                              for n in ("b0", "b1")],
                             routing={"policy": "estimated_ttft"}, health={"interval_s": 0.05},
                             models={"sql": {"lora": {"base": "base", "path": "/adapters/sql"}}})
        async with running_gateway(cfg) as gw, aiohttp.ClientSession() as s:
            async with s.get(gw.url + "/v1/models") as r:
                assert {m["id"] for m in (await r.json())["data"]} == {"base", "sql"}
            first = await asyncio.gather(*(_complete(s, gw.url, "sql") for _ in range(3)))
            assert [st for st, _ in first] == [200] * 3
            served = {b for _, b in first}
            assert len(served) == 1  # one load, and the requests that waited for it went with it
            (name,) = served
            sim = sims[int(name[1])]
            assert list(sim.lora_adapters) == ["sql"] and not sims[1 - int(name[1])].lora_adapters
            assert [await _complete(s, gw.url, "sql") for _ in range(3)] == [(200, name)] * 3
            assert sim.engine.lora_loads == 1  # read once, by the load
            # the backend restarts without it: the next read of its /v1/models says so, and it is loaded again
            await sim.crash(0.0)
            backend = gw.state.fleet.backends[name]
            await wait_until(lambda: backend.served("sql") is None)
            assert (await _complete(s, gw.url, "sql"))[0] == 200
            assert "sql" in sims[0].lora_adapters or "sql" in sims[1].lora_adapters
    finally:
        for b in sims:
            await b.cleanup()


async def test_a_failed_adapter_load_is_retried_on_another_backend():
    sims, urls = await start_backends([SimBackendConfig(name="b0", models=["base"], speed=20.0),  # no LoRA: 404
                                       SimBackendConfig(name="b1", models=["base"], speed=20.0, lora={})])
    try:
        cfg = gateway_config([{"name": n, "url": urls[n], "models": ["base"], "lora": {"dynamic": True}}
                              for n in ("b0", "b1")], routing={"policy": "round_robin"},
                             models={"sql": {"lora": {"base": "base", "path": "/adapters/sql"}}})
        async with running_gateway(cfg) as gw, aiohttp.ClientSession() as s:
            results = [await _complete(s, gw.url, "sql") for _ in range(2)]
            assert results == [(200, "b1"), (200, "b1")]
            assert gw.metric("turbo_gateway_retries_total", reason="lora_load") >= 1
    finally:
        for b in sims:
            await b.cleanup()


def test_adapter_config_is_checked():
    with pytest.raises(ConfigError, match=r"no backend has `lora.dynamic: true`"):
        gateway_config([{"name": "a", "url": "http://127.0.0.1:1", "models": ["base"]}],
                       models={"sql": {"lora": {"base": "base", "path": "/x"}}})
    with pytest.raises(ConfigError, match="base model 'nope' of adapter 'sql'"):
        gateway_config([{"name": "a", "url": "http://127.0.0.1:1", "models": ["base"], "lora": {"dynamic": True}}],
                       models={"sql": {"lora": {"base": "nope", "path": "/x"}}})


async def _discovery_log(caplog, base: str, level: str, served: str) -> list[str]:
    """What the health checker logs at ``level`` once an auto backend serving ``base``
    lists ``served``, with adapter ``sql`` (of base model ``base``) loadable on demand."""
    sims, urls = await start_backends([SimBackendConfig(name="b0", models=["base"], speed=20.0, lora={})])
    try:
        cfg = gateway_config([{"name": "b0", "url": urls["b0"], "models": "auto", "lora": {"dynamic": True}}],
                             models={"sql": {"lora": {"base": base, "path": "/adapters/sql"}}})
        caplog.set_level(level, logger="gateway.engine_signals.health_checks")
        async with running_gateway(cfg) as gw:
            await wait_until(lambda: served in gw.state.fleet.backends["b0"].models())
            return [r.getMessage() for r in caplog.records
                    if r.name == "gateway.engine_signals.health_checks" and r.levelname == level]
    finally:
        for b in sims:
            await b.cleanup()


async def test_the_discovery_log_tells_listed_models_from_adapters_it_may_load(caplog):
    said = await _discovery_log(caplog, "base", "INFO", "sql")
    assert "backend b0 now serves base (and may load on demand: sql)" in said


async def test_an_adapter_whose_base_no_backend_serves_is_logged(caplog):
    said = await _discovery_log(caplog, "bsae", "WARNING", "base")
    assert said == [("LoRA adapter sql is served by no backend: no backend that may load it lists its base "
                     "model bsae (see models.sql.lora.base)")]
