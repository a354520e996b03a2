"""Reading ``backends.yaml``: :func:`load_config` and :func:`parse_config`."""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from pydantic import (
    ValidationError,
)

from gateway.config.base import ConfigError
from gateway.config.errors import describe, explain
from gateway.config.resolve import resolve
from gateway.config.root import GatewayConfig


def _format_validation_error(path: Path, err: ValidationError) -> str:
    return describe(path, explain(err, GatewayConfig))


def parse_config(data: object, path: Path | str = "<config>") -> GatewayConfig:
    """Validate an already-parsed YAML document (no I/O), then resolve what it names
    (:func:`gateway.config.resolve.resolve`: environment variables, tokenizer files);
    relative file paths in it are relative to ``path``'s directory. Raises
    :class:`ConfigError`."""
    path = Path(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a YAML mapping at the top level")
    try:
        cfg = GatewayConfig.model_validate(data, context={"config_dir": str(path.parent)})
    except ValidationError as e:
        raise ConfigError(_format_validation_error(path, e)) from None
    return resolve(cfg, path)


def load_config(path: str | os.PathLike[str]) -> GatewayConfig:
    """Read and validate ``path``. Raises :class:`ConfigError` for a missing or
    unreadable file, YAML syntax errors and invalid fields."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config file: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{p}: YAML syntax error{where}: {getattr(e, 'problem', None) or e}") from None
    return parse_config(data, p)
