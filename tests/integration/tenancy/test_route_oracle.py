"""No cross-tenant cache oracle (issue 27, point 7): ``x-turbo-route``'s cache details
only to callers allowed to see them, and ``auth.cache_isolation: per_key`` keeping each
key's prompts apart in the gateway's prefix placement and in the engine's cache
(``cache_salt``). Real sockets: a gateway and a scripted backend on loopback ports."""

from __future__ import annotations

import hashlib
from typing import Any

import aiohttp
import orjson
import pytest

from tests.support.servers import ScriptedBackend, gateway_config, running_gateway

KEYS = {"alice": "sk-oracle-alice-0123456789", "bob": "sk-oracle-bob-0123456789", "ops": "sk-oracle-ops-0123456789"}
PROMPT = "You are the support assistant of a company whose handbook follows. " * 60  # a long shared prefix
CACHE_DETAILS = ("reason=", "matched_tokens=", "evidence=", "ttft_est_ms=")


def sha(k: str) -> str:
    return hashlib.sha256(k.encode()).hexdigest()


def config(backend_url: str, **auth: Any):
    keys = [{"name": n, "key_sha256": sha(k), **({"route_details": True} if n == "ops" else {})}
            for n, k in KEYS.items()]
    return gateway_config([{"name": "b1", "url": backend_url, "models": ["m"]},
                           {"name": "b2", "url": backend_url, "models": ["m"]}],
                          routing={"policy": "estimated_ttft"}, auth={"keys": keys, **auth})


async def ask(http: aiohttp.ClientSession, url: str, key: str | None, *, stream: bool = False,
              salt: str | None = None) -> str:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": PROMPT + "Hi?"}],
                            "max_tokens": 1, "stream": stream}
    if salt is not None:
        body["cache_salt"] = salt
    headers = {"Authorization": f"Bearer {KEYS[key]}"} if key else {}
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        await r.read()
        return r.headers["x-turbo-route"]


def matched(route: str) -> int:
    return int(next(p for p in route.split("; ") if p.startswith("matched_tokens=")).split("=")[1])


@pytest.mark.parametrize("stream", [False, True])
async def test_route_cache_details_only_to_keys_granted_them(stream):
    async with ScriptedBackend().running() as be:
        async with running_gateway(config(be.url)) as gw, aiohttp.ClientSession() as http:
            for _ in range(2):  # the second request finds the first one's prefix
                alice = await ask(http, gw.url, "alice", stream=stream)
            ops = await ask(http, gw.url, "ops", stream=stream)
    assert alice.startswith("policy=estimated_ttft; backend=b")
    assert not any(d in alice for d in CACHE_DETAILS), alice  # nothing tells alice what is cached
    assert all(d in ops for d in CACHE_DETAILS[:3]) and matched(ops) > 0, ops  # ops' key is granted them


async def test_route_cache_details_to_everyone_when_configured_or_without_keys():
    async with ScriptedBackend().running() as be:
        async with running_gateway(config(be.url, route_details="everyone")) as gw, aiohttp.ClientSession() as http:
            assert "matched_tokens=" in await ask(http, gw.url, "alice")
        cfg = gateway_config([{"name": "b1", "url": be.url, "models": ["m"]}], routing={"policy": "estimated_ttft"})
        async with running_gateway(cfg) as gw, aiohttp.ClientSession() as http:
            assert "matched_tokens=" in await ask(http, gw.url, None)  # one tenant: nothing to hide from itself


async def test_per_key_cache_isolation_keeps_placement_and_engine_cache_apart():
    async with ScriptedBackend().running() as be:
        for isolation, bob_shares in (("shared", True), ("per_key", False)):
            be.bodies.clear()
            cfg = config(be.url, route_details="everyone", cache_isolation=isolation)
            async with running_gateway(cfg) as gw, aiohttp.ClientSession() as http:
                await ask(http, gw.url, "alice")
                assert matched(await ask(http, gw.url, "alice")) > 0  # a key finds its own prefix
                assert (matched(await ask(http, gw.url, "bob")) > 0) is bob_shares, isolation
                await ask(http, gw.url, "bob", salt="team-a")
            salts = [orjson.loads(b).get("cache_salt") for b in be.bodies]
            if isolation == "shared":
                assert salts == [None, None, None, "team-a"]  # the body as the caller sent it
            else:
                a, a2, b, b_team = salts
                assert a == a2 and a != b and len(a) == 32  # one salt per key, sent to the engine
                assert b_team == f"{b}:team-a"  # the caller's own salt splits its key's cache further
