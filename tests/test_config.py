"""backends.yaml validation and the command line's handling of user errors."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parent.parent


def test_shipped_config_is_valid():
    cfg = load_config(ROOT / "backends.yaml")
    assert {b.name for b in cfg.backends} == {"sim-a", "sim-b", "sim-c"}
    assert all(b.simulate is not None for b in cfg.backends)


def test_per_backend_timeout_override():
    cfg = parse_config({"timeouts": {"ttft_s": 10}, "backends": [
        {"name": "a", "url": "http://h:1", "models": ["m"], "timeouts": {"ttft_s": 3, "idle_s": 7}},
        {"name": "b", "url": "http://h:2/", "models": ["m"]}]})
    a, b = cfg.backends
    assert cfg.timeouts_for(a).ttft_s == 3 and cfg.timeouts_for(a).idle_s == 7
    assert cfg.timeouts_for(a).connect_s == cfg.timeouts.connect_s
    assert cfg.timeouts_for(b).ttft_s == 10
    assert b.url == "http://h:2"


@pytest.mark.parametrize("data,fragment", [
    ({"backends": []}, "`backends`"),
    ({"backends": [{"name": "a", "models": ["m"]}]}, "set exactly one of `url`"),
    ({"backends": [{"name": "a", "url": "ftp://x", "models": ["m"]}]}, "`backends.0.url`"),
    ({"backends": [{"name": "a", "url": "http://x", "models": []}]}, "`backends.0.models`"),
    ({"backends": [{"name": "a", "url": "http://x", "models": ["m"], "pool": "gpu"}]}, "pool 'gpu'"),
    ({"backends": [{"name": "a", "url": "http://x", "models": ["m"]}], "routing": {"policy": "magic"}},
     "unknown policy 'magic'"),
    ({"backends": [{"name": "a", "url": "http://x", "models": ["m"]}], "timeouts": {"ttft_s": -1}},
     "`timeouts.ttft_s`"),
    ({"backends": [{"name": "a", "url": "http://x", "models": ["m"], "colour": "red"}]}, "`backends.0.colour`"),
    ({"backends": [{"name": "a", "url": "http://x", "models": ["m"]}, {"name": "a", "url": "http://y", "models": ["m"]}]},
     "duplicate backend names: a"),
    ({"backends": [{"name": "a", "url": "http://x", "models": ["m"], "api_key_env": "TG_SURELY_UNSET_VAR"}]},
     "TG_SURELY_UNSET_VAR"),
    ({"backends": [{"name": "a", "url": "http://x", "models": ["m"]}], "state": {"url": "http://redis"}},
     "`state.url`"),
])
def test_invalid_config_names_file_and_field(data, fragment):
    with pytest.raises(ConfigError) as e:
        parse_config(data, "conf.yaml")
    msg = str(e.value)
    assert msg.startswith("conf.yaml: ")
    assert fragment in msg


def test_yaml_syntax_error_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("backends:\n  - name: a\n   url: x\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: YAML syntax error at line"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"missing.yaml: cannot read config file"):
        load_config(tmp_path / "missing.yaml")


def _run_gateway(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.slow
def test_cli_bad_config_exits_2_without_traceback(tmp_path):
    bad = tmp_path / "backends.yaml"
    bad.write_text("backends:\n  - name: a\n    url: http://127.0.0.1:1\n    models: [m]\n    weight: -3\n")
    r = _run_gateway("--config", str(bad))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert f"{bad}: invalid config at `backends.0.weight`" in r.stderr


@pytest.mark.slow
def test_cli_port_in_use_says_so(tmp_path):
    conf = tmp_path / "backends.yaml"
    conf.write_text("backends:\n  - name: a\n    url: http://127.0.0.1:1\n    models: [m]\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _run_gateway("--config", str(conf), "--port", str(port))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert f"cannot listen on 127.0.0.1:{port}: the address is already in use" in r.stderr
