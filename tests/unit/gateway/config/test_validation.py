"""backends.yaml validation, without sockets (the command line's handling of user errors:
``tests/integration/server/test_cli.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parents[4]


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
    ({"backends": [{"name": "a", "url": "http://x", "models": ["m"]},
                   {"name": "a", "url": "http://y", "models": ["m"]}]},
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


# ---- models: the models' own tokenizers ------------------------------------------------

TINY_TOKENIZER = ROOT / "tests" / "support" / "data" / "tiny-tokenizer"


def _with_models(models: dict) -> dict:
    return {"backends": [{"name": "a", "url": "http://x", "models": ["m"]}], "models": models}


def test_model_tokenizer_paths_are_relative_to_the_config_file(tmp_path):
    (tmp_path / "tok").symlink_to(TINY_TOKENIZER)
    (tmp_path / "t.jinja").write_text("{{ messages[0].content }}")
    path = tmp_path / "backends.yaml"
    path.write_text("backends: [{name: a, url: 'http://x', models: [m]}]\n"
                    "models: {m: {tokenizer: tok, chat_template: t.jinja, prefix_cache_tokens: 0}}\n")
    cfg = load_config(path)
    assert cfg.models["m"].tokenizer == str(tmp_path / "tok")
    assert cfg.models["m"].chat_template == str(tmp_path / "t.jinja")
    assert parse_config(_with_models({})).models == {}


@pytest.mark.parametrize("models,fragment", [
    ({"m": {"tokenizer": "/nonexistent/tok"}}, "`models.m`: /nonexistent/tok: no such file or directory"),
    ({"m": {"chat_template": "t.jinja"}}, "`chat_template` needs `tokenizer`"),
    ({"other": {"tokenizer": str(TINY_TOKENIZER)}}, "model 'other' is served by no backend"),
    ({"m": {"tokenizer": str(TINY_TOKENIZER), "prefix_cache_tokens": -1}}, "`models.m.prefix_cache_tokens`"),
])
def test_bad_model_settings_are_config_errors(models, fragment):
    with pytest.raises(ConfigError) as e:
        parse_config(_with_models(models))
    assert fragment in str(e.value)


def test_bad_tokenizer_files_are_config_errors(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{oops")
    with pytest.raises(ConfigError, match=r"tokenizer.json: invalid JSON"):
        parse_config(_with_models({"m": {"tokenizer": str(tmp_path)}}))
    (tmp_path / "tokenizer.json").write_text((TINY_TOKENIZER / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{% if %}"}')
    with pytest.raises(ConfigError, match="chat template syntax error"):
        parse_config(_with_models({"m": {"tokenizer": str(tmp_path)}}))


def _kv(**kv_events):
    return {"backends": [{"name": "a", "url": "http://x", "models": ["m"], "kv_events": kv_events}]}


@pytest.mark.parametrize("data,fragment", [
    (_kv(), "`backends.0.kv_events.endpoint`"),
    (_kv(endpoint="tcp://*:5557"), "give the engine's host"),
    (_kv(endpoint="http://10.0.0.11:5557"), "must be a ZMQ address"),
    (_kv(endpoint="tcp://10.0.0.11"), "needs a port"),
    (_kv(endpoint="tcp://bad host:5557"), "needs a host without spaces"),
    (_kv(endpoint="tcp://:5557"), "needs a host without spaces"),
    (_kv(endpoint="ipc://"), "needs a path"),
    (_kv(endpoint="tcp://h:5557", replay_endpoint="tcp://h:99999"), "needs a port"),
    (_kv(endpoint="tcp://h:5557", block_size=0), "`backends.0.kv_events.block_size`"),
    (_kv(endpoint="ipc:///tmp/kv", data_parallel_size=2), "data_parallel_size > 1 needs tcp://"),
    (_kv(endpoint="tcp://h:65535", data_parallel_size=2), "passes 65535"),
    ({**_kv(endpoint="tcp://h:5557"), "routing": {"speculative_s": -1}}, "`routing.speculative_s`"),
])
def test_invalid_kv_events_config_is_a_clear_error(data, fragment):
    with pytest.raises(ConfigError) as e:
        parse_config(data, "conf.yaml")
    assert fragment in str(e.value)


def test_kv_events_config_defaults_and_base_model():
    from gateway.runtime import backend_specs

    cfg = parse_config({"backends": [
        {"name": "a", "url": "http://x", "models": ["llama", "alias"], "kv_events": {"endpoint": "tcp://h:5557"}},
        {"name": "b", "url": "http://y", "models": ["llama"],
         "kv_events": {"endpoint": "tcp://h:5557", "block_size": 32, "base_model": "base"}},
        {"name": "c", "url": "http://z", "models": ["llama"]}]})
    kv = cfg.backends[0].kv_events
    assert (kv.topic, kv.block_size, kv.replay_endpoint, kv.data_parallel_size) == ("", 16, None, 1)
    specs = {s.name: s for s in backend_specs(cfg)}
    assert (specs["a"].kv_block_size, specs["a"].kv_base_model) == (16, "llama")
    assert (specs["b"].kv_block_size, specs["b"].kv_base_model) == (32, "base")
    assert (specs["c"].kv_block_size, specs["c"].kv_base_model) == (None, "")


def test_simulated_backends_wire_their_kv_events_and_tokenizer():
    """A ``simulate:`` section with ``kv_events`` is wired by the gateway (unless the
    backend has its own ``kv_events``), in the block size its simulator says; its ``tokenizer``
    is its models' unless ``models`` names one; two simulated tokenizers for one model
    are a config error that says what to do."""
    from gateway.config import KVEvents

    sim = {"tokenizer": str(TINY_TOKENIZER), "kv_events": {"topic": "t"}}
    cfg = parse_config({"backends": [
        {"name": "a", "models": ["m"], "simulate": {**sim, "profile_overrides": {"block_size": 32}}},
        {"name": "b", "models": ["m"], "simulate": {"kv_events": {}}},  # the demo profile's 16-token blocks
        {"name": "c", "models": ["m"], "simulate": {"kv_events": {"endpoint": "tcp://127.0.0.1:5557"}},
         "kv_events": {"endpoint": "tcp://127.0.0.1:5557"}},
        {"name": "d", "models": ["n"], "simulate": {"tokenizer": str(TINY_TOKENIZER)}}]})
    assert [b.simulated_kv_events for b in cfg.backends] == [True, True, False, False]
    assert cfg.models["m"].tokenizer == cfg.models["n"].tokenizer == str(TINY_TOKENIZER)
    # what each simulated backend's GET /kv_event_sources says: addresses, its profile's block size
    src = {n: KVEvents(endpoint=f"tcp://127.0.0.1:{p}", topic="t") for n, p in (("a", 1), ("b", 2))}
    wired = cfg.with_kv_events({n: cfg.backends[i].simulated_kv_source(s.endpoint, None, s.topic, 32 // (i + 1), "m")
                                for i, (n, s) in enumerate(src.items())})
    assert [(b.kv_events.endpoint, b.kv_events.block_size) if b.kv_events else None for b in wired.backends] == \
        [("tcp://127.0.0.1:1", 32), ("tcp://127.0.0.1:2", 16), ("tcp://127.0.0.1:5557", 16), None]
    own = parse_config({"backends": [{"name": "a", "models": ["m"], "simulate": sim}],
                        "models": {"m": {"tokenizer": str(TINY_TOKENIZER / "tokenizer.json")}}})
    assert own.models["m"].tokenizer == str(TINY_TOKENIZER / "tokenizer.json")
    with pytest.raises(ConfigError, match=r"simulated backends 'a' and 'b' serve model 'm' with different "
                                          "tokenizers; name the model's own in `models.m.tokenizer`"):
        parse_config({"backends": [{"name": "a", "models": ["m"], "simulate": sim},
                                   {"name": "b", "models": ["m"],
                                    "simulate": {"tokenizer": str(TINY_TOKENIZER / "tokenizer.json")}}]})
