"""One ``Server`` header for every answer: the completions the data plane serves itself
(gateway/server/fast_path.py) and everything aiohttp serves (other routes, handed-over connections,
``listen.fast_path: false``) alike."""

from __future__ import annotations

import aiohttp

from tests.support.servers import AIOHTTP_MARK, ScriptedBackend, gateway_config, running_gateway

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


async def _answers(url: str) -> dict[str, tuple[int, str | None, bool]]:
    """``{label: (status, Server header, served by aiohttp)}`` for one request per kind of route."""
    out = {}
    # a connection per request: one handed over to aiohttp stays with it
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        for label, method, path, body in [
            ("completion", "POST", "/v1/chat/completions", CHAT),
            ("stream", "POST", "/v1/chat/completions", {**CHAT, "stream": True}),
            ("completion, query string", "POST", "/v1/chat/completions?x=1", CHAT),  # handed over
            ("unknown model", "POST", "/v1/chat/completions", {**CHAT, "model": "nope"}),
            ("models", "GET", "/v1/models", None),
            ("health", "GET", "/health", None),
            ("ready", "GET", "/ready", None),
            ("metrics", "GET", "/metrics", None),
            ("unknown route", "GET", "/v1/nope", None),
        ]:
            async with s.request(method, url + path, json=body) as r:
                await r.read()
                out[label] = (r.status, r.headers.get("Server"), AIOHTTP_MARK in r.headers)
    return out


async def test_data_plane_and_aiohttp_answers_name_the_same_server():
    async with ScriptedBackend().running() as be:
        cfg = gateway_config([{"name": "b", "url": be.url, "models": ["m"]}])
        async with running_gateway(cfg, mark_aiohttp=True) as gw:
            got = await _answers(gw.url)
    assert {k: v[0] for k, v in got.items()} == {
        "completion": 200, "stream": 200, "completion, query string": 200, "unknown model": 404, "models": 200,
        "health": 200, "ready": 200, "metrics": 200, "unknown route": 404}
    # both stacks answered: the data plane its plain completions, aiohttp the rest
    assert {k for k, v in got.items() if not v[2]} == {"completion", "stream", "unknown model"}
    assert {v[1] for v in got.values()} == {"turbo-gateway"}


async def test_aiohttp_only_answers_name_the_gateway():
    async with ScriptedBackend().running() as be:
        cfg = gateway_config([{"name": "b", "url": be.url, "models": ["m"]}], listen={"fast_path": False})
        async with running_gateway(cfg, mark_aiohttp=True) as gw:
            got = await _answers(gw.url)
    assert all(v[2] for v in got.values())  # aiohttp served everything
    assert {v[1] for v in got.values()} == {"turbo-gateway"}
