"""gateway/apis/tokenize.py and the Responses ``input_tokens`` adapter: which form of a
``/tokenize`` request is which adapter, the fields read and refused, and the answers the
gateway gives from the tiny model's own tokenizer."""

from __future__ import annotations

import orjson
import pytest

from gateway.apis.base import Fields
from gateway.apis.registry import BY_NAME, BY_PATH
from gateway.apis.tokenize import TOKENIZE_CHAT, TOKENIZE_LLAMA_CPP
from gateway.errors import ClientError
from gateway.pipeline.openai_request import parse_body
from routing.tokenizer import load_tokenizer
from tests.support.chat_cases import TINY

TOKENIZE, DETOKENIZE, INPUT_TOKENS = BY_PATH["/tokenize"], BY_PATH["/detokenize"], BY_NAME["input_tokens"]


def test_a_tokenize_request_is_read_by_the_adapter_of_its_form():
    def api(body: dict):
        return parse_body(TOKENIZE, orjson.dumps(body)).api

    assert api({"model": "m", "prompt": "x"}) is TOKENIZE
    assert api({"model": "m", "messages": [{"role": "user", "content": "x"}]}) is TOKENIZE_CHAT
    assert api({"model": "m", "content": "x"}) is TOKENIZE_LLAMA_CPP
    assert TOKENIZE_CHAT.prompt_kind == "chat" and TOKENIZE.prompt_kind == "completions"
    assert not TOKENIZE_LLAMA_CPP.exact_view  # forwarded: its answer is the engine's shape
    assert {TOKENIZE.name, TOKENIZE_CHAT.name, TOKENIZE_LLAMA_CPP.name} == {"tokenize"}
    assert TOKENIZE.read({"model": "m", "prompt": "x"}) == Fields("m", False, True, 0)


@pytest.mark.parametrize("api, body, param", [
    (TOKENIZE, {"prompt": "x"}, "model"), (TOKENIZE, {"model": "m", "prompt": 3}, "prompt"),
    (TOKENIZE, {"model": "m", "prompt": "x", "return_token_strs": "yes"}, "return_token_strs"),
    (TOKENIZE_CHAT, {"model": "m", "messages": []}, "messages"),
    (TOKENIZE_CHAT, {"model": "m", "messages": [{"content": "x"}]}, "messages[0]"),
    (DETOKENIZE, {"model": "m", "tokens": [1, -1]}, "tokens"), (DETOKENIZE, {"model": "m"}, "tokens"),
    (INPUT_TOKENS, {"input": "x"}, "model"), (INPUT_TOKENS, {"model": "m", "input": 4}, "input"),
])
def test_bad_fields_are_a_400_naming_them(api, body, param):
    with pytest.raises(ClientError) as e:
        api.read(body)
    assert e.value.status == 400 and e.value.param == param


def test_answers_from_the_models_tokenizer():
    tok = load_tokenizer(TINY)
    ids = tok.encode("Grüezi mitenand", True)
    got = orjson.loads(TOKENIZE.tokenizer_answer(ids, tok, {"return_token_strs": True}, 4096) or b"")
    assert got == {"count": len(ids), "max_model_len": 4096, "tokens": ids,
                   "token_strs": [tok.tokenizer.id_to_token(i) for i in ids]}
    assert orjson.loads(DETOKENIZE.tokenizer_answer(ids, tok, {}, None) or b"") == {
        "prompt": tok.tokenizer.decode(ids, skip_special_tokens=False)}
    with pytest.raises(ClientError) as e:
        DETOKENIZE.tokenizer_answer([10**8], tok, {}, None)
    assert e.value.param == "tokens"
    assert DETOKENIZE.token_count_answer(5) is None  # an estimate has no text
    # input_tokens: OpenAI's object, from the tokenizer or the estimate alike; no input is no message
    assert orjson.loads(INPUT_TOKENS.tokenizer_answer(ids, tok, {}, None) or b"") == {
        "object": "response.input_tokens", "input_tokens": len(ids)}
    assert INPUT_TOKENS.read({"model": "m"}) == Fields("m", False, True, 0)
    assert INPUT_TOKENS.view({"model": "m", "instructions": "Be brief."}) == {
        "messages": [{"role": "system", "content": "Be brief."}]}
