"""How the chat and completions adapters continue a stream (gateway/apis/openai_completions.py):
which requests may be continued, the text an event relayed, the continuation's request,
and a continuation's event rewritten into the client's stream."""

from __future__ import annotations

import pytest

from gateway.apis.registry import CHAT, COMPLETIONS

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("extra", "ok"), [
    ({}, True),
    ({"n": 1, "logprobs": False, "response_format": {"type": "text"}, "tools": [{"type": "function"}]}, True),
    ({"n": 2}, False),
    ({"logprobs": True}, False),
    ({"top_logprobs": 2}, False),
    ({"response_format": {"type": "json_object"}}, False),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, False),
    ({"guided_json": {}}, False),
    ({"tool_choice": "required"}, False),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, False),
    ({"tool_choice": "auto"}, True),
])
def test_which_chat_requests_may_be_continued(extra, ok):
    assert CHAT.continuable({"model": "m", "messages": MESSAGES, **extra}) is ok


def test_which_completions_requests_may_be_continued():
    assert COMPLETIONS.continuable({"prompt": "Once"})
    assert not COMPLETIONS.continuable({"prompt": [1, 2, 3]})  # token ids: the text cannot be appended
    assert not COMPLETIONS.continuable({"prompt": "Once", "echo": True})
    assert not COMPLETIONS.continuable({"prompt": "Once", "suffix": "end"})
    assert not COMPLETIONS.continuable({"prompt": "Once", "logprobs": 0})


def _chunk(delta=None, finish=None, **top):
    return {"id": "x", "created": 1, "model": "m", "choices": [{"index": 0, "delta": delta or {},
                                                                "finish_reason": finish}], **top}


def test_the_text_an_event_relayed_or_none_when_it_is_not_plain_text():
    assert CHAT.relayed_text(_chunk({"role": "assistant", "content": ""})) == ""
    assert CHAT.relayed_text(_chunk({"content": " word"})) == " word"
    assert CHAT.relayed_text({"id": "x", "choices": [], "usage": {}}) == ""
    assert CHAT.relayed_text(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]})) is None
    assert CHAT.relayed_text(_chunk({"reasoning_content": "hmm"})) is None
    assert CHAT.relayed_text(_chunk({"content": "."}, finish="stop")) is None  # the answer had ended
    assert CHAT.relayed_text({"error": {"message": "x"}}) is None
    assert COMPLETIONS.relayed_text({"choices": [{"index": 0, "text": " a", "finish_reason": None}]}) == " a"
    assert COMPLETIONS.relayed_text({"choices": [{"index": 1, "text": " a", "finish_reason": None}]}) is None


def test_the_continuation_asks_for_the_rest_after_the_text_sent():
    data = {"model": "m", "messages": MESSAGES, "max_tokens": 10, "min_tokens": 5, "stop": ["\n"], "stream": True}
    out = CHAT.continuation(data, " one two", 2)
    assert out == {**data, "max_tokens": 8, "min_tokens": 3, "continue_final_message": True,
                   "add_generation_prompt": False,
                   "messages": [*MESSAGES, {"role": "assistant", "content": " one two"}]}
    assert data["messages"] == MESSAGES  # the client's request is left as it was
    assert CHAT.continuation({**data, "max_tokens": None, "max_completion_tokens": 3}, "x", 2)[
        "max_completion_tokens"] == 1
    assert CHAT.continuation(data, "x" * 10, 10) is None  # no token left
    started = {**data, "continue_final_message": True, "add_generation_prompt": False,
               "messages": [*MESSAGES, {"role": "assistant", "content": "Sure:"}]}
    assert CHAT.continuation(started, " one", 1)["messages"][-1] == {"role": "assistant", "content": "Sure: one"}
    assert COMPLETIONS.continuation({"prompt": "Once", "max_tokens": 4}, " upon", 1) == {"prompt": "Once upon",
                                                                                         "max_tokens": 3}


def test_a_continuations_event_is_rewritten_into_the_clients_stream():
    head = {"id": "first", "created": 7, "model": "m"}
    assert CHAT.spliced(_chunk({"role": "assistant", "content": ""}), head, None, 5) is None
    assert CHAT.spliced(_chunk({"role": "assistant", "content": None}), head, None, 5) is None
    event = CHAT.spliced(_chunk({"content": " six"}), head, None, 5)
    assert (event["id"], event["created"], event["model"]) == ("first", 7, "m")
    usage = {"prompt_tokens": 25, "completion_tokens": 3, "total_tokens": 28,
             "prompt_tokens_details": {"cached_tokens": 24}}
    event = CHAT.spliced({"id": "x", "created": 1, "model": "m", "choices": [], "usage": usage}, head, None, 5)
    assert event["usage"] == {"prompt_tokens": 20, "completion_tokens": 8, "total_tokens": 28,
                              "prompt_tokens_details": {"cached_tokens": 20}}
    event = COMPLETIONS.spliced({"id": "x", "choices": [], "usage": dict(usage)}, head, 19, 5)
    assert event["usage"]["prompt_tokens"] == 19 and event["usage"]["total_tokens"] == 27
