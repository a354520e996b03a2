"""docs/configuration.md is generated from the models of gateway/config/
(``python -m gateway.config.reference``); these tests keep the two in step and every
field described."""

from __future__ import annotations

import inspect

from pydantic import BaseModel

import gateway.config
from gateway.config import GatewayConfig
from gateway.config import reference as config_reference
from gateway.config.reference import DOC_PATH, REGENERATE, render, rows


def _config_models() -> list[type[BaseModel]]:
    return [c for _, c in inspect.getmembers(gateway.config, inspect.isclass)
            if issubclass(c, BaseModel) and c.__module__ == gateway.config.__name__ and c.model_fields]


def test_configuration_md_is_generated_from_the_models():
    current = DOC_PATH.read_text(encoding="utf-8") if DOC_PATH.exists() else None
    expected = render()
    if current != expected:
        first = next((i for i, (a, b) in enumerate(zip((current or "").splitlines(), expected.splitlines()), 1)
                      if a != b), None)
        where = f" (first difference at line {first})" if first else ""
        raise AssertionError(f"docs/configuration.md does not match gateway/config/{where}; "
                             f"regenerate it with `{REGENERATE}`")


def test_every_field_of_every_config_model_has_a_description():
    missing = [f"{m.__name__}.{name}" for m in _config_models()
               for name, field in m.model_fields.items() if not (field.description or "").strip()]
    assert not missing, f"fields without Field(description=...): {', '.join(missing)}"


def test_the_reference_walks_every_model_and_field():
    keys = [r.key for r in rows(GatewayConfig)]
    assert len(keys) == len(set(keys))
    walked_leaf_names = {k.rsplit(".", 1)[-1] for k in keys}
    for m in _config_models():
        assert set(m.model_fields) <= walked_leaf_names, m.__name__
    assert {"backends[].hints.kv_capacity_tokens", "routing.canaries[].canary_weight", "auth.keys[].priority",
            "pools[].role", "backends[].timeouts.ttft_s", "batch.max_file_bytes"} <= set(keys)
    text = render()
    for r in rows(GatewayConfig):
        if "." in r.key:
            assert f"| `{r.key}` |" in text, r.key


def test_types_and_defaults_come_from_the_validation():
    by_key = {r.key: r for r in rows(GatewayConfig)}
    assert by_key["retries.max_attempts"].type == "integer, 1 to 20"
    assert by_key["retries.max_attempts"].default == "`3`"
    assert by_key["timeouts.connect_s"].type == "number, > 0, or `null`"
    assert by_key["backends[].name"].default == "required"
    assert by_key["pools"].default == "`[{name: mixed, role: mixed}]`"
    assert by_key["pools[].role"].type == "one of `mixed`, `prefill`, `decode`"
    assert by_key["limits.max_body_bytes"].default == "`33554432` (32 MiB)"


def test_check_mode_says_how_to_regenerate(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text("# old\n", encoding="utf-8")
    monkeypatch.setattr(config_reference, "DOC_PATH", stale)
    assert config_reference.main(["--check"]) == 1
    assert REGENERATE in capsys.readouterr().err
    assert config_reference.main(["--write"]) == 0
    assert stale.read_text(encoding="utf-8") == render()
    assert config_reference.main(["--check"]) == 0
