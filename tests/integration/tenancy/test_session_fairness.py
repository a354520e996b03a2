"""Session fairness in the admission queue (``admission.session_fairness``): a real
gateway on 127.0.0.1 in front of a simulated engine (loadtest.sim), saturated by one
request so that the next ones queue. Under ``las`` a key's short session goes before its
long one whatever their arrival order; under ``off`` they go in arrival order; and
another key naming the same ``x-session-id`` charges a session of its own, so it cannot
push the first key's session back."""

from __future__ import annotations

import asyncio
import hashlib

import aiohttp
import pytest

from gateway.config import Admission
from gateway.pipeline.session import scoped
from gateway.tenancy.fair_queue import Waiter, WaitQueue
from loadtest.sim.server import SimBackendConfig, start_backends
from tests.support.servers import gateway_config, running_gateway, wait_until

KEYS = ("alice", "bob")


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer sk-{name}-session-fairness"}


def keys() -> dict:
    return {"keys": [{"name": n, "key_sha256": hashlib.sha256(f"sk-{n}-session-fairness".encode()).hexdigest()}
                     for n in KEYS]}


def body(words: int, tag: str, max_tokens: int = 4) -> dict:
    text = " ".join([tag] + ["token"] * (words - 1))
    return {"model": "m", "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": text}]}


async def turn(http: aiohttp.ClientSession, url: str, key: str, session: str | None, words: int,
               max_tokens: int = 4) -> None:
    headers = auth(key) | ({"x-session-id": session} if session else {})
    async with http.post(url + "/v1/chat/completions", json=body(words, session or "none", max_tokens),
                         headers=headers) as r:
        assert r.status == 200, await r.text()
        await r.read()


@pytest.fixture
async def engine():
    backends, urls = await start_backends([SimBackendConfig(name="e", models=["m"], profile="demo", speed=1.0)])
    try:
        yield urls["e"]
    finally:
        for b in backends:
            await b.cleanup()


async def served_order(url: str, fairness: str, bob_names_short: bool) -> tuple[list[str], dict[str, float]]:
    """Alice's session ``long`` runs four 400-word turns and ``short`` one 20-word turn
    (with ``bob_names_short``, bob then sends six 600-word turns under ``x-session-id:
    short`` too); then one request holds the engine (``max_in_flight_per_backend: 1``)
    while ``long``'s next turn queues, then ``short``'s. Returns the two sessions in the
    order they were served, and the service the queue holds for each scoped session."""
    cfg = gateway_config([{"name": "e", "url": url, "models": ["m"]}], auth=keys(),
                         admission={"max_in_flight_per_backend": 1, "session_fairness": fairness,
                                    "queue_timeout_s": 60})
    async with running_gateway(cfg) as gw, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        q = gw.state.admission.queue
        ids = {"long": scoped("alice", "long"), "short": scoped("alice", "short"), "bob": scoped("bob", "short")}
        for _ in range(4):
            await turn(http, gw.url, "alice", "long", 400)
        await turn(http, gw.url, "alice", "short", 20)
        if bob_names_short:
            for _ in range(6):
                await turn(http, gw.url, "bob", "short", 600)
        await wait_until(lambda: gw.in_flight("e") == 0)
        service = {k: q.sessions.value(v) for k, v in ids.items()}
        order: list[str] = []

        async def queued(name: str) -> None:
            await turn(http, gw.url, "alice", name, 20)
            order.append(name)

        hold = asyncio.create_task(turn(http, gw.url, "alice", None, 10, max_tokens=150))
        await wait_until(lambda: gw.in_flight("e") == 1)
        first = asyncio.create_task(queued("long"))
        await wait_until(lambda: gw.state.admission.waiting == 1)
        second = asyncio.create_task(queued("short"))
        await wait_until(lambda: gw.state.admission.waiting == 2)
        await asyncio.gather(hold, first, second)
        return order, service


async def test_a_short_session_goes_before_a_long_one_that_queued_first(engine):
    order, service = await served_order(engine, "las", bob_names_short=False)
    assert service["long"] > service["short"] > 0  # each session's uncached prompt and output, from usage
    assert order == ["short", "long"]


async def test_without_session_fairness_they_go_in_arrival_order(engine):
    order, _ = await served_order(engine, "off", bob_names_short=False)
    assert order == ["long", "short"]


async def test_another_key_naming_the_session_charges_its_own(engine):
    """Bob sends far more work than alice's long session under alice's short
    session's ``x-session-id``: it lands on bob's own session, and alice's short
    session still goes first."""
    order, service = await served_order(engine, "las", bob_names_short=True)
    assert service["bob"] > service["long"] > service["short"]
    assert order == ["short", "long"]


def test_the_queue_orders_a_keys_requests_by_session_service_not_across_keys():
    """On the queue itself: sessions order within one key only; the key's turn comes
    from the token counters, and a request that waited half the queue's deadline is
    served first."""
    q = WaitQueue(Admission(max_in_flight_per_backend=1, fairness="round_robin", session_fairness="las",
                            queue_timeout_s=10))
    q.sessions.charge("a-heavy", 1000.0)
    q.sessions.charge("b-light", 1.0)
    for w in (Waiter("m", "a", 1, 1, "a-heavy", 0.0), Waiter("m", "a", 1, 1, "a-light", 0.0),
              Waiter("m", "b", 1, 1, "b-heavy", 0.0), Waiter("m", "b", 1, 1, "b-light", 0.0)):
        q.push(w, 0)
    q.sessions.charge("b-heavy", 500.0)
    got = [w.session for w in iter(lambda: q.pop_next(lambda _m: 1, 1.0), None)]
    assert got == ["a-light", "b-light", "a-heavy", "b-heavy"]  # keys in turn, sessions by service
    old, new = Waiter("m", "a", 1, 1, "a-heavy", 0.0), Waiter("m", "a", 1, 1, "a-light", 4.0)
    q.push(old, 0)
    q.push(new, 0)
    assert q.pop_next(lambda _m: 1, 5.0) is old  # waited 5 s of a 10 s deadline: it goes first
    assert q.pop_next(lambda _m: 0, 5.0) is None  # no room: nobody
