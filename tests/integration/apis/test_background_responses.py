"""Background responses (``background: true``), run by the gateway: answered ``queued``
at once, polled with ``GET /v1/responses/{id}`` through ``in_progress`` to
``completed`` (the engine's answer under the gateway's id, chained like any stored
response), cancelled with ``POST .../cancel`` (the engine's request aborted), from the
replica running it or another one, and seen only by the key that made it. Simulated
engines behind the gateway, the official openai SDK in front; two replicas share a
real Redis-protocol server (valkey)."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from contextlib import asynccontextmanager

import openai
import pytest

from loadtest.sim.server import SimBackendConfig, start_backends
from tests.support.redis_server import redis_url
from tests.support.servers import gateway_config, running_gateway, wait_until

MODEL = "sim-model"
KEYS = {"alice": "sk-alice", "bob": "sk-bob"}
SYSTEM = "You write long answers about the history of bread. " * 10


@asynccontextmanager
async def fleet(speed: float, eos_after: int | None = None):
    """The gateway before one simulated engine running ``speed`` times real time
    (``eos_after``: its answers' natural length in tokens)."""
    runners, urls = await start_backends([SimBackendConfig.from_dict(
        {"name": "a", "models": [MODEL], "speed": speed, "eos_after": eos_after})])
    cfg = gateway_config([{"name": "a", "url": urls["a"], "models": [MODEL]}],
                         auth={"keys": [{"name": n, "key_sha256": hashlib.sha256(k.encode()).hexdigest()}
                                        for n, k in KEYS.items()]})
    try:
        async with running_gateway(cfg) as gw:
            yield [gw]
    finally:
        for r in runners:
            await r.cleanup()


def client(gw, who: str = "alice") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEYS[who], max_retries=0)


async def poll(c: openai.AsyncOpenAI, rid: str, until: tuple[str, ...], seen: list[str] | None = None):
    """The response ``rid`` once its status is one of ``until`` (polled every 20 ms,
    for at most 30 s); ``seen``: the statuses seen on the way."""
    for _ in range(1500):
        r = await c.responses.retrieve(rid)
        if seen is not None and (not seen or seen[-1] != r.status):
            seen.append(r.status)
        if r.status in until:
            return r
        await asyncio.sleep(0.02)
    raise AssertionError(f"response {rid} never reached {until}: {r.status}")


async def test_a_background_response_is_queued_polled_chained_and_kept_per_key():
    async with fleet(speed=5.0, eos_after=12) as [gw], client(gw) as alice, client(gw, "bob") as bob:
        r = await alice.responses.create(model=MODEL, instructions=SYSTEM, input="Tell me.", background=True,
                                         max_output_tokens=40)
        assert r.status == "queued" and r.background and r.id.startswith("resp_") and r.output == []
        seen: list[str] = []
        done = await poll(alice, r.id, ("completed", "incomplete", "failed"), seen)
        assert "in_progress" in seen and seen[-1] == "completed", seen
        assert done.id == r.id and done.background and done.output_text
        assert done.usage is not None and done.usage.output_tokens == len(done.output_text.split()) > 0
        # counted like any request of the key: metrics and the usage ledger
        assert gw.metric("turbo_gateway_requests_total", model=MODEL, backend="a", status="200") == 1
        assert gw.metric("turbo_gateway_completion_tokens_total", model=MODEL, api="responses") == \
            done.usage.output_tokens
        # its input items, and a next turn chained on it
        items = await alice.responses.input_items.list(r.id)
        assert [i.content for i in items.data] == ["Tell me."]
        r2 = await alice.responses.create(model=MODEL, instructions=SYSTEM, input="More.", previous_response_id=r.id,
                                          max_output_tokens=4)
        assert r2.usage is not None and r2.usage.input_tokens > done.usage.input_tokens + done.usage.output_tokens
        # a response that ended is cancelled as it is; a foreground one cannot be
        assert (await alice.responses.cancel(r.id)).status == "completed"
        with pytest.raises(openai.BadRequestError):
            await alice.responses.cancel(r2.id)
        # another key sees none of it
        with pytest.raises(openai.NotFoundError):
            await bob.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            await bob.responses.cancel(r.id)
        # what the gateway does not serve is refused, in OpenAI's shape, naming the field
        with pytest.raises(openai.BadRequestError) as e:
            await alice.responses.create(model=MODEL, input="x", background=True, stream=True)
        assert e.value.body["param"] == "stream"
        with pytest.raises(openai.BadRequestError) as e:
            await alice.responses.create(model=MODEL, input="x", background=True, store=False)
        assert e.value.body["param"] == "store"
        with pytest.raises(openai.BadRequestError) as e:  # its previous response must be known
            await alice.responses.create(model=MODEL, input="x", background=True, previous_response_id="resp_none")
        assert e.value.body["code"] == "previous_response_not_found"
    assert gw.idle("a")


async def test_a_running_background_response_is_cancelled_and_its_engine_request_aborted():
    async with fleet(speed=1.0) as [gw], client(gw) as alice:
        r = await alice.responses.create(model=MODEL, input="A long story, please.", background=True,
                                         max_output_tokens=2000)
        await poll(alice, r.id, ("in_progress",))
        assert gw.state.fleet.backends["a"].in_flight == 1
        cancelled = await alice.responses.cancel(r.id)
        assert cancelled.status == "cancelled"
        assert (await alice.responses.retrieve(r.id)).status == "cancelled"
        assert gw.idle("a")  # the engine's request was aborted, its reservation released
        with pytest.raises(openai.BadRequestError) as e:  # an unfinished turn cannot be chained on
            await alice.responses.create(model=MODEL, input="x", previous_response_id=(await alice.responses.create(
                model=MODEL, input="y", background=True, max_output_tokens=2000)).id)
        assert e.value.body["code"] == "previous_response_unfinished"


async def test_a_cancel_on_another_replica_reaches_the_run_and_a_stopping_replica_fails_its_runs():
    with redis_url() as redis:
        runners, urls = await start_backends([SimBackendConfig.from_dict(
            {"name": "a", "models": [MODEL], "speed": 1.0})])
        cfg = gateway_config([{"name": "a", "url": urls["a"], "models": [MODEL]}],
                             auth={"keys": [{"name": n, "key_sha256": hashlib.sha256(k.encode()).hexdigest()}
                                            for n, k in KEYS.items()]},
                             state={"url": redis, "namespace": f"t{uuid.uuid4().hex[:8]}"})
        try:
            async with running_gateway(cfg) as gw2, client(gw2) as two:
                async with running_gateway(cfg) as gw1, client(gw1) as one:
                    r = await one.responses.create(model=MODEL, input="A long story, please.", background=True,
                                                   max_output_tokens=2000)
                    await poll(two, r.id, ("in_progress",))  # the other replica polls it
                    assert (await two.responses.cancel(r.id)).status == "cancelled"
                    # the running replica reads the cancel within its poll interval and aborts the run
                    await wait_until(lambda: not gw1.state.background)
                    await wait_until(lambda: gw1.idle("a"))
                    assert (await one.responses.retrieve(r.id)).status == "cancelled"
                    # a run under way when its replica stops is marked failed
                    left = await one.responses.create(model=MODEL, input="Another long one.", background=True,
                                                      max_output_tokens=2000)
                    await poll(one, left.id, ("in_progress",))
                failed = await two.responses.retrieve(left.id)  # seen from the other replica
                assert failed.status == "failed" and failed.error is not None
                assert failed.error.code == "gateway_stopped"
        finally:
            for runner in runners:
                await runner.cleanup()
