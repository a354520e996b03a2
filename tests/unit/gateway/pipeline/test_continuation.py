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


def test_the_token_continuation_is_a_completions_request_with_the_sampling_parameters():
    data = {"model": "m", "messages": MESSAGES, "max_completion_tokens": 10, "min_tokens": 5, "stop": ["\n"],
            "temperature": 0.7, "seed": 3, "stream": True, "stream_options": {"include_usage": True},
            "prompt_cache_key": "s", "parallel_tool_calls": False}
    assert CHAT.token_continuation(data, [1, 2, 3], 2, 4000) == {
        "model": "m", "prompt": [1, 2, 3], "max_tokens": 8, "min_tokens": 3, "stop": ["\n"], "temperature": 0.7,
        "seed": 3, "stream": True, "stream_options": {"include_usage": True}}
    assert CHAT.token_continuation({**data, "max_completion_tokens": None}, [1], 2, 4000)["max_tokens"] == 4000
    assert CHAT.token_continuation({**data, "max_completion_tokens": None}, [1], 2, None) is None  # no cap known
    assert CHAT.token_continuation(data, [1], 10, 4000) is None  # no token left
    # what the engine renders or parses beyond the gateway's tokenization: left to the text continuation
    assert CHAT.token_continuation({**data, "tools": [{"type": "function"}]}, [1], 2, 4000) is None
    assert CHAT.token_continuation({**data, "chat_template_kwargs": {"x": 1}}, [1], 2, 4000) is None
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:"}}]}]
    assert CHAT.token_continuation({**data, "messages": image}, [1], 2, 4000) is None
    text_parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert CHAT.token_continuation({**data, "messages": text_parts}, [1], 2, 4000) is not None
    assert COMPLETIONS.token_continuation({"model": "m", "prompt": "Once", "max_tokens": 4, "echo": False},
                                          [5, 6], 1, None) == {"model": "m", "prompt": [5, 6], "max_tokens": 3,
                                                               "stream": True}


def test_a_token_continuations_completions_chunk_becomes_a_chat_chunk():
    head = {"id": "chatcmpl-1", "created": 7, "model": "m"}
    leg = CHAT.token_leg
    assert leg is not None and leg.path == "/v1/completions"
    chunk = {"id": "cmpl-2", "object": "text_completion", "created": 9, "model": "m",
             "choices": [{"index": 0, "text": " six", "finish_reason": None, "stop_reason": None,
                          "token_ids": [42]}]}
    assert leg.relayed_text(chunk) == " six"
    assert leg.spliced(chunk, head, 20, 5) == {
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
        "choices": [{"index": 0, "delta": {"content": " six"}, "logprobs": None, "finish_reason": None,
                     "stop_reason": None, "token_ids": [42]}]}
    usage = {"prompt_tokens": 25, "completion_tokens": 3, "total_tokens": 28}
    last = leg.spliced({"id": "cmpl-2", "object": "text_completion", "created": 9, "model": "m", "choices": [],
                        "usage": usage}, head, 20, 5)
    assert last["object"] == "chat.completion.chunk" and last["choices"] == []
    assert last["usage"] == {"prompt_tokens": 20, "completion_tokens": 8, "total_tokens": 28}
    assert COMPLETIONS.token_leg is not None and COMPLETIONS.token_leg.path == "/v1/completions"


def test_which_responses_streams_may_be_continued_and_the_text_their_events_relayed():
    from gateway.apis.registry import BY_NAME

    responses = BY_NAME["responses"]
    assert responses.continuable({"input": "hi"}) and not responses.continues_text
    assert responses.continuable({"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]})
    assert not responses.continuable({"input": "hi", "tools": [{"type": "function", "name": "f"}]})
    assert not responses.continuable({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]})
    assert not responses.continuable({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}})
    assert not responses.continuable({"input": "hi", "top_logprobs": 2})
    assert responses.relayed_text({"type": "response.created", "response": {}}) == ""
    assert responses.relayed_text({"type": "response.output_item.added", "output_index": 0,
                                   "item": {"type": "message"}}) == ""
    assert responses.relayed_text({"type": "response.output_item.added", "output_index": 0,
                                   "item": {"type": "reasoning"}}) is None
    assert responses.relayed_text({"type": "response.output_text.delta", "output_index": 0, "content_index": 0,
                                   "delta": " a"}) == " a"
    assert responses.relayed_text({"type": "response.output_text.done", "output_index": 0}) is None
    body = responses.token_continuation({"model": "m", "input": "hi", "max_output_tokens": 9, "temperature": 0,
                                         "store": True}, [1, 2], 4, None)
    assert body == {"model": "m", "prompt": [1, 2], "max_tokens": 5, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}


def test_a_token_continuations_completions_chunks_become_responses_events_numbered_on():
    from gateway.apis.registry import BY_NAME

    responses = BY_NAME["responses"]
    head: dict = {}
    for e in ({"type": "response.created", "sequence_number": 0, "response": {"id": "resp_1", "status": "in_progress"}},
              {"type": "response.output_item.added", "sequence_number": 1, "output_index": 0,
               "item": {"type": "message", "id": "msg_1"}},
              {"type": "response.output_text.delta", "sequence_number": 2, "output_index": 0, "content_index": 0,
               "delta": " one"}):
        responses.follow(e, head)
    leg = responses.token_leg
    assert leg is not None and leg.path == "/v1/completions" and not leg.relays_done
    out = leg.spliced({"choices": [{"index": 0, "text": " two", "finish_reason": None}]}, head, 10, 1)
    assert out == [{"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0,
                    "content_index": 0, "delta": " two", "logprobs": [], "sequence_number": 3}]
    out = leg.spliced({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}, head, 10, 1)
    assert [e["type"] for e in out] == ["response.output_text.done", "response.content_part.done",
                                        "response.output_item.done"]
    assert out[0]["text"] == " one two" and [e["sequence_number"] for e in out] == [4, 5, 6]
    usage = {"prompt_tokens": 11, "completion_tokens": 1, "total_tokens": 12}
    (done,) = leg.spliced({"choices": [], "usage": usage}, head, 10, 1)
    assert done["type"] == "response.completed" and done["sequence_number"] == 7
    response = done["response"]
    assert (response["id"], response["status"], response["incomplete_details"]) == ("resp_1", "completed", None)
    assert response["output"][0]["content"][0]["text"] == " one two"
    assert response["usage"]["input_tokens"] == 10 and response["usage"]["output_tokens"] == 2


def test_a_messages_token_continuation_and_its_chunks_as_messages_events():
    from gateway.apis.registry import BY_NAME

    messages = BY_NAME["messages"]
    data = {"model": "m", "max_tokens": 10, "messages": MESSAGES, "stop_sequences": ["END"], "temperature": 0,
            "metadata": {"user_id": "u"}}
    assert messages.token_continuation(data, [1, 2], 3, None) == {
        "model": "m", "prompt": [1, 2], "max_tokens": 7, "temperature": 0, "stop": ["END"], "stream": True,
        "stream_options": {"include_usage": True}}
    prefill = [*MESSAGES, {"role": "assistant", "content": "Sure:"}]
    assert messages.token_continuation({**data, "messages": prefill}, [1], 1, None) is None  # the text path
    assert messages.token_continuation({**data, "tools": [{"name": "f"}]}, [1], 1, None) is None
    leg = messages.token_leg
    assert leg is not None and leg.path == "/v1/completions" and not leg.relays_done
    head: dict = {}
    assert leg.spliced({"choices": [{"index": 0, "text": " a", "finish_reason": None}]}, head, 5, 2) == [
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": " a"}}]
    assert leg.spliced({"choices": [{"index": 0, "text": "", "finish_reason": "stop", "stop_reason": "END"}]},
                       head, 5, 2) == [{"type": "content_block_stop", "index": 0}]
    assert leg.spliced({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}}, head, 5, 2) == [
        {"type": "message_delta", "delta": {"stop_reason": "stop_sequence", "stop_sequence": "END"},
         "usage": {"output_tokens": 4}}, {"type": "message_stop"}]
