"""gateway/apis/openai_completions.py and the defaults of gateway/apis/base.py: what
the chat and completions adapters read from a request, their usage counts and error
answers, and the registry that maps paths to adapters."""

from __future__ import annotations

import orjson
import pytest

from gateway.apis.base import Api, Fields, error_message, reshape
from gateway.apis.openai_completions import ChatCompletions, Completions
from gateway.apis.registry import APIS, BY_NAME, BY_PATH, CHAT, COMPLETIONS
from gateway.errors import ClientError, error_body

USER = [{"role": "user", "content": "hi"}]


def test_the_registry_serves_each_path_once_and_aliases_as_their_api():
    assert len({a.name for a in APIS}) == len(APIS) and len({a.path for a in APIS}) == len(APIS)
    assert BY_NAME["chat"] is CHAT and BY_NAME["completions"] is COMPLETIONS
    for api in APIS:
        assert BY_PATH[api.path] is api and api.operation and api.prompt_kind in ("chat", "completions")
        for alias in api.aliases:
            assert BY_PATH[alias] is api
    assert set(BY_PATH) >= {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                            "/v1/messages/count_tokens", "/v1/embeddings", "/v1/rerank", "/rerank", "/v2/rerank",
                            "/v1/score", "/v1/responses/input_tokens", "/tokenize", "/detokenize"}
    # only the two completion APIs are split into prefill and decode legs
    assert {a.name for a in APIS if a.disaggregates} == {"chat", "completions"}
    assert {a.name for a in APIS if not a.generates} == {
        "count_tokens", "input_tokens", "embeddings", "rerank", "score", "tokenize", "detokenize"}
    # the APIs whose answer the gateway computes from the prompt's tokens (with the model's tokenizer)
    assert {a.name for a in APIS if a.counts_tokens} == {"count_tokens", "input_tokens", "tokenize", "detokenize"}


def test_chat_reads_model_stream_usage_request_and_the_output_cap():
    chat = ChatCompletions()
    assert chat.read({"model": "m", "messages": USER}) == Fields("m", False, False, None)
    assert chat.read({"model": "m", "messages": USER, "stream": True, "stream_options": {"include_usage": True},
                      "max_tokens": 9}) == Fields("m", True, True, 9)
    assert chat.read({"model": "m", "messages": USER, "stream": None, "max_completion_tokens": 5}).max_tokens == 5
    # max_tokens wins over max_completion_tokens when both are set
    assert chat.read({"model": "m", "messages": USER, "max_tokens": 3, "max_completion_tokens": 5}).max_tokens == 3
    body = {"model": "m", "messages": USER, "temperature": 0}
    assert chat.view(body) is body and chat.prompt_kind == "chat"


@pytest.mark.parametrize("body, param, code", [
    ({"messages": USER}, "model", "missing_required_parameter"),
    ({"model": "", "messages": USER}, "model", "invalid_value"),
    ({"model": "m"}, "messages", "missing_required_parameter"),
    ({"model": "m", "messages": []}, "messages", "invalid_value"),
    ({"model": "m", "messages": [{"content": "no role"}]}, "messages[0]", "invalid_value"),
    ({"model": "m", "messages": USER, "stream": "yes"}, "stream", "invalid_type"),
    ({"model": "m", "messages": USER, "stream_options": True}, "stream_options", "invalid_type"),
    ({"model": "m", "messages": USER, "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"model": "m", "messages": USER, "max_tokens": True}, "max_tokens", "invalid_value"),
    ({"model": "m", "messages": USER, "max_completion_tokens": 1.5}, "max_completion_tokens", "invalid_value"),
])
def test_chat_refuses_bad_fields_with_a_400_naming_them(body, param, code):
    with pytest.raises(ClientError) as e:
        ChatCompletions().read(body)
    assert (e.value.status, e.value.param, e.value.code) == (400, param, code)


def test_completions_reads_a_prompt_of_text_or_token_ids():
    comp = Completions()
    for prompt in ("once", ["a", "b"], [1, 2, 3], [[1, 2], [3]]):
        assert comp.read({"model": "m", "prompt": prompt, "max_tokens": 4}) == Fields("m", False, False, 4)
    for prompt in (None, [], 7):
        with pytest.raises(ClientError) as e:
            comp.read({"model": "m", "prompt": prompt})
        assert e.value.param == "prompt"
    assert (comp.prompt_kind, comp.prompt_param) == ("completions", "prompt")


def test_openai_usage_counts_prompt_cached_and_completion_tokens():
    api = Api()
    assert api.counts({"prompt_tokens": 10, "completion_tokens": 4,
                       "prompt_tokens_details": {"cached_tokens": 6}}) == (10, 6, 4)
    assert api.counts({"prompt_tokens": 10, "completion_tokens": 4, "prompt_tokens_details": None}) == (10, None, 4)
    assert api.counts({"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": -1}}) == (10, 0, None)
    assert api.counts({"prompt_tokens": "10"}) == (None, None, None)
    assert api.usage_in({"usage": {"prompt_tokens": 1}}) == {"prompt_tokens": 1}
    assert api.usage_in({"usage": None}) is None and api.usage_in({}) is None


def test_openai_errors_are_relayed_as_they_are_and_end_a_stream_as_a_data_event():
    body = error_body("boom", 502)
    assert reshape(CHAT, 502, body) is body and CHAT.error_body(502, body) is body
    assert CHAT.error_event(502, body) == b"data: " + body + b"\n\n"
    assert error_message(body) == ("boom", None)
    assert error_message(orjson.dumps({"error": {"message": "m", "code": "c"}})) == ("m", "c")
    for not_openai in (b"not json", b"[]", b'{"error": "text"}', b'{"type": "error"}'):
        assert error_message(not_openai) == ("", None)
