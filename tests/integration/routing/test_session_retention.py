"""Sessions across tool-call gaps, over real sockets: simulated engines (loadtest.sim) with
a small KV cache that report cached prompt tokens in ``usage`` (and publish KV events,
for the precise cases), the gateway in front of them, a real Redis-protocol server for
the replicas. A session waiting longer than ``prefix_ttl_s`` keeps its context at home
(a one-off long prompt goes elsewhere rather than evict it), with and without KV
events; once an engine has been seen evicting after such gaps, the gateway stops
counting a waiting session's context as held there; expiry is learned from the gaps;
moves are counted by reason and the session hit ratio is exported."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from loadtest.sim.server import SimBackend, start_backends
from loadtest.sim.spec import SimBackendConfig
from routing.core import RouteRequest
from tests.support.redis_server import redis_url
from tests.support.servers import free_port, gateway_config, running_gateway, wait_until

MODEL = "m"
BS = 16  # the engines' KV block size (tokens)
KV_BLOCKS = 256  # 4096 tokens of KV per engine
GAP_S = 0.8  # a tool call's gap, longer than PREFIX_TTL_S
PREFIX_TTL_S = 0.5


@asynccontextmanager
async def fleet(precise: bool, names: tuple[str, ...] = ("h1", "h2")) -> AsyncIterator[list[SimBackend]]:
    extra: dict[str, Any] = {"kv_events": {"topic": "kv-events", "encoding": "map"}} if precise else {}
    backends, _ = await start_backends([SimBackendConfig.from_dict(
        {"name": n, "models": [MODEL], "profile": "demo", "speed": 1.0,
         "profile_overrides": {"block_size": BS, "num_gpu_blocks": KV_BLOCKS}, **extra}) for n in names])
    try:
        yield backends
    finally:
        for b in backends:
            await b.cleanup()


def config(backends: list[SimBackend], precise: bool, **overrides: Any):
    entries = []
    for b in backends:
        e: dict[str, Any] = {"name": b.cfg.name, "url": b.url, "models": [MODEL],
                          "hints": {"kv_capacity_tokens": KV_BLOCKS * BS}}
        if precise:
            e["kv_events"] = {"endpoint": b.kv_publisher.endpoint, "replay_endpoint": b.kv_publisher.replay_endpoint,
                              "topic": "kv-events", "block_size": BS}
        entries.append(e)
    overrides.setdefault("routing", {"policy": "estimated_ttft", "scrape_interval_s": 0,
                                     "prefix_ttl_s": PREFIX_TTL_S})
    return gateway_config(entries, **overrides)


def ids(seed: int, n: int) -> list[int]:
    """``n`` token ids of their own (a prompt no other shares)."""
    return [1000 + (seed * 104729 + i * 7919) % 30000 for i in range(n)]


async def complete(http: aiohttp.ClientSession, url: str, prompt: list[int], session: str | None = None,
                   ) -> tuple[str, dict[str, str], int]:
    """(backend, x-turbo-route fields, the engine's reported cached tokens) of a completion."""
    headers = {"x-session-id": session} if session else {}
    async with http.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
                         headers=headers) as r:
        assert r.status == 200, await r.text()
        body = await r.json()
        route = dict(p.split("=", 1) for p in r.headers["x-turbo-route"].split("; "))
        return r.headers["x-turbo-backend"], route, body["usage"]["prompt_tokens_details"]["cached_tokens"]


async def subscribed(gw, http: aiohttp.ClientSession, backends: list[SimBackend]) -> None:
    """Send requests straight to each engine until the gateway has its KV events (a SUB
    socket gets only what is sent after it connected). Bounded."""
    for b in backends:
        stats = gw.state.core.kv_stats[b.cfg.name]
        for i in range(200):
            async with http.post(b.url + "/v1/completions",
                                 json={"model": MODEL, "prompt": [50 + i] * 32 + [1], "max_tokens": 1}) as r:
                await r.read()
            if stats.batches > 0:
                await wait_until(lambda n=b.cfg.name: gw.state.core.index.engine(n).live)
                break
        else:
            raise AssertionError(f"no KV event of {b.cfg.name} reached the gateway")


async def held_elsewhere(gw, http: aiohttp.ClientSession, home: str, prompt: list[int]) -> str:
    """Send ``prompt`` (no session) while a long queue holds ``home``: it goes to another
    backend, which learns its speed from it as ``home`` did from a turn as long (so that
    neither looks faster for having been measured). Returns that backend."""
    core = gw.state.core
    busy = core.reserve(RouteRequest(MODEL, prompt_tokens=5_000_000, output_tokens=1), core.fleet.backends[home],
                        gw.state.loop.time())
    try:
        backend, _, _ = await complete(http, gw.url, prompt)
    finally:
        busy.release(gw.state.loop.time())
    assert backend != home
    return backend


async def one_off_beside_a_small_queue(gw, http: aiohttp.ClientSession, busy_backend: str, prompt: list[int]) -> str:
    """Send ``prompt`` (no session) while ``busy_backend`` has a short queue (400
    tokens, a tenth of a second's prefill on these engines); returns where it went."""
    core = gw.state.core
    busy = core.reserve(RouteRequest(MODEL, prompt_tokens=400, output_tokens=1), core.fleet.backends[busy_backend],
                        gw.state.loop.time())
    try:
        backend, _, _ = await complete(http, gw.url, prompt)
    finally:
        busy.release(gw.state.loop.time())
    return backend


async def reset_prefix_caches(gw, http: aiohttp.ClientSession, backends: list[SimBackend], precise: bool) -> None:
    """Every engine loses its prefix cache (vLLM's ``/reset_prefix_cache``), as under
    other traffic; with KV events, until the gateway has their ``AllBlocksCleared``."""
    for b in backends:
        async with http.post(b.url + "/reset_prefix_cache") as r:
            assert r.status == 200
    if precise:
        await wait_until(lambda: all(not gw.state.core.index.counts(b.cfg.name)[0] for b in backends))


@pytest.mark.parametrize("precise", [False, True], ids=["approximate", "precise"])
async def test_a_gap_longer_than_prefix_ttl_keeps_the_session_and_its_kv_at_home(precise):
    """A session's context (2048 tokens) waits at its home through a tool call longer
    than prefix_ttl_s. Meanwhile a one-off 3000-token prompt comes, the other backend a
    little busier: placed at the home it would evict most of the session's context
    (4096 tokens of KV). It goes to the other backend, and the session's next turn
    finds its whole context at home, as the engine reports."""
    async with fleet(precise) as backends, running_gateway(config(backends, precise)) as gw, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        if precise:
            await subscribed(gw, http, backends)
        context = ids(1, 2048)
        home, route, _ = await complete(http, gw.url, context + ids(2, 16), "agent")
        assert route["placement"] == "new"
        other = await held_elsewhere(gw, http, home, ids(9, 2064))
        await asyncio.sleep(GAP_S)  # the tool call: the approximate index forgets the blocks
        assert await one_off_beside_a_small_queue(gw, http, other, ids(3, 3000)) == other
        await asyncio.sleep(GAP_S)
        backend, route, cached = await complete(http, gw.url, context + ids(2, 16) + ids(4, 200), "agent")
        assert (backend, route["placement"]) == (home, "home")
        assert cached == 2064  # its whole context (129 blocks) was still in the home's KV cache


async def test_after_an_engine_evicted_across_gaps_a_waiting_session_is_not_counted_held():
    """Without KV events. The engine loses its prefix cache during a session's tool call
    (as under other traffic) and reports no cached tokens when it comes back. A later
    session idle as long is then not counted as holding its context at home (the
    x-turbo-route's matched_tokens is what the engine reports: none), while one back
    sooner than any eviction seen still is."""
    async with fleet(False, ("h1",)) as backends, running_gateway(config(backends, False)) as gw, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        matched = []
        for i in range(2):
            context = ids(10 + i, 1024)
            await complete(http, gw.url, context, f"s{i}")
            await asyncio.sleep(GAP_S)
            await reset_prefix_caches(gw, http, backends, False)
            _, route, cached = await complete(http, gw.url, context + ids(50 + i, 64), f"s{i}")
            assert (route["placement"], cached) == ("home", 0)
            matched.append(int(route["matched_tokens"]))
        assert matched[0] > 900 and matched[1] == 0  # counted held until the engine showed otherwise
        context = ids(30, 1024)
        await complete(http, gw.url, context, "soon")
        _, route, cached = await complete(http, gw.url, context + ids(31, 64), "soon")
        assert route["placement"] == "home" and int(route["matched_tokens"]) > 900 and cached == 1024


async def test_with_kv_events_a_session_whose_kv_was_evicted_is_not_kept():
    """With KV events the index knows when a waiting session's blocks leave: after its
    engine dropped them, a one-off long prompt is placed at its home as if no session
    waited there, and the session's next turn is counted as holding nothing there."""
    async with fleet(True) as backends, running_gateway(config(backends, True)) as gw, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        await subscribed(gw, http, backends)
        context = ids(99, 2048)
        home, _, _ = await complete(http, gw.url, context, "p")
        other = await held_elsewhere(gw, http, home, ids(9, 2048))
        await asyncio.sleep(GAP_S)
        await reset_prefix_caches(gw, http, backends, True)
        assert await one_off_beside_a_small_queue(gw, http, other, ids(98, 3000)) == home
        _, route, cached = await complete(http, gw.url, context + ids(97, 64), "p")
        assert route["evidence"] == "precise" and int(route["matched_tokens"]) == 0 and cached == 0


async def test_moves_by_reason_and_the_session_hit_ratio_are_exported():
    async with fleet(False) as backends, running_gateway(config(backends, False)) as gw, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        context = ids(5, 1024)
        home, _, _ = await complete(http, gw.url, context, "m1")
        _, route, cached = await complete(http, gw.url, context + ids(6, 32), "m1")
        assert route["placement"] == "home" and cached == 1024
        core = gw.state.core
        gw.state.fleet.backends[home].draining = True  # the home takes no new request
        try:
            moved, route, _ = await complete(http, gw.url, context + ids(6, 32) + ids(7, 32), "m1")
        finally:
            gw.state.fleet.backends[home].draining = False
        assert moved != home and route["placement"] == "moved"
        busy = core.reserve(RouteRequest(MODEL, prompt_tokens=5_000_000, output_tokens=1),
                            core.fleet.backends[moved], gw.state.loop.time())
        try:  # its new home holds its context, but its queue costs far more than recomputing it
            back, route, _ = await complete(http, gw.url, context + ids(6, 32) + ids(7, 32) + ids(8, 32), "m1")
        finally:
            busy.release(gw.state.loop.time())
        assert back == home and route["placement"] == "moved"
        assert gw.metric("turbo_gateway_session_moves_total", reason="unavailable") == 1
        assert gw.metric("turbo_gateway_session_moves_total", reason="cheaper") == 1
        assert gw.metric("turbo_gateway_session_moves_total", reason="no_hit") == 0
        assert gw.metric("turbo_gateway_session_cached_prompt_tokens_total", placement="home") == 1024
        assert gw.metric("turbo_gateway_session_prompt_tokens_total", placement="home") == 1024 + 32
        assert gw.metric("turbo_gateway_session_prompt_tokens_total", placement="new") == 1024
        async with http.get(gw.url + "/metrics") as r:  # and on the wire
            text = await r.text()
        assert 'turbo_gateway_session_moves_total{reason="cheaper"} 1.0' in text
        assert 'turbo_gateway_session_cached_prompt_tokens_total{placement="home"} 1024.0' in text


async def test_expiry_is_learned_from_the_gaps_on_every_replica():
    """Agent loops with fast tool calls, their turns alternating between two replicas
    that share Redis: both learn that sessions come back within a fraction of a second
    (one by placing the turns, the other by learning them), and forget a session idle
    for longer than that, long before sessions.ttl_s."""
    async with fleet(False) as backends:
        with redis_url() as redis:
            cfg = config(backends, False, state={"url": redis, "lease_s": 0.5, "namespace": f"t{free_port()}"})
            async with running_gateway(cfg) as a, running_gateway(cfg) as b, \
                    aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
                assert a.metric("turbo_gateway_session_expiry_seconds") == 1800.0
                for i in range(8):
                    context = ids(20 + i, 256)
                    for turn in range(5):
                        gw, other = (a, b)[turn % 2], (b, a)[turn % 2]
                        learned = other.state.session_sync.stats.learned
                        await complete(http, gw.url, context + ids(40 + turn, 16 * (turn + 1)), f"loop{i}")
                        await wait_until(lambda o=other, n=learned: o.state.session_sync.stats.learned > n)
                for gw in (a, b):
                    table = gw.state.core.router.sessions
                    assert table.gaps.returns >= 32
                    table.expire(gw.state.loop.time())
                    # learned from the loops' gaps (a power of two: 0.5 s on a quiet machine, more
                    # when the machine is loaded and the gaps longer), far below sessions.ttl_s
                    assert gw.metric("turbo_gateway_session_expiry_seconds") <= 4.0
                horizon = a.metric("turbo_gateway_session_expiry_seconds")
                context = ids(60, 256)
                await complete(http, a.url, context, "idle")
                await asyncio.sleep(horizon + 0.5)
                _, route, _ = await complete(http, a.url, context + ids(61, 16), "idle")
                assert route["placement"] == "new"
