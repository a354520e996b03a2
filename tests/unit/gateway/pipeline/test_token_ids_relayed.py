"""What a failed leg relayed, read from its kept bytes at the failure
(gateway/pipeline/migration.py ``_relayed``): the text, and the token ids when the
engine streamed them (vLLM's ``return_token_ids`` chunk shapes)."""

from __future__ import annotations

import orjson

from gateway.apis.registry import CHAT, COMPLETIONS
from gateway.pipeline.migration import _relayed


def _sse(*events: dict) -> list[bytes]:
    return [b"data: " + orjson.dumps(e) + b"\n\n" for e in events]


def _chat(content: str | None, **choice) -> dict:
    delta = {"content": content} if content is not None else {}
    return {"id": "c", "created": 1, "model": "m", "choices": [{"index": 0, "delta": delta, "finish_reason": None,
                                                                 **choice}]}


def test_a_chat_legs_text_and_the_engines_token_ids():
    role = {"id": "c", "created": 1, "model": "m", "prompt_token_ids": [1, 2, 3],
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    kept = _sse(role, _chat(" one", token_ids=[10]), _chat(None, token_ids=[11]), _chat(" two", token_ids=[12]))
    text, tokens, head, usage, ids, prompt_ids = _relayed(CHAT, kept)
    assert (text, tokens, head, usage) == (" one two", 2, {"id": "c", "created": 1, "model": "m"}, None)
    assert ids == [10, 11, 12] and prompt_ids == [1, 2, 3]  # an event with ids and no text (held back) counts


def test_no_ids_when_an_event_with_text_came_without_them():
    _, _, _, _, ids, prompt_ids = _relayed(CHAT, _sse(_chat(" one", token_ids=[10]), _chat(" two")))
    assert ids is None and prompt_ids is None
    _, _, _, _, ids, _ = _relayed(CHAT, _sse(_chat(" one", token_ids=None)))  # vLLM's null when not asked
    assert ids is None


def test_a_completions_legs_prompt_ids_are_in_its_first_choice_and_a_half_line_is_left_out():
    first = {"id": "p", "choices": [{"index": 0, "text": " a", "finish_reason": None, "prompt_token_ids": [7, 8],
                                     "token_ids": [20]}]}
    kept = [*_sse(first), b'data: {"id": "p", "choices": [{"index": 0, "te']
    text, tokens, _, _, ids, prompt_ids = _relayed(COMPLETIONS, kept)
    assert (text, tokens, ids, prompt_ids) == (" a", 1, [20], [7, 8])
    assert _relayed(COMPLETIONS, [*_sse(first), b"data: [DONE]\n\n"]) is None  # it had ended
