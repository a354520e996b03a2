"""gateway/apis/anthropic_messages.py: what the Messages and count_tokens adapters read
from a request, the chat conversation they route the prompt as, their usage (the prompt
is Anthropic's input tokens plus the cached ones) and Anthropic's error shape."""

from __future__ import annotations

import orjson
import pytest

from gateway.apis.anthropic_messages import anthropic_error, error_type
from gateway.apis.base import Fields, reshape
from gateway.apis.registry import BY_NAME
from gateway.errors import ClientError, error_body

API, COUNT = BY_NAME["messages"], BY_NAME["count_tokens"]
USER = [{"role": "user", "content": "hi"}]


def test_read_requires_max_tokens_and_user_or_assistant_messages():
    assert API.read({"model": "m", "messages": USER, "max_tokens": 8}) == Fields("m", False, True, 8)
    assert API.read({"model": "m", "messages": USER, "max_tokens": 8, "stream": True, "system": "s"}).stream
    assert API.read({"model": "m", "messages": USER, "max_tokens": 8, "system": [{"type": "text", "text": "s"}]})


@pytest.mark.parametrize("body, param, code", [
    ({"model": "m", "messages": USER}, "max_tokens", "missing_required_parameter"),
    ({"model": "m", "messages": USER, "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"model": "m", "max_tokens": 4}, "messages", "missing_required_parameter"),
    ({"model": "m", "messages": [], "max_tokens": 4}, "messages", "invalid_value"),
    ({"model": "m", "messages": [{"role": "system", "content": "s"}], "max_tokens": 4}, "messages[0]",
     "invalid_value"),
    ({"model": "m", "messages": USER, "max_tokens": 4, "system": 5}, "system", "invalid_type"),
    ({"messages": USER, "max_tokens": 4}, "model", "missing_required_parameter"),
])
def test_read_refuses_bad_fields_with_a_400_naming_them(body, param, code):
    with pytest.raises(ClientError) as e:
        API.read(body)
    assert (e.value.status, e.value.param, e.value.code) == (400, param, code)


def test_count_tokens_needs_no_max_tokens_never_streams_and_generates_nothing():
    assert COUNT.read({"model": "m", "messages": USER}) == Fields("m", False, True, 0)
    assert COUNT.read({"model": "m", "messages": USER, "stream": True, "max_tokens": 0}) == Fields("m", False, True, 0)
    assert not COUNT.generates and COUNT.end_events == frozenset() and COUNT.path == "/v1/messages/count_tokens"
    with pytest.raises(ClientError) as e:
        COUNT.read({"model": "m", "messages": [{"role": "tool"}]})
    assert e.value.param == "messages[0]"
    body = {"system": "s", "messages": USER}
    assert COUNT.view(body) == API.view(body)  # counted as the same prompt Messages routes


def test_view_is_the_chat_conversation_the_engine_renders():
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    view = API.view({"system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}], "tools": tools,
                     "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, image]},
                                  {"role": "assistant", "content": "b"}]})
    assert view == {"tools": tools, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, image]},
        {"role": "assistant", "content": "b"}]}
    assert API.view({"system": "", "messages": USER}) == {"messages": USER}


def test_usage_from_the_answer_message_start_and_message_delta():
    start = {"type": "message_start", "message": {"id": "x", "usage": {"input_tokens": 1,
                                                                      "cache_read_input_tokens": 12,
                                                                      "output_tokens": 0}}}
    delta = {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 3}}
    assert API.usage_in(start) == {"input_tokens": 1, "cache_read_input_tokens": 12, "output_tokens": 0}
    assert API.usage_in(delta) == {"output_tokens": 3}
    assert API.usage_in({"type": "message", "usage": {"input_tokens": 4, "output_tokens": 2}})["input_tokens"] == 4
    assert API.usage_in({"type": "content_block_delta", "delta": {"text": "usage"}}) is None
    assert API.usage_in({"type": "message_start", "message": {"usage": None}}) is None


def test_the_prompt_is_input_tokens_plus_the_tokens_read_from_and_written_to_the_cache():
    assert API.counts({"input_tokens": 1, "cache_read_input_tokens": 12, "output_tokens": 3}) == (13, 12, 3)
    assert API.counts({"input_tokens": 4, "cache_creation_input_tokens": 6, "cache_read_input_tokens": 0,
                       "output_tokens": 0}) == (10, None, 0)
    assert API.counts({"input_tokens": 4, "cache_read_input_tokens": None}) == (4, None, None)
    assert API.counts({"output_tokens": 3}) == (None, None, 3)  # a message_delta alone
    assert COUNT.counts({"input_tokens": 21}) == (21, None, None)


@pytest.mark.parametrize("status, kind", [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (413, "request_too_large"), (429, "rate_limit_error"), (500, "api_error"),
    (502, "api_error"), (503, "overloaded_error"), (529, "overloaded_error"), (422, "invalid_request_error"),
])
def test_openai_errors_become_anthropics_shape_with_its_error_type(status, kind):
    out = orjson.loads(reshape(API, status, error_body("the reason", status, param="x", code="c")))
    assert out == {"type": "error", "error": {"type": kind, "message": "the reason"}}
    assert error_type(status) == kind


def test_bodies_that_are_not_openai_errors():
    engine_own = orjson.dumps({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}})
    assert API.error_body(529, engine_own) == engine_own  # already Anthropic's: as it is
    assert orjson.loads(API.error_body(502, b"upstream text")) == {
        "type": "error", "error": {"type": "api_error", "message": "upstream text"}}
    assert orjson.loads(API.error_body(502, b""))["error"]["message"] == "HTTP 502"
    assert len(orjson.loads(API.error_body(502, b"x" * 5000))["error"]["message"]) == 1000
    assert API.error_event(503, error_body("full", 503)) == \
        b"event: error\ndata: " + anthropic_error(503, "full") + b"\n\n"
    assert COUNT.error_body(404, error_body("no model", 404)) == anthropic_error(404, "no model")
