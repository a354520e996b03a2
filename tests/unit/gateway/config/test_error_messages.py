"""A bad config is explained whole: every error, unknown keys first, in plain words, an
unknown key with the closest known key of its section (gateway/config_errors.py)."""

import pytest

from gateway.config import ConfigError, parse_config

BACKEND = {"name": "a", "url": "http://127.0.0.1:1", "models": ["m"]}


def _message(doc: dict) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(doc, "conf/backends.yaml")
    return str(e.value)


def test_a_misspelt_top_level_key_is_named_first_with_the_key_it_meant():
    lines = _message({"backend": [BACKEND]}).splitlines()
    assert lines[0] == "conf/backends.yaml: 2 errors in the config:"
    assert lines[1] == "  - at `backend`: unknown key `backend`, did you mean `backends`?"
    assert lines[2] == "  - at `backends`: required, but missing"


def test_every_error_is_shown_in_plain_words_unknown_keys_first():
    msg = _message({"routing": {"policy": "round_robin", "polcy": "x"},
                    "auth": {"keys": [{"name": "k", "key_env": "K", "requests_per_minut": 3}]},
                    "backends": [{**BACKEND, "weight": -3, "timeouts": {"connect_s": "soon"}}]})
    lines = msg.splitlines()
    assert lines[0] == "conf/backends.yaml: 4 errors in the config:"
    assert set(lines[1:3]) == {
        "  - at `routing.polcy`: unknown key `polcy`, did you mean `policy`?",
        ("  - at `auth.keys.0.requests_per_minut`: unknown key `requests_per_minut`, "
         "did you mean `requests_per_minute`?")}
    assert set(lines[3:]) == {"  - at `backends.0.weight`: must be greater than 0",
                              "  - at `backends.0.timeouts.connect_s`: must be a number"}
    assert "Extra inputs" not in msg and "Field required" not in msg and "Input should" not in msg


def test_an_unknown_key_with_no_close_match_lists_the_keys_of_its_section():
    msg = _message({"backends": [BACKEND], "limits": {"zzz": 1}})
    assert msg.startswith("conf/backends.yaml: invalid config at `limits.zzz`: unknown key `zzz`; "
                          "the keys here are `max_body_bytes`, "), msg
    assert "\n" not in msg  # one error, one line

