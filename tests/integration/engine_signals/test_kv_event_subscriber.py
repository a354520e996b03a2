"""The gateway subscribed to engines' KV events over real ZMQ sockets on 127.0.0.1:
a vLLM-like publisher (tests/support/kv_publisher.py) sends crafted payloads; the gateway
serves real HTTP in front of scripted backends. Gaps and replay, replay that cannot
fill a gap, engine restart, undecodable payloads, mixed fleets, reload, and what
x-turbo-route and /metrics say."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from gateway.ops.config_reload import apply_config
from gateway.runtime import backend_specs
from routing.core import DecisionCore
from routing.estimate import chain_seed, token_block_keys
from tests.support.kv_payloads import batch, cleared, removed, stored
from tests.support.kv_publisher import KVPublisher, kv_publisher, publish_until, ranked_publishers
from tests.support.servers import ScriptedBackend, completion_body, gateway_config, running_gateway, wait_until

BS = 16
MODEL = "m"
PREFIX = list(range(1, 8193))  # 512 blocks: recomputing it costs more than any queue in these tests


def kv(pub: KVPublisher, **extra: Any) -> dict[str, Any]:
    return {"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint, "topic": "kv-events",
            "block_size": BS, **extra}


def config(backends: dict[str, tuple[str, KVPublisher | None]], **routing: Any):
    return gateway_config([{"name": n, "url": url, "models": [MODEL], **({"kv_events": kv(p)} if p else {})}
                           for n, (url, p) in backends.items()],
                          routing={"policy": "estimated_ttft", **routing})


async def connected(gw, pub: KVPublisher, name: str) -> None:
    """Make sure ``name``'s subscription receives (ZMQ's slow joiner: a SUB gets only
    what is sent after it connected) and its events are live."""
    stats = gw.state.core.kv_stats[name]
    before = stats.batches
    await publish_until(pub, batch([cleared()]), lambda: stats.batches > before)
    await wait_until(lambda: gw.state.core.index.engine(name).live)


@asynccontextmanager
async def one_engine(topic_frame: bool = False) -> AsyncIterator[tuple[Any, KVPublisher]]:
    """The gateway in front of one scripted backend ``a`` whose engine publishes on a
    test publisher, subscribed and live."""
    async with AsyncExitStack() as st:
        a = await st.enter_async_context(ScriptedBackend().running())
        pa = await st.enter_async_context(kv_publisher())
        pa.replay_topic_frame = topic_frame
        gw = await st.enter_async_context(running_gateway(config({"a": (a.url, pa)})))
        await connected(gw, pa, "a")
        yield gw, pa


async def complete(gw, prompt: list[int], **extra: Any) -> tuple[int, dict[str, str], dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/completions",
                          json={"model": MODEL, "prompt": prompt, "max_tokens": 4, **extra}) as r:
            return r.status, dict(r.headers), await r.json()


def route(headers: dict[str, str]) -> dict[str, str]:
    return dict(p.split("=", 1) for p in headers["x-turbo-route"].split("; "))


async def test_a_repeated_prefix_is_routed_to_its_precise_holder():
    async with AsyncExitStack() as st:
        a = await st.enter_async_context(ScriptedBackend().running())
        b = await st.enter_async_context(ScriptedBackend().running())
        pa = await st.enter_async_context(kv_publisher())
        pb = await st.enter_async_context(kv_publisher())
        gw = await st.enter_async_context(running_gateway(config({"a": (a.url, pa), "b": (b.url, pb)})))
        await connected(gw, pa, "a")
        await connected(gw, pb, "b")
        # b's engine stored the prefix, in two events chained by parent_block_hash
        await pb.publish(batch([stored(range(1000, 1256), None, PREFIX[:4096], BS)], event_shape="array"))
        await pb.publish(batch([stored(range(1256, 1512), 1255, PREFIX[4096:], BS)]))
        await wait_until(lambda: gw.state.core.index.counts("b") == (512, 0))
        for i in range(6):
            status, headers, _ = await complete(gw, PREFIX + [50_000 + i] * 20)
            assert status == 200 and headers["x-turbo-backend"] == "b"
            r = route(headers)
            assert (r["evidence"], r["matched_tokens"]) == ("precise", "8192")
        assert len(a.bodies) == 0 and len(b.bodies) == 6
        assert gw.metric("turbo_gateway_prefix_blocks", backend="b", evidence="precise") == 512
        assert gw.metric("turbo_gateway_kv_events_live", backend="a") == 1
        # b evicts the prefix's first block: nothing of it is reusable on b any more
        await pb.publish(batch([removed([1000])]))
        await wait_until(lambda: gw.state.core.index.counts("b")[0] == 511)
        status, headers, _ = await complete(gw, list(range(90_000, 90_100)))  # b keeps the same load as a
        assert route(headers)["evidence"] == "precise"


async def test_a_dispatch_is_speculative_until_the_engine_confirms_it():
    async with one_engine() as (gw, pa):
        prompt = PREFIX[:64]
        _, h, _ = await complete(gw, prompt + [1])
        assert (route(h)["evidence"], route(h)["matched_tokens"]) == ("precise", "0")
        _, h, _ = await complete(gw, prompt + [2])
        assert (route(h)["evidence"], route(h)["matched_tokens"]) == ("speculative", "64")
        await pa.publish(batch([stored([1, 2, 3, 4], None, prompt, BS)]))
        await wait_until(lambda: gw.state.core.index.counts("a") == (4, 0))
        _, h, _ = await complete(gw, prompt + [3])
        assert (route(h)["evidence"], route(h)["matched_tokens"]) == ("precise", "64")


@pytest.mark.parametrize("topic_frame", [False, True], ids=["seq-payload", "vllm-0.32-topic-seq-payload"])
async def test_a_gap_is_filled_by_replay(topic_frame):
    async with one_engine(topic_frame) as (gw, pa):
        stats = gw.state.core.kv_stats["a"]
        await pa.publish(batch([stored([1], None, PREFIX[:16], BS)]), drop=True)  # lost on the way
        await pa.publish(batch([stored([2], 1, PREFIX[16:32], BS)]))
        await wait_until(lambda: stats.replays == 1)
        assert gw.state.core.index.counts("a") == (2, 0) and stats.gaps == 1 and stats.replay_failures == 0
        # the live socket then goes on as if nothing happened
        await pa.publish(batch([stored([3], 2, PREFIX[32:48], BS)]))
        await wait_until(lambda: gw.state.core.index.counts("a") == (3, 0))
        assert stats.gaps == 1 and gw.metric("turbo_gateway_kv_events_replays_total", backend="a",
                                             outcome="filled") == 1


async def test_a_gap_replay_cannot_fill_drops_precise_entries_and_falls_back_to_approximate():
    async with one_engine() as (gw, pa):
        stats, index = gw.state.core.kv_stats["a"], gw.state.core.index
        await pa.publish(batch([stored([1, 2], None, PREFIX[:32], BS)]))
        await wait_until(lambda: index.counts("a")[0] == 2)
        lost = await pa.publish(batch([removed([1])]), drop=True)
        pa.forget_before(lost + 1)  # the engine's replay buffer no longer holds it
        await pa.publish(batch([stored([9], None, PREFIX[100:116], BS)]))
        await wait_until(lambda: stats.replay_failures == 1)
        assert index.counts("a")[0] == 1  # the stale entries went; the live message after the gap is applied
        assert not any(k in index.token_owners for k in token_block_keys(PREFIX[:32], BS, chain_seed(MODEL)))
        # the live message after the gap was applied: a stores again, so its events decide again
        assert index.engine("a").live
        pa.replay_silent = True  # a replay socket that answers nothing fails the same way
        await pa.publish(batch([cleared()]), drop=True)
        await pa.publish(batch([removed([9])]))  # (an AllBlocksCleared would say the cache is empty: known again)
        await wait_until(lambda: stats.replay_failures == 2)
        assert not index.engine("a").live
        _, h, _ = await complete(gw, PREFIX[:64])
        assert route(h)["evidence"] == "approximate"
        assert gw.metric("turbo_gateway_kv_events_live", backend="a") == 0


async def test_an_engine_restart_clears_its_entries():
    async with one_engine() as (gw, pa):
        index = gw.state.core.index
        await pa.publish(batch([stored([1, 2, 3], None, PREFIX[:48], BS)]))
        await wait_until(lambda: index.counts("a")[0] == 3)
        pa.restart()
        await pa.publish(batch([stored([7], None, PREFIX[200:216], BS)]))
        await wait_until(lambda: gw.state.core.kv_stats["a"].restarts == 1)
        await wait_until(lambda: index.counts("a")[0] == 1)
        assert gw.metric("turbo_gateway_kv_events_restarts_total", backend="a") == 1
        await pa.publish(batch([cleared()], batch_shape="map", event_shape="array"))
        await wait_until(lambda: index.counts("a")[0] == 0)
        # another restart whose first message is lost: the replay from 0 brings it
        pa.restart()
        await pa.publish(batch([stored([1], None, PREFIX[:16], BS)]), drop=True)
        await pa.publish(batch([stored([2], 1, PREFIX[16:32], BS)]))
        await wait_until(lambda: gw.state.core.kv_stats["a"].restarts == 2)
        await wait_until(lambda: index.counts("a")[0] == 2)
        assert pa.replay_requests[-1] == 0


async def test_a_restart_hidden_behind_a_reconnection_is_found_by_replay():
    """The engine restarts and publishes more messages than its last run had before
    the subscriber reconnects: the sequence does not go back, but the batch replayed
    at the last applied seq is not the one applied."""
    async with one_engine() as (gw, pa):
        index, stats = gw.state.core.index, gw.state.core.kv_stats["a"]
        await pa.publish(batch([stored([1, 2], None, PREFIX[:32], BS)]))
        await wait_until(lambda: index.counts("a")[0] == 2)
        old_run = pa.seq
        await pa.restart_process()
        for _ in range(old_run + 2):  # the new run's first messages, sent before we reconnected
            await pa.publish(batch([removed([424242])]), drop=True)
        await publish_until(pa, batch([stored([7], None, PREFIX[500:516], BS)]), lambda: stats.restarts > 0)
        await wait_until(lambda: index.counts("a")[0] == 1)
        assert stats.restarts == 1 and stats.replay_failures == 0
        assert not any(k in index.token_owners for k in token_block_keys(PREFIX[:32], BS, chain_seed(MODEL)))


async def test_a_reconnection_to_the_same_run_keeps_the_entries():
    async with one_engine() as (gw, pa):
        index, stats = gw.state.core.index, gw.state.core.kv_stats["a"]
        await pa.publish(batch([stored([1, 2], None, PREFIX[:32], BS)]))
        await wait_until(lambda: index.counts("a")[0] == 2)
        # the same run's sockets go away and come back (a network blip), buffer kept
        seq, buffer = pa.seq, list(pa.buffer)
        await pa.restart_process()
        pa.seq = seq
        pa.buffer.extend(buffer)
        await pa.publish(batch([removed([424242])]), drop=True)
        await publish_until(pa, batch([stored([3], 2, PREFIX[32:48], BS)]), lambda: index.counts("a")[0] == 3)
        assert stats.restarts == 0 and stats.gaps == 1 and stats.replays == 1


async def test_undecodable_payloads_are_counted_and_the_subscription_goes_on():
    async with one_engine() as (gw, pa):
        await pa.publish(b"\xc1 not msgpack")
        await pa.publish(orjson.dumps({"ts": 1}))
        await pa.pub.send_multipart([b"kv-events", b"short"])  # not [topic, seq, payload]
        await pa.publish(batch([stored([1], None, PREFIX[:16], BS)]))
        await wait_until(lambda: gw.state.core.index.counts("a")[0] == 1)
        assert gw.metric("turbo_gateway_kv_events_decode_errors_total", backend="a") == 3


async def test_mixed_fleet_and_the_approximate_path_without_events():
    async with AsyncExitStack() as st:
        a = await st.enter_async_context(ScriptedBackend().running())
        c = await st.enter_async_context(ScriptedBackend().running())
        pa = await st.enter_async_context(kv_publisher())
        cfg = gateway_config([{"name": "a", "url": a.url, "models": [MODEL], "kv_events": kv(pa)},
                              {"name": "c", "url": c.url, "models": [MODEL, "plain"]}],
                             routing={"policy": "estimated_ttft"})
        gw = await st.enter_async_context(running_gateway(cfg))
        await connected(gw, pa, "a")
        core = gw.state.core
        assert core.wants_token_ids(MODEL) and not core.wants_token_ids("plain")
        # a model without event backends: no token keys, approximate evidence, as before
        async with aiohttp.ClientSession() as s:
            for _ in range(2):
                async with s.post(gw.url + "/v1/completions", json={"model": "plain", "prompt": PREFIX[:512]}) as r:
                    assert r.status == 200 and route(dict(r.headers))["evidence"] == "approximate"
        assert core.index.counts("c") == (0, 0)
        # the model with an event backend: a decides by its events, c by its approximate entries
        _, h, _ = await complete(gw, PREFIX[:512])
        first = h["x-turbo-backend"]
        _, h, _ = await complete(gw, PREFIX[:512])
        assert h["x-turbo-backend"] == first  # its dispatch record (speculative or approximate) holds the prefix
        assert route(h)["evidence"] == ("speculative" if first == "a" else "approximate")


async def test_predicted_and_reported_cached_tokens_by_evidence():
    async def answer(backend, request: web.Request, body: dict) -> web.Response:
        out = completion_body()
        out["usage"] = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1,
                        "total_tokens": len(body["prompt"]) + 1, "prompt_tokens_details": {"cached_tokens": 4096}}
        return web.json_response(out)

    async with AsyncExitStack() as st:
        a = await st.enter_async_context(ScriptedBackend(handler=answer).running())
        pa = await st.enter_async_context(kv_publisher())
        gw = await st.enter_async_context(running_gateway(config({"a": (a.url, pa)})))
        await connected(gw, pa, "a")
        await pa.publish(batch([stored(range(256), None, PREFIX[:4096], BS)]))
        await wait_until(lambda: gw.state.core.index.counts("a")[0] == 256)
        await complete(gw, PREFIX[:4096] + [7] * 100)
        assert gw.metric("turbo_gateway_prefix_predicted_tokens_total", evidence="precise") == 4096
        assert gw.metric("turbo_gateway_prefix_reported_cached_tokens_total", evidence="precise") == 4096


async def test_reload_starts_changes_and_stops_subscriptions():
    async with AsyncExitStack() as st:
        a = await st.enter_async_context(ScriptedBackend().running())
        pa = await st.enter_async_context(kv_publisher())
        pb = await st.enter_async_context(kv_publisher())
        gw = await st.enter_async_context(running_gateway(config({"a": (a.url, None)})))
        subs = gw.state.kv_events
        assert subs.running == {} and not gw.state.core.wants_token_ids(MODEL)
        apply_config(gw.app, config({"a": (a.url, pa)}))
        assert set(subs.running) == {"a"}
        await connected(gw, pa, "a")
        await pa.publish(batch([stored([1], None, PREFIX[:16], BS)]))
        await wait_until(lambda: gw.state.core.index.counts("a")[0] == 1)
        old = subs.running["a"][1]
        apply_config(gw.app, config({"a": (a.url, pb)}))  # another engine: what a held is forgotten
        assert subs.running["a"][1] != old and gw.state.core.index.counts("a")[0] == 0
        await connected(gw, pb, "a")
        apply_config(gw.app, config({"a": (a.url, None)}))
        assert subs.running == {} and gw.state.core.index.engine("a") is None
        await wait_until(lambda: all(t.done() for t in old))


async def test_data_parallel_ranks_publish_on_port_plus_rank():
    async with AsyncExitStack() as st:
        a = await st.enter_async_context(ScriptedBackend().running())
        ranks = await st.enter_async_context(ranked_publishers(2))
        cfg = gateway_config([{"name": "a", "url": a.url, "models": [MODEL],
                               "kv_events": {**kv(ranks[0]), "data_parallel_size": 2}}],
                             routing={"policy": "estimated_ttft"})
        gw = await st.enter_async_context(running_gateway(cfg))
        assert [t.get_name() for t in gw.state.kv_events.running["a"][1]] == ["kv-events-a-0", "kv-events-a-1"]
        for r, pub in enumerate(ranks):
            await connected(gw, pub, "a")
            await pub.publish(batch([stored([100 + r], None, PREFIX[:16], BS)], rank=r))
        index = gw.state.core.index
        await wait_until(lambda: all(index.key_of("a", r, 100 + r) is not None for r in (0, 1)))
        assert index.counts("a") == (1, 0)  # one block, held by both ranks
        await ranks[1].publish(batch([removed([101])], rank=1))
        await wait_until(lambda: index.key_of("a", 1, 101) is None)
        _, h, _ = await complete(gw, PREFIX[:16] + [1, 2])
        assert (route(h)["evidence"], route(h)["matched_tokens"]) == ("precise", "16")  # rank 0 still holds it


async def test_a_subscription_that_fails_starts_again():
    """An address libzmq refuses at connect (one the config's checks would stop, made
    here past them) fails the subscription: it is logged, counted as a gap replay could
    not fill, and started again, never left dead."""
    from gateway.config import KVEvents
    from gateway.engine_signals.kv_event_subscriber import KVEventSubscribers

    cfg = config({"a": ("http://127.0.0.1:9", None)})
    bad = KVEvents.model_construct(endpoint="tcp://bad host:5557", replay_endpoint=None, topic="", block_size=BS,
                                   data_parallel_size=1, base_model=None, replay_timeout_s=1.0)
    cfg = cfg.model_copy(update={"backends": [cfg.backends[0].model_copy(update={"kv_events": bad})]})
    core = DecisionCore(backend_specs(cfg), "estimated_ttft")
    subs = KVEventSubscribers(core)
    subs.configure(cfg)
    try:
        await wait_until(lambda: core.kv_stats["a"].replay_failures >= 1)
        (task,) = subs.running["a"][1]
        assert not task.done()
    finally:
        await subs.stop()
    assert task.cancelled()
