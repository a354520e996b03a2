"""Fair shares in the admission queue: the Virtual Token Counter (``admission.fairness:
tokens``) against round robin by requests. The counter rules on the queue itself, then
real gateways on 127.0.0.1 in front of scripted backends (and a real Redis-protocol
server for two replicas)."""

from __future__ import annotations

import asyncio
import hashlib

import aiohttp
import orjson
import pytest
from aiohttp import web

from gateway.config import Admission
from gateway.ops.metrics import key_label
from gateway.tenancy.admission import AdmissionControl, Charge, TokenCounters
from routing import BackendSpec, Fleet
from tests.support.redis_server import redis_url
from tests.support.servers import ScriptedBackend, free_port, gateway_config, running_gateway, wait_until

OUTPUT_TOKENS = 4  # what the scripted backends answer


def sha(k: str) -> str:
    return hashlib.sha256(k.encode()).hexdigest()


def keys(*names: str, **weights: float) -> dict:
    return {"keys": [{"name": n, "key_sha256": sha("sk-" + n), "weight": weights.get(n, 1.0)} for n in names]}


def auth(name: str) -> dict:
    return {"Authorization": f"Bearer sk-{name}"}


def chat(text: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": OUTPUT_TOKENS}


def prompt_of(raw: bytes) -> str:
    return orjson.loads(raw)["messages"][0]["content"]


async def usage_answer(be: ScriptedBackend, request: web.Request, body: dict) -> web.Response:
    """A JSON answer whose ``usage`` counts one prompt token per word."""
    words = len(body["messages"][0]["content"].split())
    return web.json_response({
        "id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "a b c d"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": words, "completion_tokens": OUTPUT_TOKENS,
                  "total_tokens": words + OUTPUT_TOKENS}})


# ---- the counter rules, on the queue itself --------------------------------------------------


def queue(**cfg) -> tuple[AdmissionControl, Fleet]:
    fleet = Fleet([BackendSpec("b", frozenset({"m"}))])
    return AdmissionControl(Admission(max_in_flight_per_backend=1, queue_size=1000, queue_timeout_s=30, **cfg),
                            fleet), fleet


async def serve_in_order(adm: AdmissionControl, fleet: Fleet,
                         requests: list[tuple[str, int, float, float]]) -> list[str]:
    """Queue ``requests`` (key, priority, prompt tokens, weight) behind a held backend,
    in this order, then let them through one at a time; the keys in the order served.
    Each request's usage reports its prompt tokens and no output."""
    hold = fleet.reserve(fleet.backends["b"])
    order: list[str] = []

    async def one(key: str, prio: int, prompt: float, weight: float) -> None:
        charge = await adm.admit("m", key, prio, prompt, weight)
        order.append(key)
        r = fleet.reserve(fleet.backends["b"])  # routed: takes the backend's slot
        await asyncio.sleep(0)
        r.release()
        charge.settle(int(prompt), 0)
        adm.pump()

    tasks = []
    for req in requests:
        tasks.append(asyncio.create_task(one(*req)))
        await asyncio.sleep(0)  # queued in this order
    await wait_until(lambda: adm.waiting == len(requests))
    hold.release()
    adm.pump()
    await asyncio.gather(*tasks)
    return order


def test_a_key_that_starts_waiting_is_lifted_to_the_lowest_waiting_counter():
    c = TokenCounters()
    c.charge("a", 500.0)
    c.charge("b", 300.0)
    c.activate("new", 0, ["a", "b"])
    assert c.value("new") == 300.0  # no credit for the time it sent nothing
    c.charge("rich", 900.0)
    c.activate("rich", 0, ["a", "b"])
    assert c.value("rich") == 900.0  # a lift never lowers a counter
    c.left("b", 0)
    c.activate("late", 1, [])
    assert c.value("late") == 0.0  # another priority: nothing to lift to
    c.activate("late", 0, [])
    assert c.value("late") == 300.0  # nobody waiting: the last key to leave


def test_a_charge_is_corrected_to_usage_and_refunded_when_never_dispatched():
    c = TokenCounters()
    ch = Charge(c, "k", 2.0, 1.0, 2.0, 100.0)
    assert c.value("k") == 50.0  # the estimated prompt at admission, over the weight
    ch.settle(150, 10)
    assert c.value("k") == (150 + 2 * 10) / 2.0
    ch.settle(1000, 1000)
    assert c.value("k") == 85.0  # settled once
    Charge(c, "k", 1.0, 1.0, 2.0, 40.0).settle(None, None, dispatched=False)
    assert c.value("k") == 85.0


async def test_idle_time_banks_no_credit():
    adm, fleet = queue()
    for _ in range(10):  # busy is served alone, straight through: its counter grows
        ch = await adm.admit("m", "busy", 0, 1000.0)
        ch.settle(1000, 0)
    assert adm.waiting == 0 and adm.counters.value("busy") == 10_000.0
    order = await serve_in_order(adm, fleet, [("busy", 0, 100.0, 1.0)] * 5 + [("quiet", 0, 100.0, 1.0)] * 5)
    # quiet, lifted to busy's counter when it started waiting, shares: it does not take
    # the next five for the 10k tokens it did not ask for
    assert order == ["busy", "quiet"] * 5


async def test_weights_share_tokens_in_proportion():
    adm, fleet = queue()
    order = await serve_in_order(adm, fleet, [("double", 0, 100.0, 2.0)] * 30 + [("single", 0, 100.0, 1.0)] * 30)
    first = order[:30]
    assert abs(first.count("double") - 20) <= 1 and abs(first.count("single") - 10) <= 1


async def test_longer_prompts_get_fewer_turns_and_round_robin_does_not():
    reqs = [("long", 0, 1000.0, 1.0)] * 10 + [("short", 0, 100.0, 1.0)] * 30
    adm, fleet = queue(fairness="tokens")
    first = (await serve_in_order(adm, fleet, reqs))[:20]
    assert first.count("long") == 2  # 2 x 1000 tokens against 18 x 100
    adm, fleet = queue(fairness="round_robin")
    first = (await serve_in_order(adm, fleet, reqs))[:20]
    assert first.count("long") == 10  # one request each in turn


async def test_priority_classes_go_first_and_fairness_is_within_a_class():
    adm, fleet = queue()
    ch = await adm.admit("m", "vip", 5, 50_000.0)  # the most served key of all
    ch.settle(50_000, 0)
    order = await serve_in_order(adm, fleet, [("a", 0, 100.0, 1.0)] * 3 + [("b", 0, 100.0, 1.0)] * 3
                                 + [("vip", 5, 100.0, 1.0)] * 2)
    assert order == ["vip", "vip", "a", "b", "a", "b", "a", "b"]


# ---- real gateways ------------------------------------------------------------------------------


async def _two_tenants(fairness: str) -> dict[str, int]:
    """Keys ``short`` (100-word prompts) and ``long`` (1000-word) each keep 8 requests
    open against a fleet of 2 slots (so each has requests waiting throughout); the
    service (prompt + 2 x output tokens) each key got while both were backlogged: the
    dispatches until either had at most its workers' worth of requests left to send."""
    workers, budget = 8, {"short": 240, "long": 24}
    words = {"short": 100, "long": 1000}
    dispatched: list[str] = []  # the key of each request the backends received, in order

    async def answer(be, request, body):
        dispatched.append(body["messages"][0]["content"].split(" ", 1)[0])
        return await usage_answer(be, request, body)

    async with ScriptedBackend(handler=answer).running() as b1, ScriptedBackend(handler=answer).running() as b2:
        cfg = gateway_config([{"name": "b1", "url": b1.url, "models": ["m"]},
                              {"name": "b2", "url": b2.url, "models": ["m"]}],
                             auth=keys("short", "long"),
                             admission={"max_in_flight_per_backend": 1, "fairness": fairness})
        async with running_gateway(cfg) as gw:
            left = dict(budget)
            done = asyncio.Event()

            async def worker(key: str, s: aiohttp.ClientSession) -> None:
                text = " ".join([key] + ["word"] * (words[key] - 1))
                while left[key] > 0 and not done.is_set():
                    left[key] -= 1
                    async with s.post(gw.url + "/v1/chat/completions", json=chat(text), headers=auth(key)) as r:
                        assert r.status == 200, await r.text()
                        await r.read()
                done.set()  # one key ran out: the other stops too

            async with aiohttp.ClientSession() as s:
                await asyncio.gather(*(worker(k, s) for k in budget for _ in range(workers)))
            assert gw.state.admission.admitted_after_wait > 0  # the fleet was saturated
    served = {"short": 0, "long": 0}
    count = {"short": 0, "long": 0}
    for key in dispatched:
        if count[key] >= budget[key] - workers:
            break
        count[key] += 1
        served[key] += words[key] + 2 * OUTPUT_TOKENS
    return served


async def test_two_keys_get_equal_tokens_under_saturation_by_tokens_not_by_round_robin():
    served = await _two_tenants("tokens")
    assert min(served.values()) >= 0.8 * max(served.values()), served
    served = await _two_tenants("round_robin")
    assert served["long"] >= 5 * served["short"], served  # a request each in turn: 10x the tokens


async def test_a_key_that_arrives_late_is_served_at_once():
    go = asyncio.Semaphore(0)

    async def held(be, request, body):
        await go.acquire()
        return await usage_answer(be, request, body)

    async with ScriptedBackend(handler=held).running() as be:
        cfg = gateway_config([{"name": "b", "url": be.url, "models": ["m"]}], auth=keys("a", "b", "late"),
                             admission={"max_in_flight_per_backend": 1})
        async with running_gateway(cfg) as gw:
            adm = gw.state.admission
            async with aiohttp.ClientSession() as s:
                async def send(key: str) -> int:
                    async with s.post(gw.url + "/v1/chat/completions", json=chat(f"{key} " + "w " * 50),
                                      headers=auth(key)) as r:
                        await r.read()
                        return r.status

                tasks = [asyncio.create_task(send(k)) for _ in range(5) for k in ("a", "b")]
                await wait_until(lambda: adm.waiting == 9 and len(be.bodies) == 1)
                for n in (2, 3):  # serve two more: a and b have been served and keep a backlog of 7
                    go.release()
                    await wait_until(lambda: len(be.bodies) == n)
                late = asyncio.create_task(send("late"))
                await wait_until(lambda: adm.waiting == 8)
                before = len(be.bodies)
                while not any(prompt_of(b).startswith("late") for b in be.bodies):
                    go.release()
                    n = len(be.bodies) + 1
                    await wait_until(lambda: len(be.bodies) == n)
                at = next(i for i, b in enumerate(be.bodies) if prompt_of(b).startswith("late"))
                assert at - before <= 1  # at most one of the 7 waiting went first
                for _ in range(20):
                    go.release()
                assert await late == 200 and all(s == 200 for s in await asyncio.gather(*tasks))
            served = {k: gw.metric("turbo_gateway_admission_key_service_tokens", key_name=key_label("hashed", k))
                      for k in ("a", "b")}
            assert served["a"] > 0 and served["a"] == adm.counters.value("a") and served["b"] == adm.counters.value("b")


@pytest.mark.slow
async def test_service_on_one_replica_counts_on_the_other():
    """Keys ``light`` and ``heavy`` wait with equal counters on replica B; replica A
    serves ``heavy`` meanwhile (another model, no queue there): B hears of it through
    Redis and serves ``light`` first."""
    hold = asyncio.Event()

    async def gated(be, request, body):
        if body["messages"][0]["content"].startswith("holder"):
            await hold.wait()
        return await usage_answer(be, request, body)

    with redis_url() as url:
        async with ScriptedBackend(handler=gated).running() as bm, \
                ScriptedBackend(handler=usage_answer).running() as bm2:
            cfg = gateway_config([{"name": "x", "url": bm.url, "models": ["m"]},
                                  {"name": "y", "url": bm2.url, "models": ["m2"]}],
                                 auth=keys("holder", "light", "heavy"),
                                 state={"url": url, "namespace": f"fair{free_port()}"},
                                 admission={"max_in_flight_per_backend": 1})
            async with running_gateway(cfg) as a, running_gateway(cfg) as b, aiohttp.ClientSession() as s:
                async def send(gw, key: str, model: str = "m", words: int = 10) -> int:
                    body = {**chat(f"{key} " + "w " * words), "model": model}
                    async with s.post(gw.url + "/v1/chat/completions", json=body, headers=auth(key)) as r:
                        await r.read()
                        return r.status

                adm = b.state.admission
                holder = asyncio.create_task(send(b, "holder"))
                await wait_until(lambda: len(bm.bodies) == 1)
                heavy = asyncio.create_task(send(b, "heavy"))
                await wait_until(lambda: adm.waiting == 1)
                light = asyncio.create_task(send(b, "light"))
                await wait_until(lambda: adm.waiting == 2)
                assert adm.counters.value("light") == adm.counters.value("heavy")  # lifted: equal
                for _ in range(3):
                    assert await send(a, "heavy", "m2", 1000) == 200
                await wait_until(lambda: adm.counters.value("heavy") > adm.counters.value("light") + 2000)
                hold.set()
                assert [await t for t in (holder, heavy, light)] == [200, 200, 200]
                assert [prompt_of(raw).split()[0] for raw in bm.bodies] == ["holder", "light", "heavy"]
                # both replicas see the same shared service
                await wait_until(lambda: abs(a.state.admission.counters.value("heavy")
                                             - adm.counters.value("heavy")) < 1e-6)
