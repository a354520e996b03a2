"""The configuration's second step, after validation: what the file only names.

The models' validators (:mod:`gateway.config`) check the document alone and do no I/O;
:func:`resolve` then reads what the document points to: the environment variables that
hold keys (``auth.keys[].key_env``, ``admin.key_env``, ``backends[].api_key_env``) and the
models' tokenizer files (``models.<model>.tokenizer``, ``chat_template``) and, with
``tracing.enabled``, the OpenTelemetry packages, and checks what
needs them (the admin key differs from every client key). :func:`gateway.config.loader.parse_config`
runs both steps, so a config is never used half resolved.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

from gateway.config.base import ConfigError
from gateway.config.errors import describe
from gateway.config.root import GatewayConfig
from gateway.config.tracing import OTEL_EXTRA, sdk_installed
from routing.core import TokenizerError, load_tokenizer


def key_digest(key_env: str, env: Mapping[str, str]) -> bytes:
    """The SHA-256 digest of the key in the variable ``key_env`` of ``env``. Raises
    ``ValueError`` when it is unset or empty, or not printable ASCII without spaces: a
    bearer token's characters (RFC 6750), which every server stack reads from a header
    alike."""
    value = env.get(key_env, "")
    if not value:
        raise ValueError(f"key_env names the environment variable {key_env!r}, which is not set")
    if not (value.isascii() and value.isprintable()) or " " in value:
        raise ValueError(f"the key in {key_env!r} must be printable ASCII without spaces (a bearer token)")
    return hashlib.sha256(value.encode()).digest()


def resolve(cfg: GatewayConfig, path: Path | str = "<config>", env: Mapping[str, str] | None = None) -> GatewayConfig:
    """Resolve the validated ``cfg`` (read from ``path``) against ``env`` (default: the
    process environment) and the files it names: the keys given by variable are hashed
    (once; the values are not kept), every ``api_key_env`` must be set, every model's
    tokenizer must load. Returns ``cfg``. Raises :class:`ConfigError` naming each field
    that does not resolve, as validation names its errors."""
    env = os.environ if env is None else env
    problems: list[tuple[str, str]] = []
    for i, b in enumerate(cfg.backends):
        if b.api_key_env is not None and b.api_key_env not in env:
            unset = f"api_key_env names the environment variable {b.api_key_env!r}, which is not set"
            problems.append((f"backends.{i}", unset))
    for i, k in enumerate(cfg.auth.keys):
        if k.key_env is not None:
            try:
                k._digest = key_digest(k.key_env, env)
            except ValueError as e:
                problems.append((f"auth.keys.{i}", str(e)))
    if cfg.admin.key_env is not None:
        try:
            cfg.admin._digest = key_digest(cfg.admin.key_env, env)
        except ValueError as e:
            problems.append(("admin", str(e)))
    for model, settings in cfg.models.items():
        if settings.tokenizer is not None:
            try:
                load_tokenizer(settings.tokenizer, settings.chat_template, settings.prefix_cache_tokens)
            except TokenizerError as e:
                problems.append((f"models.{model}", str(e)))
    if cfg.tracing.enabled and not sdk_installed():
        problems.append(("tracing", f"tracing.enabled needs the OpenTelemetry SDK and its OTLP exporter: {OTEL_EXTRA}"))
    admin = cfg.admin.digest()
    if not problems and admin is not None and any(k.digest() == admin for k in cfg.auth.keys):
        problems.append(("", "the admin key equals a client key (auth.keys); give the admin its own key"))
    if problems:
        raise ConfigError(describe(path, problems))
    return cfg
