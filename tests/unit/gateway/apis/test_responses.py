"""gateway/apis/responses.py: what the Responses adapter reads from a request, the chat
conversation it routes the prompt as, and where the usage is in an answer or a stream
event (shapes as llama.cpp and vLLM answer)."""

from __future__ import annotations

import orjson
import pytest

from gateway.apis.base import Fields, reshape
from gateway.apis.registry import BY_NAME
from gateway.errors import ClientError, error_body

API = BY_NAME["responses"]
USAGE = {"input_tokens": 13, "output_tokens": 3, "total_tokens": 16, "input_tokens_details": {"cached_tokens": 12},
         "output_tokens_details": {"reasoning_tokens": 0}}


def test_read_takes_model_stream_and_max_output_tokens():
    assert API.read({"model": "m", "input": "hi"}) == Fields("m", False, True, None)
    assert API.read({"model": "m", "input": [], "stream": True, "max_output_tokens": 16}) == Fields("m", True, True, 16)
    # max_tokens is not the Responses API's field: not the cap
    assert API.read({"model": "m", "input": "hi", "max_tokens": 5}).max_tokens is None


@pytest.mark.parametrize("body, param", [
    ({"input": "hi"}, "model"), ({"model": "m"}, "input"), ({"model": "m", "input": 7}, "input"),
    ({"model": "m", "input": {"role": "user"}}, "input"), ({"model": "m", "input": "x", "stream": 1}, "stream"),
    ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
])
def test_read_refuses_bad_fields_with_a_400_naming_them(body, param):
    with pytest.raises(ClientError) as e:
        API.read(body)
    assert e.value.status == 400 and e.value.param == param


def test_view_is_the_chat_conversation_the_engine_renders():
    assert API.view({"model": "m", "instructions": "Be brief.", "input": "Hello."}) == {"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello."}]}
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c1", "output": "42"}
    tools = [{"type": "function", "name": "f", "parameters": {}}]
    view = API.view({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_image", "image_url": "u"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
        call, output, "not an item"], "tools": tools})
    assert view["tools"] == tools
    assert view["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_image", "image_url": "u"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "b"}]},
        {"role": "function_call", "content": orjson.dumps(call, option=orjson.OPT_SORT_KEYS).decode()},
        {"role": "function_call_output", "content": orjson.dumps(output, option=orjson.OPT_SORT_KEYS).decode()}]
    # the same items in another key order render alike: one prefix for one conversation
    assert API.view({"input": [dict(reversed(call.items()))]}) == API.view({"input": [call]})
    assert "tools" not in API.view({"input": "x", "tools": []})


def test_usage_is_read_from_the_answer_and_from_the_completed_event():
    assert API.usage_in({"object": "response", "usage": USAGE}) == USAGE
    assert API.usage_in({"type": "response.completed", "response": {"status": "completed", "usage": USAGE}}) == USAGE
    for no_usage in ({"type": "response.created", "response": {"status": "in_progress"}},
                     {"type": "response.created", "response": {"usage": None}}, {"usage": None},
                     {"type": "response.output_text.delta", "delta": "usage"}):
        assert API.usage_in(no_usage) is None
    assert API.counts(USAGE) == (13, 12, 3)
    assert API.counts({"input_tokens": 13, "output_tokens": 3}) == (13, None, 3)
    assert API.counts({"input_tokens": 5, "input_tokens_details": {"cached_tokens": -2}}) == (5, 0, None)
    # chat's names are not the Responses API's
    assert API.counts({"prompt_tokens": 13, "completion_tokens": 3}) == (None, None, None)


def test_errors_keep_openais_shape():
    body = error_body("`input` is required", 400, param="input")
    assert reshape(API, 400, body) is body
    assert API.error_event(500, body) == b"data: " + body + b"\n\n"
    assert API.end_events == {b"response.completed", b"response.incomplete", b"response.failed"}
    assert API.delta_event == b"response.output_text.delta" and API.generates and not API.disaggregates
