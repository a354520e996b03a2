"""The prefill leg of a disaggregated request (README "Routing" / "Pools"): with a
``prefill`` and a ``decode`` pool, a long prompt first runs ``max_tokens`` 1 on a prefill
backend, then the decode leg carries its ``kv_transfer_params``; a failed prefill leg
falls back to a decode (or mixed) backend that recomputes the prompt.

A failed prefill attempt (5xx, connect error, timeout) is a failed upstream attempt
like any other: it counts towards the prefill backend's circuit breaker, so a broken
prefill backend is ejected instead of costing every long request a failed round trip.

Only the gateway's public surfaces are read (HTTP answers, ``/metrics``,
``/admin/backends``), plus what real backends on 127.0.0.1 received."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from tests.support.servers import ScriptedBackend, free_port, gateway_config, running_gateway

ADMIN_KEY = "admin-secret-for-prefill-tests"
ADMIN = {"key_sha256": hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_KEY}"}
FAILURE_THRESHOLD = 2
LONG = "lorem ipsum dolor sit amet " * 200  # ~1,300 estimated tokens, well above long_prompt_tokens 256
BUG = ("a failed prefill attempt released its reservation without reporting the outcome "
       "(reservation.outcome(False, now)): the prefill backend's circuit breaker never opened")


def _long(i: int) -> str:
    """A long prompt that no backend holds a prefix of (a repeated prompt would be cached
    on the backend that served it, no longer "long", and skip the prefill leg)."""
    return f"request {i}: " + LONG


def _cfg(pf_url: str, dc_url: str, pf_extra: dict | None = None, **extra):
    return gateway_config(
        [{"name": "pf", "url": pf_url, "models": ["m"], "pool": "prefill", **(pf_extra or {})},
         {"name": "dc", "url": dc_url, "models": ["m"], "pool": "decode"}],
        pools=[{"name": "prefill", "role": "prefill"}, {"name": "decode", "role": "decode"}],
        routing={"long_prompt_tokens": 256, "scrape_interval_s": 0},
        health={"unhealthy_threshold": 100},  # only the breaker may take the prefill backend out
        breaker={"failure_threshold": FAILURE_THRESHOLD, "open_s": 600},
        admin=ADMIN, **extra)


def _answer(status: int) -> Callable[..., Awaitable[web.StreamResponse]]:
    async def answer(b, request, body):
        return web.json_response({"error": {"message": f"prefill says {status}", "type": "server_error"}},
                                 status=status)

    return answer


async def _hang(b, request, body):
    await asyncio.sleep(60)  # cancelled when the gateway gives up and closes the connection
    raise AssertionError("unreachable")


async def _chat(url: str, content: str, stream: bool = False) -> tuple[int, dict, bytes]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions",
                          json={"model": "m", "max_tokens": 4, "stream": stream,
                                "messages": [{"role": "user", "content": content}]}) as r:
            return r.status, r.headers.copy(), await r.read()


async def _served_by_decode(url: str, i: int, stream: bool = False) -> None:
    status, headers, body = await _chat(url, _long(i), stream)
    assert status == 200, f"request {i}: HTTP {status}: {body[:300]!r}"
    assert headers.get("x-turbo-backend") == "dc", f"request {i} answered by {headers.get('x-turbo-backend')}"


async def _backends(url: str) -> dict[str, dict[str, Any]]:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/admin/backends", headers=ADMIN_HEADERS) as r:
            assert r.status == 200, await r.text()
            return {b["name"]: b for b in (await r.json())["data"]}


async def _samples(url: str, family: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of metric ``family`` (its name without ``_total``) on ``/metrics``."""
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics") as r:
            assert r.status == 200
            text = await r.text()
    return [(dict(smp.labels), smp.value) for fam in text_string_to_metric_families(text) if fam.name == family
            for smp in fam.samples if smp.name in (family, family + "_total")]


async def _metric(url: str, family: str, **labels: str) -> float:
    return sum(v for lab, v in await _samples(url, family) if all(lab.get(k) == x for k, x in labels.items()))


async def _eventually(check: Callable[[], Awaitable[tuple[bool, str]]], timeout_s: float = 2.0) -> None:
    """Poll ``check`` (-> (ok, description)) until ok; fail with its last description."""
    deadline = time.monotonic() + timeout_s
    while True:
        ok, what = await check()
        if ok:
            return
        if time.monotonic() > deadline:
            raise AssertionError(what)
        await asyncio.sleep(0.02)


async def _assert_breaker_opens(url: str, name: str, attempts: Callable[[], int]) -> None:
    async def opened() -> tuple[bool, str]:
        b = (await _backends(url))[name]
        return b["breaker"] == "open", (
            f"prefill backend {name}: breaker {b['breaker']!r} (opened {b['breaker_opened_total']} times) after "
            f"{attempts()} failed prefill attempts with breaker.failure_threshold {FAILURE_THRESHOLD}")

    await _eventually(opened)
    assert await _metric(url, "turbo_gateway_backend_breaker_open", backend=name) == 1
    assert await _metric(url, "turbo_gateway_backend_breaker_opened", backend=name) >= 1


def _decode_bodies(dc: ScriptedBackend) -> list[dict[str, Any]]:
    return [orjson.loads(raw) for raw in dc.bodies]


# ---- a failing prefill backend is ejected by its circuit breaker ------------------------


@pytest.mark.fixed_bug(reason=BUG)
async def test_prefill_backend_answering_503_opens_its_breaker():
    async with ScriptedBackend(handler=_answer(503)).running() as pf, ScriptedBackend().running() as dc:
        async with running_gateway(_cfg(pf.url, dc.url)) as gw:
            for i in range(3):
                await _served_by_decode(gw.url, i, stream=i == 1)
            assert len(pf.attempt_times) >= FAILURE_THRESHOLD, "the prefill backend was not tried"
            await _assert_breaker_opens(gw.url, "pf", lambda: len(pf.attempt_times))
            seen = len(pf.attempt_times)
            for i in range(3, 6):  # the open breaker keeps long prompts off the prefill backend
                await _served_by_decode(gw.url, i, stream=i == 4)
            assert len(pf.attempt_times) == seen, (
                f"the prefill backend still got {len(pf.attempt_times) - seen} requests with its breaker open")
            # every answer came from the decode backend recomputing the prompt: no KV to pull
            assert len(dc.bodies) == 6
            assert all("kv_transfer_params" not in b for b in _decode_bodies(dc))
            assert await _metric(gw.url, "turbo_gateway_disaggregated", outcome="fallback") == 6
            assert await _metric(gw.url, "turbo_gateway_disaggregated", outcome="ok") == 0


@pytest.mark.fixed_bug(reason=BUG)
async def test_prefill_backend_refusing_connections_opens_its_breaker():
    async with ScriptedBackend().running() as dc:
        # a refused connection also cools the backend down for failed_backend_cooldown_s,
        # as on any leg; 0 here, so that every request tries it until the breaker opens
        cfg = _cfg(f"http://127.0.0.1:{free_port()}", dc.url, retries={"failed_backend_cooldown_s": 0})
        async with running_gateway(cfg) as gw:
            async def pf_errors() -> float:  # the failed attempts the gateway counted on pf
                return await _metric(gw.url, "turbo_gateway_upstream_errors", backend="pf")

            for i in range(3):
                await _served_by_decode(gw.url, i, stream=i == 1)
            failed = await pf_errors()
            assert failed >= FAILURE_THRESHOLD
            await _assert_breaker_opens(gw.url, "pf", lambda: int(failed))
            failed = await pf_errors()
            for i in range(3, 6):
                await _served_by_decode(gw.url, i, stream=i == 4)
            assert await pf_errors() == failed, "the gateway still tried the prefill backend with its breaker open"
            assert await _metric(gw.url, "turbo_gateway_disaggregated", outcome="fallback") == 6


@pytest.mark.fixed_bug(reason=BUG)
async def test_prefill_backend_timing_out_opens_its_breaker():
    async with ScriptedBackend(handler=_hang).running() as pf, ScriptedBackend().running() as dc:
        async with running_gateway(_cfg(pf.url, dc.url, {"timeouts": {"ttft_s": 0.2}})) as gw:
            for i in range(2):
                await _served_by_decode(gw.url, i)
            assert len(pf.attempt_times) >= FAILURE_THRESHOLD
            await _assert_breaker_opens(gw.url, "pf", lambda: len(pf.attempt_times))
            seen = len(pf.attempt_times)
            await _served_by_decode(gw.url, 2)
            assert len(pf.attempt_times) == seen
            assert await _metric(gw.url, "turbo_gateway_disaggregated", outcome="fallback") == 3


async def test_prefill_backend_answering_4xx_keeps_its_breaker_closed():
    """A 4xx is the request's fault, not the backend's: it does not count towards the
    breaker (as for the decode leg and single-backend requests)."""
    async with ScriptedBackend(handler=_answer(400)).running() as pf, ScriptedBackend().running() as dc:
        async with running_gateway(_cfg(pf.url, dc.url)) as gw:
            for i in range(3):
                status, _, body = await _chat(gw.url, _long(i))
                assert status < 500, body
            b = (await _backends(gw.url))["pf"]
            assert (b["breaker"], b["breaker_opened_total"]) == ("closed", 0), (
                f"{len(pf.attempt_times)} prefill attempts answered 400 opened the prefill backend's breaker")
            assert len(pf.attempt_times) > FAILURE_THRESHOLD


# ---- metrics of a failed prefill leg --------------------------------------------------------


@pytest.mark.parametrize("failure", ["status_503", "connect"])
async def test_failed_prefill_leg_counts_upstream_error_and_fallback(failure):
    async with ScriptedBackend(handler=_answer(503)).running() as broken, ScriptedBackend().running() as dc:
        pf_url = broken.url if failure == "status_503" else f"http://127.0.0.1:{free_port()}"
        async with running_gateway(_cfg(pf_url, dc.url)) as gw:
            await _served_by_decode(gw.url, 0)
            errors = {lab["reason"]: v for lab, v in await _samples(gw.url, "turbo_gateway_upstream_errors")
                      if lab.get("backend") == "pf"}
            assert errors.get(failure, 0) >= 1, f"upstream errors of pf by reason: {errors}"
            assert all(reason for reason in errors), errors
            assert await _metric(gw.url, "turbo_gateway_upstream_errors", backend="dc") == 0
            assert await _metric(gw.url, "turbo_gateway_disaggregated", outcome="fallback") == 1
            assert await _metric(gw.url, "turbo_gateway_disaggregated", outcome="ok") == 0
            # the fallback recomputed the prompt: the client's request, no KV transfer
            (sent,) = _decode_bodies(dc)
            assert "kv_transfer_params" not in sent and sent["max_tokens"] == 4


# ---- a healthy prefill backend ------------------------------------------------------------


async def test_healthy_prefill_leg_hands_kv_transfer_params_to_the_decode_leg():
    async def prefill(b, request, body):
        n = len(b.bodies)
        return web.json_response({
            "id": f"cmpl-p{n}", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 1300, "completion_tokens": 1, "total_tokens": 1301},
            "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                   "remote_engine_id": f"engine-{n}", "remote_block_ids": [n, n + 1],
                                   "remote_host": "127.0.0.1", "remote_port": 5600 + n}})

    async with ScriptedBackend(handler=prefill).running() as pf, ScriptedBackend().running() as dc:
        async with running_gateway(_cfg(pf.url, dc.url)) as gw:
            for i, stream in enumerate((False, True, False)):
                await _served_by_decode(gw.url, i, stream)
            assert len(pf.bodies) == len(dc.bodies) == 3
            for n, (p_raw, d) in enumerate(zip(pf.bodies, _decode_bodies(dc))):
                p = orjson.loads(p_raw)
                # the prefill leg: one token, not streamed, asking for a remote decode
                assert p["max_tokens"] == 1 and p["stream"] is False and "stream_options" not in p
                assert p["kv_transfer_params"]["do_remote_decode"] is True
                # the decode leg: the client's request plus the KV the prefill backend holds
                assert d["max_tokens"] == 4 and d["stream"] is (n == 1)
                assert d["kv_transfer_params"] == {
                    "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": f"engine-{n + 1}",
                    "remote_block_ids": [n + 1, n + 2], "remote_host": "127.0.0.1", "remote_port": 5601 + n}
            assert await _metric(gw.url, "turbo_gateway_disaggregated", outcome="ok") == 3
            assert await _metric(gw.url, "turbo_gateway_disaggregated", outcome="fallback") == 0
            assert await _metric(gw.url, "turbo_gateway_upstream_errors", backend="pf") == 0
            b = (await _backends(gw.url))["pf"]
            assert (b["breaker"], b["breaker_opened_total"]) == ("closed", 0)
            assert await _metric(gw.url, "turbo_gateway_backend_breaker_open", backend="pf") == 0
