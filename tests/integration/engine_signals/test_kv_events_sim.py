"""End to end: the gateway in front of simulated engines (loadtest/sim) that publish
KV-cache events in vLLM's wire format, over real HTTP and ZMQ on 127.0.0.1.

The precise index holds the blocks an engine stored, for that backend and no other; a
repeated prefix goes to its holder and the ``cached_tokens`` the engine reports equals
the gateway's prediction to the block; blocks another client put in an engine are
known too; an engine restart clears that backend's entries. Also the real vLLM 0.32
payloads of ``tests/support/data/vllm_kv_events`` decode as the engine sent them."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest
import yaml

from gateway.config import load_config
from gateway.ops.config_reload import apply_config
from loadtest.sim.server import SimBackend, start_backends
from loadtest.sim.spec import SimBackendConfig
from routing.estimate import chain_seed, token_block_keys
from routing.kv_event_decoding import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from routing.prefix_index import PRECISE
from tests.support.servers import gateway_config, running_gateway, wait_until

ROOT = Path(__file__).resolve().parents[3]
GOLDEN = ROOT / "tests" / "support" / "data" / "vllm_kv_events"
MODEL = "sim-model"
BS = 16


def test_real_vllm_0_32_payloads_decode():
    stored = decode_batch((GOLDEN / "block_stored.msgpack").read_bytes())
    assert stored.undecodable == 0 and stored.data_parallel_rank == 0
    (ev,) = stored.events
    assert isinstance(ev, BlockStored) and ev.parent_block_hash is None and ev.block_size == 32
    assert len(ev.block_hashes) == 5 and len(ev.token_ids) == 160 and ev.medium == "GPU"
    assert ev.group_idx == 0 and ev.kv_cache_spec_kind == "full_attention" and ev.extra_keys == [None] * 5
    removed = decode_batch((GOLDEN / "block_removed.msgpack").read_bytes())
    assert removed.undecodable == 0
    assert [type(e) for e in removed.events] == [BlockRemoved] * 25 + [BlockStored]
    assert len(removed.events[-1].block_hashes) == 32
    cleared = decode_batch((GOLDEN / "all_blocks_cleared.msgpack").read_bytes())
    assert cleared.undecodable == 0 and [type(e) for e in cleared.events] == [AllBlocksCleared, BlockStored]
    # and they are the shape the README says: an array batch of map events
    raw = msgpack.unpackb((GOLDEN / "block_stored.msgpack").read_bytes())
    assert isinstance(raw, list) and isinstance(raw[1][0], dict)


TINY = Path(__file__).resolve().parents[2] / "support" / "data" / "tiny-tokenizer"


@asynccontextmanager
async def sim_fleet(*names: str, encoding: str = "map", model: str = MODEL,
                    tokenizer: str | None = None, lora: dict | None = None) -> AsyncIterator[list[SimBackend]]:
    extra: dict[str, Any] = {"tokenizer": tokenizer} if tokenizer else {}
    if lora is not None:
        extra["lora"] = lora
    cfgs = [SimBackendConfig.from_dict({"name": n, "models": [model], "speed": 50.0,
                                        "profile_overrides": {"block_size": BS},
                                        "kv_events": {"topic": "kv-events", "encoding": encoding}, **extra})
            for n in names]
    backends, _ = await start_backends(cfgs)
    try:
        yield backends
    finally:
        for b in backends:
            await b.cleanup()


def gateway_cfg(backends: list[SimBackend], model: str = MODEL, *, adapters: tuple[str, ...] = (),
                **overrides: Any):
    overrides.setdefault("routing", {"policy": "estimated_ttft"})
    return gateway_config([{"name": b.cfg.name, "url": b.url, "models": [model, *adapters],
                            "kv_events": {"endpoint": b.kv_publisher.endpoint,
                                          "replay_endpoint": b.kv_publisher.replay_endpoint,
                                          "topic": "kv-events", "block_size": BS}} for b in backends],
                          **overrides)


async def post(session: aiohttp.ClientSession, url: str, prompt: list[int] | str, max_tokens: int = 2,
               model: str = MODEL) -> tuple[dict[str, str], dict[str, Any]]:
    async with session.post(url + "/v1/completions",
                            json={"model": model, "prompt": prompt, "max_tokens": max_tokens}) as r:
        assert r.status == 200, await r.text()
        return dict(r.headers), await r.json()


def route(headers: dict[str, str]) -> dict[str, str]:
    return dict(p.split("=", 1) for p in headers["x-turbo-route"].split("; "))


async def subscribed(gw, session: aiohttp.ClientSession, b: SimBackend, tries: int = 200) -> None:
    """Send requests straight to ``b`` (another client of that engine) until the
    gateway has received one of its events: a SUB socket gets only what is sent after
    it connected. Bounded."""
    await subscribed_to(gw, session, b.cfg.name, b.url, next(iter(b.cfg.models)), tries)


async def subscribed_to(gw, session: aiohttp.ClientSession, name: str, url: str, model: str,
                        tries: int = 200) -> None:
    """:func:`subscribed` for the engine ``name`` at ``url`` serving ``model``."""
    stats = gw.state.core.kv_stats[name]
    for i in range(tries):
        await post(session, url, [1000 + i] * 32 + [1], 1, model)  # new blocks: each probe publishes
        if stats.batches > 0:
            await wait_until(lambda: gw.state.core.index.engine(name).live)
            return
    raise AssertionError(f"no KV event of {name} reached the gateway")


def holders(gw, prompt: list[int], model: str = MODEL) -> list[dict[str, float]]:
    keys = token_block_keys(prompt, BS, chain_seed(model))
    return [dict(gw.state.core.index.token_owners.get(k, {})) for k in keys]


async def test_precise_index_follows_the_engines_and_routes_to_the_holder():
    async with AsyncExitStack() as st:
        backends = await st.enter_async_context(sim_fleet("s1", "s2"))
        gw = await st.enter_async_context(running_gateway(gateway_cfg(backends)))
        session = await st.enter_async_context(aiohttp.ClientSession())
        for b in backends:
            await subscribed(gw, session, b)
        prefix = [1000 + (i * 7919) % 30000 for i in range(1024)]  # 64 blocks
        h, body = await post(session, gw.url, prefix + [5, 6, 7])
        holder = h["x-turbo-backend"]
        other = next(b.cfg.name for b in backends if b.cfg.name != holder)
        # the engine's BlockStored made the prefix precise there, and nowhere else
        await wait_until(lambda: all(o.get(holder) == PRECISE for o in holders(gw, prefix)))
        assert all(other not in o for o in holders(gw, prefix))
        # the same long prefix again, other questions: routed to its holder, the engine's
        # cached_tokens equal to the gateway's prediction to the block
        for i in range(4):
            h, body = await post(session, gw.url, prefix + [20_000 + i] * 40)
            r = route(h)
            assert h["x-turbo-backend"] == holder and r["evidence"] == "precise"
            assert int(r["matched_tokens"]) == 1024
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == int(r["matched_tokens"])
        assert gw.metric("turbo_gateway_prefix_predicted_tokens_total", evidence="precise") == \
            gw.metric("turbo_gateway_prefix_reported_cached_tokens_total", evidence="precise") == 4 * 1024


async def test_an_adapters_blocks_are_confirmed_for_that_adapter_and_no_other():
    """An adapter's blocks are its own in the engine (vLLM hashes them with the adapter
    name) and its events name it: the gateway's precise index keys them under the
    adapter, so a repeated adapter prompt is matched to the token as the engine
    reports it, while the base model's same prompt is 0 on both sides."""
    async with AsyncExitStack() as st:
        backends = await st.enter_async_context(sim_fleet("s1", "s2", lora={"adapters": ["ops-lora"]}))
        gw = await st.enter_async_context(running_gateway(gateway_cfg(backends, adapters=("ops-lora",))))
        session = await st.enter_async_context(aiohttp.ClientSession())
        for b in backends:
            await subscribed(gw, session, b)
        prefix = [7000 + (i * 7919) % 20000 for i in range(512)]  # 32 blocks
        h, body = await post(session, gw.url, prefix + [1, 2, 3], model="ops-lora")
        holder = h["x-turbo-backend"]
        await wait_until(lambda: all(o.get(holder) == PRECISE for o in holders(gw, prefix, "ops-lora")))
        assert not any(holders(gw, prefix, MODEL))
        for i in range(2):
            h, body = await post(session, gw.url, prefix + [9000 + i] * 20, model="ops-lora")
            r = route(h)
            assert h["x-turbo-backend"] == holder and r["evidence"] == "precise"
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == int(r["matched_tokens"]) == 512
        # the base model's same prompt: the adapter's holder has none of it (its own lookup,
        # no state change), and the gateway predicts 0 where the engine reports 0
        engine = next(b for b in backends if b.cfg.name == holder).engine
        assert engine.cached_prefix_tokens(prefix + [4, 5, 6], lora="ops-lora") == 512
        assert engine.cached_prefix_tokens(prefix + [4, 5, 6]) == 0
        h, body = await post(session, gw.url, prefix + [4, 5, 6])
        r = route(h)
        assert r["evidence"] == "precise" and r["matched_tokens"] == "0"
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_blocks_another_client_put_in_an_engine_are_known():
    async with AsyncExitStack() as st:
        backends = await st.enter_async_context(sim_fleet("s1", "s2", encoding="array"))
        gw = await st.enter_async_context(running_gateway(gateway_cfg(backends)))
        session = await st.enter_async_context(aiohttp.ClientSession())
        for b in backends:
            await subscribed(gw, session, b)
        s2 = backends[1]
        prefix = [3000 + (i * 104729) % 30000 for i in range(512)]  # 32 blocks
        await post(session, s2.url, prefix + [1])  # straight to the engine, not through the gateway
        await wait_until(lambda: all(o.get("s2") == PRECISE for o in holders(gw, prefix)))
        h, body = await post(session, gw.url, prefix + [2] * 30)
        assert h["x-turbo-backend"] == "s2" and route(h)["evidence"] == "precise"
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == int(route(h)["matched_tokens"]) == 512


async def test_an_engine_restart_clears_its_entries():
    async with AsyncExitStack() as st:
        backends = await st.enter_async_context(sim_fleet("s1"))
        gw = await st.enter_async_context(running_gateway(gateway_cfg(backends)))
        session = await st.enter_async_context(aiohttp.ClientSession())
        (s1,) = backends
        await subscribed(gw, session, s1)
        prefix = [5000 + i for i in range(256)]
        await post(session, gw.url, prefix + [1])
        await wait_until(lambda: all(o.get("s1") == PRECISE for o in holders(gw, prefix)))
        await s1.crash(0)  # a cold engine on the same addresses, sequence numbers from 0
        stats = gw.state.core.kv_stats["s1"]
        for i in range(200):  # the restarted engine's events: each probe stores new blocks (bounded)
            await post(session, s1.url, [100 + i] * 32 + [1], 1)
            if stats.restarts:
                break
        assert stats.restarts == 1
        await wait_until(lambda: not any("s1" in o for o in holders(gw, prefix)))
        h, _ = await post(session, gw.url, prefix + [2])
        assert route(h)["evidence"] == "precise" and route(h)["matched_tokens"] == "0"


async def test_chat_and_text_prompts_tokenized_by_the_gateway_match_the_engines_blocks():
    """With the model's own tokenizer in the gateway and the same tokenizer in the
    engine, chat and text prompts are token-exact: a shared system prompt is matched
    precisely, and the engine's cached_tokens equal the prediction."""
    async with AsyncExitStack() as st:
        backends = await st.enter_async_context(sim_fleet("s1", "s2", model="tiny",
                                                          tokenizer=str(TINY / "tokenizer.json")))
        cfg = gateway_cfg(backends, "tiny", models={"tiny": {"tokenizer": str(TINY)}})
        gw = await st.enter_async_context(running_gateway(cfg))
        session = await st.enter_async_context(aiohttp.ClientSession())
        for b in backends:
            await subscribed(gw, session, b)
        system = "You are a careful assistant for the billing team of a large company. " * 20
        index = gw.state.core.index
        seen = []
        for i in range(4):
            h, body = await post(session, gw.url, system + f"Question {i}: why?", model="tiny")
            seen.append((h, body))
            # the engine's events confirm every block dispatched to it (after its prefill)
            await wait_until(lambda: index.counts(h["x-turbo-backend"])[1] == 0)
            async with session.post(gw.url + "/v1/chat/completions", json={
                    "model": "tiny", "max_tokens": 2,
                    "messages": [{"role": "system", "content": system},
                                 {"role": "user", "content": f"Question {i}: why?"}]}) as r:
                assert r.status == 200
                h, body = dict(r.headers), await r.json()
            seen.append((h, body))
            await wait_until(lambda: index.counts(h["x-turbo-backend"])[1] == 0)
        for h, body in seen[2:]:  # after the first text and the first chat prompt
            r = route(h)
            assert r["evidence"] == "precise"
            assert int(r["matched_tokens"]) == body["usage"]["prompt_tokens_details"]["cached_tokens"] > 300


async def test_models_found_by_discovery_get_precise_evidence():
    """A backend with ``models: auto``: the model its ``/v1/models`` lists is matched
    token-exactly against its KV events, as a configured one is."""
    async with AsyncExitStack() as st:
        (s1,) = await st.enter_async_context(sim_fleet("s1"))
        cfg = gateway_config([{"name": "s1", "url": s1.url, "models": "auto",
                               "kv_events": {"endpoint": s1.kv_publisher.endpoint,
                                             "replay_endpoint": s1.kv_publisher.replay_endpoint,
                                             "topic": "kv-events", "block_size": BS, "base_model": MODEL}}],
                             routing={"policy": "estimated_ttft"})
        gw = await st.enter_async_context(running_gateway(cfg))
        session = await st.enter_async_context(aiohttp.ClientSession())
        await wait_until(lambda: MODEL in gw.state.core.fleet.by_model)
        await subscribed(gw, session, s1)
        prefix = [7000 + i for i in range(256)]
        await post(session, gw.url, prefix + [1])
        await wait_until(lambda: all(o.get("s1") == PRECISE for o in holders(gw, prefix)))
        h, body = await post(session, gw.url, prefix + [2] * 20)
        assert route(h)["evidence"] == "precise" and route(h)["matched_tokens"] == "256"
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 256


async def test_an_engine_restart_seen_in_its_metrics_clears_its_entries_before_any_event():
    """A restarted engine publishes nothing until it stores a block; its counters going
    back in its ``/metrics`` already say its KV cache is empty."""
    async with AsyncExitStack() as st:
        (s1,) = await st.enter_async_context(sim_fleet("s1"))
        cfg = gateway_cfg([s1], routing={"policy": "estimated_ttft", "scrape_interval_s": 0.05})
        gw = await st.enter_async_context(running_gateway(cfg))
        session = await st.enter_async_context(aiohttp.ClientSession())
        await subscribed(gw, session, s1)
        prefix = [9000 + i for i in range(256)]
        await post(session, gw.url, prefix + [1])
        await wait_until(lambda: all(o.get("s1") == PRECISE for o in holders(gw, prefix)))
        load = gw.state.core.fleet.backends["s1"].load
        await wait_until(lambda: load.engine_prefill_tokens_per_s is not None)  # a scrape counted the prefill
        events = gw.state.core.kv_stats["s1"].batches
        await s1.crash(0)  # a cold engine on the same addresses
        await wait_until(lambda: not any("s1" in o for o in holders(gw, prefix)))
        assert gw.state.core.kv_stats["s1"].batches == events  # no event told the gateway
        h, body = await post(session, gw.url, prefix + [2])
        assert route(h)["matched_tokens"] == "0"
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_simulate_sections_with_kv_events_route_on_precise_evidence_with_no_other_config():
    """Backends the gateway starts itself (``simulate:``) with ``kv_events`` and a
    ``tokenizer``: the gateway reads where each publishes (``/kv_event_sources``) and
    its block size (its profile's, here 32), subscribes, and tokenizes the model's
    prompts with the simulated tokenizer; nothing else is configured."""
    sim = {"speed": 50.0, "tokenizer": str(TINY), "profile_overrides": {"block_size": 32},
           "kv_events": {"topic": "kv-events"}}
    cfg = gateway_config([{"name": n, "models": ["tiny"], "simulate": sim} for n in ("e1", "e2")],
                         routing={"policy": "estimated_ttft"})
    assert cfg.models["tiny"].tokenizer == str(TINY) and all(b.kv_events is None for b in cfg.backends)
    async with AsyncExitStack() as st:
        gw = await st.enter_async_context(running_gateway(cfg))
        session = await st.enter_async_context(aiohttp.ClientSession())
        wired = {b.name: b.kv_events for b in gw.state.cfg.backends}
        assert all(k is not None and k.block_size == 32 and k.topic == "kv-events" and k.replay_endpoint
                   for k in wired.values())
        tasks = {n: ts for n, (_, ts) in gw.state.kv_events.running.items()}
        apply_config(gw.app, cfg)  # a reload of the same config keeps the wiring and the subscriptions
        assert {b.name: b.kv_events for b in gw.state.cfg.backends} == wired
        assert {n: ts for n, (_, ts) in gw.state.kv_events.running.items()} == tasks
        for name, url in gw.state.urls.items():
            await subscribed_to(gw, session, name, url, "tiny")
        system = "You are a careful assistant for the billing team of a large company. " * 20
        index = gw.state.core.index
        seen = []
        for i in range(3):
            async with session.post(gw.url + "/v1/chat/completions", json={
                    "model": "tiny", "max_tokens": 2,
                    "messages": [{"role": "system", "content": system},
                                 {"role": "user", "content": f"Question {i}: why?"}]}) as r:
                assert r.status == 200, await r.text()
                h, body = dict(r.headers), await r.json()
            seen.append((h, body))
            await wait_until(lambda: index.counts(h["x-turbo-backend"])[1] == 0)  # confirmed by its events
        assert route(seen[0][0])["matched_tokens"] == "0"
        for h, body in seen[1:]:
            r = route(h)
            assert r["evidence"] == "precise" and h["x-turbo-backend"] == seen[0][0]["x-turbo-backend"]
            assert int(r["matched_tokens"]) == body["usage"]["prompt_tokens_details"]["cached_tokens"] > 300


@pytest.mark.slow
async def test_the_fleet_clis_gateway_config_wires_kv_events_and_the_tokenizer(tmp_path):
    """``python -m loadtest.sim --fleet F --write-gateway-config OUT``: each backend that
    publishes KV events gets ``kv_events`` (its bound addresses, its profile's block
    size) and the simulated tokenizer becomes ``models.<m>.tokenizer``; a gateway on that
    file alone routes on precise evidence."""
    fleet, out = tmp_path / "fleet.yaml", tmp_path / "gw.yaml"
    fleet.write_text(yaml.safe_dump({
        "models": ["tiny"], "speed": 50.0,
        "backends": [{"name": "e", "replicas": 2, "tokenizer": str(TINY), "profile_overrides": {"block_size": 32},
                      "kv_events": {"topic": "kv-events"}}]}))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "loadtest.sim", "--fleet", str(fleet), "--write-gateway-config", str(out),
        "--exit-on-stdin-eof", cwd=ROOT, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL)
    try:
        urls = json.loads(await asyncio.wait_for(proc.stdout.readline(), 60))
        cfg = load_config(out)
        assert cfg.models["tiny"].tokenizer == str(TINY)
        async with AsyncExitStack() as st:
            session = await st.enter_async_context(aiohttp.ClientSession())
            for b in cfg.backends:
                async with session.get(urls[b.name] + "/kv_event_sources") as r:
                    (src,) = (await r.json()).values()
                assert (b.kv_events.endpoint, b.kv_events.replay_endpoint, b.kv_events.topic,
                        b.kv_events.block_size) == (src["endpoint"], src["replay_endpoint"], "kv-events", 32)
            gw = await st.enter_async_context(running_gateway(cfg))
            for name, url in urls.items():
                await subscribed_to(gw, session, name, url, "tiny")
            prompt = "You are a careful assistant for the billing team of a large company. " * 20
            h, _ = await post(session, gw.url, prompt + "Question 1?", model="tiny")
            await wait_until(lambda: gw.state.core.index.counts(h["x-turbo-backend"])[1] == 0)
            h, body = await post(session, gw.url, prompt + "Question 2?", model="tiny")
            r = route(h)
            assert r["evidence"] == "precise"
            assert int(r["matched_tokens"]) == body["usage"]["prompt_tokens_details"]["cached_tokens"] > 300
    finally:
        proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 20)
        except TimeoutError:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0
