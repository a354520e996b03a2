"""Model fallbacks (``routing.fallbacks``): a request its model cannot serve goes to the
next model of its chain whose triggers include the failure, only before the first byte
reached the client, and says so in ``x-turbo-route`` and a metric. Real backends on
127.0.0.1, the real openai SDK where a client's view matters."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import ConfigError, parse_config
from tests.support.servers import (
    ScriptedBackend,
    free_port,
    gateway_config,
    running_gateway,
    sse_chunk,
)

MESSAGES = [{"role": "user", "content": "hi"}]


async def _post(url: str, body: dict) -> tuple[int, dict, bytes]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", json=body) as r:
            return r.status, dict(r.headers), await r.read()


async def _metric(url: str, name: str, **labels: str) -> float:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics") as r:
            text = await r.text()
    return sum(smp.value for fam in text_string_to_metric_families(text) for smp in fam.samples
               if smp.name == name and all(smp.labels.get(k) == v for k, v in labels.items()))


def _cfg(big_url: str, small_url: str, on: list[str] | None = None, big_extra: dict | None = None, **extra):
    fallback = {"model": "small"} if on is None else {"model": "small", "on": on}
    return gateway_config([{"name": "big-1", "url": big_url, "models": ["big"], **(big_extra or {})},
                           {"name": "small-1", "url": small_url, "models": ["small"]}],
                          routing={"policy": "round_robin", "fallbacks": {"big": [fallback]}},
                          breaker={"failure_threshold": 0}, **extra)


async def _status(status: int, b, request, body):
    return web.json_response({"error": {"message": "engine overloaded", "type": "server_error"}}, status=status)


async def _silent(b, request, body):
    await asyncio.sleep(60)  # accepts, says nothing; cancelled when the gateway gives up
    raise AssertionError("unreachable")


@pytest.mark.parametrize("stream", [False, True])
async def test_an_unavailable_model_falls_back(stream):
    async def answer(b, request, body):
        return await _status(503, b, request, body)

    async with ScriptedBackend(handler=answer).running() as big, ScriptedBackend().running() as small:
        async with running_gateway(_cfg(big.url, small.url)) as gw:
            status, headers, body = await _post(gw.url, {"model": "big", "messages": MESSAGES, "stream": stream})
            assert status == 200
            assert "fallback=small; fallback_reason=unavailable" in headers["x-turbo-route"]
            assert headers["x-turbo-backend"] == "small-1"
            models = [orjson.loads(line[6:])["model"] for line in body.split(b"\n") if line.startswith(b"data: {")] \
                if stream else [orjson.loads(body)["model"]]
            assert set(models) == {"small"}  # the fallback's own answer, not rewritten
            assert len(big.attempt_times) == 3  # big's own retries first (retries.max_attempts)
            assert [orjson.loads(b)["model"] for b in small.bodies] == ["small"]  # sent as the fallback model
            assert await _metric(gw.url, "turbo_gateway_fallbacks_total", model="big", fallback="small",
                                 reason="unavailable") == 1


async def test_no_backend_reachable_falls_back_with_the_sdk():
    async with ScriptedBackend().running() as small:
        async with running_gateway(_cfg(f"http://127.0.0.1:{free_port()}", small.url)) as gw:
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused")
            r = await client.chat.completions.with_raw_response.create(model="big", messages=MESSAGES, max_tokens=4)
            await client.close()
            assert r.parse().model == "small" and r.parse().choices[0].message.content == "hello"
            assert "fallback_reason=unavailable" in r.headers["x-turbo-route"]


async def test_a_silent_backend_falls_back_on_its_first_token_timeout():
    async with ScriptedBackend(handler=_silent).running() as big, ScriptedBackend().running() as small:
        cfg = _cfg(big.url, small.url, ["first_token_timeout"], {"timeouts": {"ttft_s": 0.3}},
                   retries={"max_attempts": 1})
        async with running_gateway(cfg) as gw:
            for stream in (True, False):
                status, headers, _body = await _post(gw.url, {"model": "big", "messages": MESSAGES, "stream": stream})
                assert status == 200 and headers["x-turbo-backend"] == "small-1"
                assert "fallback_reason=first_token_timeout" in headers["x-turbo-route"]
            assert await _metric(gw.url, "turbo_gateway_fallbacks_total", reason="first_token_timeout") == 2


async def test_a_slow_healthy_stream_is_never_cut_by_the_first_token_timeout():
    async def slow(b, request, body):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(6):  # 1.2 s in all, four times the first-token timeout
            await resp.write(sse_chunk(i, f"t{i} ", model="big"))
            await asyncio.sleep(0.2)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async with ScriptedBackend(handler=slow).running() as big, ScriptedBackend().running() as small:
        cfg = _cfg(big.url, small.url, ["first_token_timeout"], {"timeouts": {"ttft_s": 0.3}})
        async with running_gateway(cfg) as gw:
            status, headers, body = await _post(gw.url, {"model": "big", "messages": MESSAGES, "stream": True})
            assert status == 200 and headers["x-turbo-backend"] == "big-1"
            assert body.count(b'"model":"big"') == 6 and body.endswith(b"data: [DONE]\n\n")
            assert "fallback" not in headers["x-turbo-route"] and small.bodies == []


async def test_a_failure_outside_the_triggers_does_not_fall_back():
    async def answer(b, request, body):
        return await _status(503, b, request, body)

    async with ScriptedBackend(handler=answer).running() as big, ScriptedBackend().running() as small:
        async with running_gateway(_cfg(big.url, small.url, ["context_length"])) as gw:
            status, headers, _ = await _post(gw.url, {"model": "big", "messages": MESSAGES})
            assert status == 503 and headers["x-should-retry"] == "false"
            assert small.bodies == []


async def test_a_caller_error_never_falls_back():
    async def answer(b, request, body):
        return web.json_response({"error": {"message": "bad temperature", "type": "invalid_request_error",
                                            "param": "temperature", "code": None}}, status=400)

    async with ScriptedBackend(handler=answer).running() as big, ScriptedBackend().running() as small:
        async with running_gateway(_cfg(big.url, small.url, ["unavailable", "timeout", "context_length"])) as gw:
            status, _, body = await _post(gw.url, {"model": "big", "messages": MESSAGES})
            assert status == 400 and orjson.loads(body)["error"]["message"] == "bad temperature"
            assert small.bodies == [] and len(big.attempt_times) == 1


async def test_no_fallback_once_the_stream_reached_the_client():
    async def cut(b, request, body):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse_chunk(0, "t0 ", model="big"))
        request.transport.close()  # the engine dies mid-stream
        return resp

    async with ScriptedBackend(handler=cut).running() as big, ScriptedBackend().running() as small:
        async with running_gateway(_cfg(big.url, small.url)) as gw:
            status, _, body = await _post(gw.url, {"model": "big", "messages": MESSAGES, "stream": True})
            assert status == 200 and b'"error"' in body and b"[DONE]" not in body  # an in-stream error event
            assert small.bodies == []


async def test_the_chain_is_tried_in_order_each_model_once():
    async def answer(b, request, body):
        return await _status(502, b, request, body)

    async with ScriptedBackend(handler=answer).running() as big, ScriptedBackend(handler=answer).running() as mid, \
            ScriptedBackend().running() as small:
        cfg = gateway_config([{"name": "big-1", "url": big.url, "models": ["big"]},
                              {"name": "mid-1", "url": mid.url, "models": ["mid"]},
                              {"name": "small-1", "url": small.url, "models": ["small"]}],
                             routing={"fallbacks": {"big": [{"model": "mid"}, {"model": "small"}],
                                                    "mid": [{"model": "big"}]}},
                             retries={"max_attempts": 1})
        async with running_gateway(cfg) as gw:
            status, headers, _ = await _post(gw.url, {"model": "big", "messages": MESSAGES})
            assert status == 200 and headers["x-turbo-backend"] == "small-1"
            assert (len(big.attempt_times), len(mid.attempt_times), len(small.attempt_times)) == (1, 1, 1)


def test_a_fallback_must_be_served_and_not_the_model_itself():
    backends = [{"name": "a", "url": "http://127.0.0.1:9", "models": ["big"]}]
    with pytest.raises(ConfigError, match="served by no backend"):
        parse_config({"backends": backends, "routing": {"fallbacks": {"big": [{"model": "nope"}]}}})
    with pytest.raises(ConfigError, match="names itself"):
        parse_config({"backends": backends, "routing": {"fallbacks": {"big": [{"model": "big"}]}}})
    with pytest.raises(ConfigError, match=r"routing.fallbacks"):
        parse_config({"backends": backends, "routing": {"fallbacks": {"big": [{"model": "big", "on": ["slow"]}]}}})


async def test_a_prompt_too_long_for_the_model_goes_to_its_long_context_fallback():
    async def too_long(b, request, body):  # vLLM's answer (serving_engine: _validate_input)
        return web.json_response({"error": {
            "message": "This model's maximum context length is 4096 tokens. However, you requested 9000 tokens "
                       "(8000 in the messages, 1000 in the completion). Please reduce the length of the messages "
                       "or completion.", "type": "BadRequestError", "param": None, "code": 400}}, status=400)

    async with ScriptedBackend(handler=too_long).running() as big, ScriptedBackend().running() as small:
        async with running_gateway(_cfg(big.url, small.url, ["context_length"])) as gw:
            status, headers, body = await _post(gw.url, {"model": "big", "messages": MESSAGES})
            assert status == 200 and headers["x-turbo-backend"] == "small-1"
            assert "fallback_reason=context_length" in headers["x-turbo-route"]
            assert len(big.attempt_times) == 1  # a caller's error: never retried on the same model
        async with running_gateway(_cfg(big.url, small.url, ["unavailable"])) as gw:
            status, _, body = await _post(gw.url, {"model": "big", "messages": MESSAGES})
            err = orjson.loads(body)["error"]
            assert status == 400 and err["code"] == "context_length_exceeded" and err["param"] == "messages"


async def test_a_fallback_with_no_backend_answers_under_its_own_name():
    async with ScriptedBackend().running() as small:
        cfg = gateway_config([{"name": "big-1", "url": f"http://127.0.0.1:{free_port()}", "models": ["big"]},
                              {"name": "small-1", "url": small.url, "models": ["small"]}],
                             routing={"fallbacks": {"big": [{"model": "small"}]}}, retries={"max_attempts": 1})
        async with running_gateway(cfg) as gw:
            gw.state.fleet.backends["small-1"].draining = True  # the fallback has no backend to take it
            status, headers, _ = await _post(gw.url, {"model": "big", "messages": MESSAGES})
            assert status == 503 and "x-turbo-backend" not in headers  # not big-1's: it did not answer this
            assert await _metric(gw.url, "turbo_gateway_requests_total", model="small", backend="none",
                                 status="503") == 1
