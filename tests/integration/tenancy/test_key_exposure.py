"""What the gateway lets out about client keys and how it reads them (issue 27, point 9):
``/metrics`` labels keys by a hash unless told otherwise, a ``key_env`` key is hashed
once at load, every server stack reads a non-ASCII key the same way, and an admin key
equal to a client key is refused at load. Real sockets for the metrics page."""

from __future__ import annotations

import hashlib

import aiohttp
import pytest
from multidict import CIMultiDict

from gateway.config import ConfigError
from gateway.errors import ClientError
from gateway.ops.metrics import key_label
from gateway.tenancy.keys import KeyRing
from tests.support.servers import ScriptedBackend, gateway_config, running_gateway

KEY = "sk-exposure-alpha-0123456789"


def sha(k: str) -> str:
    return hashlib.sha256(k.encode()).hexdigest()


@pytest.mark.parametrize("mode", [None, "name", "none"])
async def test_metrics_label_keys_by_a_hash_unless_configured(mode):
    async with ScriptedBackend().running() as be:
        auth = {"keys": [{"name": "tenant-alpha", "key_sha256": sha(KEY), "requests_per_minute": 1}]}
        if mode is not None:
            auth["metrics_key_labels"] = mode
        cfg = gateway_config([{"name": "b", "url": be.url, "models": ["m"]}], auth=auth)
        async with running_gateway(cfg) as gw, aiohttp.ClientSession() as http:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            for status in (200, 429):  # one served (key_tokens), one refused (rate_limited)
                async with http.post(gw.url + "/v1/chat/completions", json=body,
                                     headers={"Authorization": f"Bearer {KEY}"}) as r:
                    assert r.status == status
            async with http.get(gw.url + "/metrics") as r:
                page = await r.text()
    label = {None: key_label("hashed", "tenant-alpha"), "name": "tenant-alpha", "none": "-"}[mode]
    assert f'turbo_gateway_key_tokens_total{{key_name="{label}"' in page
    assert f'turbo_gateway_rate_limited_total{{key_name="{label}",limit="requests"}} 1.0' in page
    if mode != "name":
        assert "tenant-alpha" not in page  # the default names nobody
    assert len(key_label("hashed", "tenant-alpha")) == 12


def test_a_key_env_key_is_hashed_once_at_load(monkeypatch):
    monkeypatch.setenv("TG_TEST_CLIENT_KEY", KEY)
    cfg = gateway_config([{"name": "b", "url": "http://127.0.0.1:9", "models": ["m"]}],
                         auth={"keys": [{"name": "alpha", "key_env": "TG_TEST_CLIENT_KEY"}]})
    ring = KeyRing(cfg.auth)
    monkeypatch.delenv("TG_TEST_CLIENT_KEY")  # read at load, never again
    assert ring.authenticate(CIMultiDict({"Authorization": f"Bearer {KEY}"})).name == "alpha"
    assert cfg.auth.keys[0].digest() == hashlib.sha256(KEY.encode()).digest()


def test_every_stack_reads_a_non_ascii_key_alike():
    raw = "sk-clé-ünïcode".encode()
    cfg = gateway_config([{"name": "b", "url": "http://127.0.0.1:9", "models": ["m"]}],
                         auth={"keys": [{"name": "alpha", "key_sha256": hashlib.sha256(raw).hexdigest()}]})
    ring = KeyRing(cfg.auth)
    # the header's bytes as each stack hands them over: aiohttp (UTF-8, surrogate escapes),
    # the lean protocol (latin-1), the endpoint picker (UTF-8, replacement characters)
    views = [raw.decode("utf-8", "surrogateescape"), raw.decode("latin-1"), raw.decode("utf-8", "replace")]
    outcomes = set()
    for v in views:
        try:
            outcomes.add(ring.authenticate(CIMultiDict({"Authorization": f"Bearer {v}"})).name)
        except ClientError as e:
            outcomes.add(e.status)
    assert outcomes == {401}  # one answer whatever the stack: a bearer token is ASCII (RFC 6750)


def test_a_non_ascii_key_env_value_is_refused_at_load(monkeypatch):
    monkeypatch.setenv("TG_TEST_CLIENT_KEY", "sk-clé")
    with pytest.raises(ConfigError, match="ASCII"):
        gateway_config([{"name": "b", "url": "http://127.0.0.1:9", "models": ["m"]}],
                       auth={"keys": [{"name": "alpha", "key_env": "TG_TEST_CLIENT_KEY"}]})


def test_an_admin_key_equal_to_a_client_key_is_refused_at_load(monkeypatch):
    with pytest.raises(ConfigError, match="admin key"):
        gateway_config([{"name": "b", "url": "http://127.0.0.1:9", "models": ["m"]}],
                       auth={"keys": [{"name": "alpha", "key_sha256": sha(KEY)}]}, admin={"key_sha256": sha(KEY)})
    monkeypatch.setenv("TG_TEST_ADMIN_KEY", KEY)
    with pytest.raises(ConfigError, match="admin key"):
        gateway_config([{"name": "b", "url": "http://127.0.0.1:9", "models": ["m"]}],
                       auth={"keys": [{"name": "alpha", "key_sha256": sha(KEY)}]},
                       admin={"key_env": "TG_TEST_ADMIN_KEY"})
