"""gateway/pipeline/session.py: what names a request's session, in order, always
scoped by the caller's key."""

from __future__ import annotations

from multidict import CIMultiDict

from gateway.apis.registry import BY_NAME
from gateway.config import Sessions
from gateway.pipeline.session import scoped, session_of, started

CHAT, MESSAGES, EMBEDDINGS = BY_NAME["chat"], BY_NAME["messages"], BY_NAME["embeddings"]
ON = Sessions()


def test_the_api_field_then_the_header_then_the_body_field_name_it():
    cfg = Sessions(body_field="metadata.session_id")
    data = {"prompt_cache_key": "pck", "metadata": {"session_id": "meta"}}
    headers = CIMultiDict({"X-Session-Id": "hdr"})
    assert session_of(cfg, CHAT, data, headers, "k") == scoped("k", "pck")
    assert session_of(cfg, CHAT, {"metadata": {"session_id": "meta"}}, headers, "k") == scoped("k", "hdr")
    assert session_of(cfg, CHAT, {"metadata": {"session_id": "meta"}}, {}, "k") == scoped("k", "meta")
    assert session_of(cfg, CHAT, {"metadata": "not an object"}, {}, "k") is None
    assert session_of(cfg, CHAT, {"prompt_cache_key": 7}, {}, "k") is None  # not a string: names nothing


def test_one_value_is_two_sessions_under_two_keys():
    a = session_of(ON, CHAT, {"prompt_cache_key": "shared"}, {}, "tenant-a")
    b = session_of(ON, CHAT, {"prompt_cache_key": "shared"}, {}, "tenant-b")
    assert a and b and a != b
    # a key name cannot be made to collide with another by moving text between name and value
    assert scoped("ab", "c") != scoped("a", "bc")
    assert started("k") != started("k")


def test_the_user_names_a_session_only_where_the_operator_opts_in():
    assert session_of(ON, CHAT, {"user": "u1"}, {}, "k") is None
    opted = Sessions(key_user=True)
    assert session_of(opted, CHAT, {"user": "u1"}, {}, "k") == scoped("k", "user:u1")
    assert session_of(opted, MESSAGES, {"metadata": {"user_id": "u1"}}, {}, "k") == scoped("k", "user:u1")
    assert session_of(opted, CHAT, {"user": "u1", "prompt_cache_key": "p"}, {}, "k") == scoped("k", "p")


def test_an_api_without_a_session_field_uses_the_header_and_nothing_when_off():
    assert session_of(ON, EMBEDDINGS, {"prompt_cache_key": "p"}, {"x-session-id": "h"}, "k") == scoped("k", "h")
    assert session_of(Sessions(header=None), MESSAGES, {}, {"x-session-id": "h"}, "k") is None
    assert session_of(Sessions(enabled=False), CHAT, {"prompt_cache_key": "p"}, {}, "k") is None


def test_the_route_header_names_the_session_and_placement_only_with_details():
    from gateway.pipeline.headers import route_header
    from routing.core import BackendSpec, BackendState, Decision

    d = Decision(BackendState(BackendSpec("x", frozenset({"m"}))), "estimated_ttft", "prefix_hit",
                 {"matched_tokens": 640.0}, session=scoped("k", "s"), placement="home")
    assert route_header(d).endswith(f"; session={scoped('k', 's')[:8]}; placement=home")
    assert "session=" not in route_header(d, details=False)
    assert "session=" not in route_header(Decision(d.backend, "estimated_ttft", "tie"))
