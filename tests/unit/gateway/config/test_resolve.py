"""Validation does no I/O; :func:`gateway.config.resolve.resolve` reads the environment
and the files the config names, and names each field that does not resolve."""

from __future__ import annotations

import hashlib

import pytest

from gateway.config import ConfigError, GatewayConfig
from gateway.config.resolve import resolve

DOC = {"backends": [{"name": "b", "url": "http://127.0.0.1:9", "models": ["m"], "api_key_env": "TG_RESOLVE_UP"}],
       "auth": {"keys": [{"name": "k", "key_env": "TG_RESOLVE_KEY"}]},
       "admin": {"key_env": "TG_RESOLVE_ADMIN"},
       "models": {"m": {"tokenizer": "/nonexistent/tokenizer-dir"}}}


def test_validation_alone_reads_no_environment_and_no_file():
    cfg = GatewayConfig.model_validate(DOC)  # every variable unset, the tokenizer absent: still valid
    assert cfg.auth.keys[0].digest() == b"" and cfg.admin.digest() is None


def test_resolve_hashes_the_keys_from_the_given_environment():
    cfg = GatewayConfig.model_validate({**DOC, "models": {}})
    env = {"TG_RESOLVE_UP": "up-key", "TG_RESOLVE_KEY": "sk-client", "TG_RESOLVE_ADMIN": "sk-admin"}
    assert resolve(cfg, "c.yaml", env) is cfg
    assert cfg.auth.keys[0].digest() == hashlib.sha256(b"sk-client").digest()
    assert cfg.admin.digest() == hashlib.sha256(b"sk-admin").digest()


def test_resolve_names_every_field_that_does_not_resolve():
    cfg = GatewayConfig.model_validate(DOC)
    with pytest.raises(ConfigError) as e:
        resolve(cfg, "c.yaml", {"TG_RESOLVE_KEY": "not ascii \u00e9"})
    msg = str(e.value)
    assert "`backends.0`: api_key_env names the environment variable 'TG_RESOLVE_UP', which is not set" in msg
    assert "`auth.keys.0`: the key in 'TG_RESOLVE_KEY' must be printable ASCII" in msg
    assert "`admin`: key_env names the environment variable 'TG_RESOLVE_ADMIN', which is not set" in msg
    assert "`models.m`: " in msg and "/nonexistent/tokenizer-dir" in msg


def test_an_admin_key_equal_to_a_client_key_is_refused_once_both_are_known():
    cfg = GatewayConfig.model_validate({**DOC, "models": {}})
    with pytest.raises(ConfigError, match="the admin key equals a client key"):
        resolve(cfg, "c.yaml", {"TG_RESOLVE_UP": "x", "TG_RESOLVE_KEY": "sk-same", "TG_RESOLVE_ADMIN": "sk-same"})
