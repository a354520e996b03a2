"""The director and its steps on their own: no socket, no backend.

The attempt step is a scripted :data:`gateway.pipeline.context.Send` (the project's own
seam: what :func:`gateway.pipeline.attempt.run` does, played from a script) and the
answer goes to a :class:`gateway.pipeline.downstream.CollectDownstream`. Each case checks
the answer, the attempts, that every reservation was released and that the request
was settled exactly once (one usage-ledger entry).
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from gateway.apis.registry import CHAT
from gateway.errors import BackendStatus, ConnectFailed, Disconnected
from gateway.pipeline import attempt, director, prefill, settlement
from gateway.pipeline.downstream import ClientGone, CollectDownstream
from gateway.pipeline.keepalive import KeepAlives
from gateway.pipeline.stream_scan import StreamScan
from gateway.runtime import build_state
from tests.support.servers import gateway_config

BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
HEADERS = {"Content-Type": "application/json"}
ANSWER = orjson.dumps({"choices": [{"message": {"content": "ok"}}],
                       "usage": {"prompt_tokens": 3, "completion_tokens": 2}})


def _state(cfg):
    state = build_state(cfg)
    state.loop = asyncio.get_running_loop()
    state.keepalives = KeepAlives(state.loop)
    state.clients = {b.name: b.name for b in cfg.backends}  # the scripted Send never uses its client
    settled: list[tuple[str, bool]] = []
    record = state.usage.record

    def counting(key, model, prompt, cached, completion, error, cost):
        settled.append((model, error))
        record(key, model, prompt, cached, completion, error, cost)

    state.usage.record = counting
    return state, settled


class Script:
    """A scripted Send: each attempt plays the next step (``"ok"``, ``"stream_breaks"``,
    ``"client_gone"``, or an UpstreamError factory taking the backend's name)."""

    def __init__(self, *steps: Any) -> None:
        self.steps = list(steps)
        self.reservations: list[Any] = []
        self.models: list[str] = []

    async def __call__(self, state, ctx, client, reservation) -> None:
        self.reservations.append(reservation)
        self.models.append(ctx.model)
        step = self.steps.pop(0)
        if step == "ok":
            settlement.first_byte(state, ctx, None, state.loop.time())
            settlement.completed(state, ctx, reservation, orjson.loads(ANSWER)["usage"], 0, whole=True)
            settlement.finish(state, ctx, 200)
            ctx.down.respond(200, ANSWER, {"Content-Type": "application/json"})
        elif step == "stream_breaks":
            settlement.first_byte(state, ctx, reservation, state.loop.time())
            ctx.scan = StreamScan()
            ctx.down.start_stream_now({}, b'data: {"x": 1}\n\n')
            raise Disconnected(client, "backend broke the stream")
        elif step == "client_gone":
            settlement.client_left(state, ctx, client)
            raise ClientGone()
        else:
            raise step(client)


def _503(name: str) -> BackendStatus:
    return BackendStatus(name, 503, b'{"error": {"message": "busy"}}', "application/json")


async def _serve(state, script: Script, body: bytes = BODY) -> CollectDownstream:
    down = CollectDownstream()
    await director.handle(state, CHAT, HEADERS, body, down, state.loop.time(), "rid-1", send=script)
    return down


def _released_once(state, script: Script) -> None:
    assert script.reservations and all(r.released for r in script.reservations)
    assert all(b.in_flight == 0 for b in state.fleet.backends.values())


def _two_backends(**extra):
    return gateway_config([{"name": "a", "url": "http://127.0.0.1:9", "models": ["m"]},
                           {"name": "b", "url": "http://127.0.0.1:9", "models": ["m"]}],
                          breaker={"failure_threshold": 0}, **extra)


async def test_success():
    state, settled = _state(_two_backends())
    script = Script("ok")
    down = await _serve(state, script)
    assert (down.status, down.body) == (200, ANSWER)
    assert settled == [("m", False)]
    _released_once(state, script)


async def test_retry_then_success():
    state, settled = _state(_two_backends())
    script = Script(lambda n: ConnectFailed(n, "refused"), "ok")
    down = await _serve(state, script)
    assert down.status == 200 and len(script.reservations) == 2
    assert settled == [("m", False)]
    _released_once(state, script)


async def test_retry_budget_exhausted():
    state, settled = _state(_two_backends())
    script = Script(_503, _503, _503)
    down = await _serve(state, script)
    assert down.status == 503 and len(script.reservations) == 3  # retries.max_attempts
    assert settled == [("m", True)]
    _released_once(state, script)


async def test_fallback_model():
    cfg = gateway_config([{"name": "big-1", "url": "http://127.0.0.1:9", "models": ["big"]},
                          {"name": "small-1", "url": "http://127.0.0.1:9", "models": ["small"]}],
                         routing={"policy": "round_robin", "fallbacks": {"big": [{"model": "small"}]}},
                         breaker={"failure_threshold": 0}, retries={"max_attempts": 1})
    state, settled = _state(cfg)
    script = Script(_503, "ok")
    body = orjson.dumps({"model": "big", "messages": [{"role": "user", "content": "hi"}]})
    down = await _serve(state, script, body)
    assert down.status == 200 and script.models == ["big", "small"]
    assert settled == [("small", False)]
    _released_once(state, script)


async def test_stream_failed_after_first_byte_ends_with_an_error_event():
    state, settled = _state(_two_backends())
    script = Script("stream_breaks", "ok")
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    down = await _serve(state, script, body)
    assert len(script.reservations) == 1  # never retried once a byte reached the client
    assert down.body.startswith(b'data: {"x": 1}\n\n') and b'"error"' in down.body and b"[DONE]" not in down.body
    assert settled == [("m", True)]
    _released_once(state, script)


async def test_client_gone_releases_once_and_settles_once():
    state, settled = _state(_two_backends())
    script = Script("client_gone")
    down = await _serve(state, script)
    assert down.status == 0  # nothing answered
    assert settled == [("m", True)]
    _released_once(state, script)


def _disaggregated():
    return gateway_config(
        [{"name": "pf", "url": "http://127.0.0.1:9", "models": ["m"], "pool": "prefill"},
         {"name": "dc", "url": "http://127.0.0.1:9", "models": ["m"], "pool": "decode"}],
        pools=[{"name": "prefill", "role": "prefill"}, {"name": "decode", "role": "decode"}],
        routing={"long_prompt_tokens": 16, "scrape_interval_s": 0}, breaker={"failure_threshold": 0})


LONG = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "lorem ipsum " * 200}]})


@pytest.mark.parametrize("leg_ok", [True, False])
async def test_prefill_leg(monkeypatch, leg_ok):
    state, settled = _state(_disaggregated())
    fetched: list[str] = []

    async def fetch(client, api, body, request_id, trace=b""):  # the prefill leg's scripted transport
        fetched.append(client)
        if not leg_ok:
            raise ConnectFailed(client, "refused")
        return orjson.dumps({"kv_transfer_params": {"remote_engine_id": "e1"}})

    monkeypatch.setattr(attempt, "fetch", fetch)
    bodies: list[bytes] = []
    script = Script("ok")
    real = script.__call__

    async def send(state, ctx, client, reservation):
        bodies.append(ctx.body)
        await real(state, ctx, client, reservation)

    down = CollectDownstream()
    await director.handle(state, CHAT, HEADERS, LONG, down, state.loop.time(), "rid-2", send=send)
    assert down.status == 200 and set(fetched) == {"pf"}
    assert (b"kv_transfer_params" in bodies[0]) is leg_ok
    assert settled == [("m", False)]
    assert all(b.in_flight == 0 for b in state.fleet.backends.values())


async def test_prefill_run_returns_params_and_settles_the_leg(monkeypatch):
    state, _ = _state(_disaggregated())

    async def fetch(client, api, body, request_id, trace=b""):
        return orjson.dumps({"kv_transfer_params": {"remote_engine_id": "e1"}})

    monkeypatch.setattr(attempt, "fetch", fetch)
    from gateway.pipeline.context import RequestContext
    from gateway.pipeline.openai_request import parse_request
    parsed = parse_request(CHAT, LONG, orjson.loads(LONG))
    ctx = RequestContext(CollectDownstream(), parsed, "r", state.loop.time(), attempt.run, "m", parsed.data)
    _, req = state.core.request("m", parsed.prompt_text, None)
    assert await prefill.run(state, ctx, req) == {"remote_engine_id": "e1"}
    assert all(b.in_flight == 0 for b in state.fleet.backends.values())


async def test_a_prompt_too_long_for_every_backend_is_refused_unsent(monkeypatch):
    from gateway.pipeline import prompt

    state, settled = _state(_two_backends())

    def exact(state, ctx):  # an exact count, as the model's tokenizer gives it
        return [1] * 5000

    monkeypatch.setattr(prompt, "tokenization", exact)
    monkeypatch.setattr(state.core, "context_exceeded", lambda model, n, max_tokens: 4096)
    script = Script()
    down = await _serve(state, script)
    err = orjson.loads(down.body)["error"]
    assert down.status == 400 and err["code"] == "context_length_exceeded" and not script.reservations
    assert settled == [("m", True)]
