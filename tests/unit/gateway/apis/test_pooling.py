"""gateway/apis/pooling.py: embeddings, rerank and score read no stream and no output
cap (prefill only), route their inputs as one text prompt, and count usage with
``total_tokens`` standing in for a missing ``prompt_tokens``."""

from __future__ import annotations

import pytest

from gateway.apis.base import Fields
from gateway.apis.registry import BY_NAME, BY_PATH
from gateway.errors import ClientError

EMBED, RERANK, SCORE = BY_NAME["embeddings"], BY_NAME["rerank"], BY_NAME["score"]
PREFILL_ONLY = Fields("m", False, True, 0)


def test_embeddings_read_and_view():
    for inp in ("text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]):
        assert EMBED.read({"model": "m", "input": inp, "stream": False}) == PREFILL_ONLY
        assert EMBED.view({"model": "m", "input": inp}) == {"prompt": inp}
    assert EMBED.prompt_kind == "completions" and not EMBED.generates and EMBED.end_events == frozenset()


@pytest.mark.parametrize("api, body, param", [
    (EMBED, {"model": "m"}, "input"), (EMBED, {"model": "m", "input": []}, "input"),
    (EMBED, {"model": "m", "input": "x", "stream": True}, "stream"), (EMBED, {"input": "x"}, "model"),
    (RERANK, {"model": "m", "documents": ["d"]}, "query"), (RERANK, {"model": "m", "query": "q"}, "documents"),
    (RERANK, {"model": "m", "query": "q", "documents": []}, "documents"),
    (RERANK, {"model": "m", "query": "q", "documents": ["d"], "stream": True}, "stream"),
    (SCORE, {"model": "m", "text_2": "b"}, "text_1"), (SCORE, {"model": "m", "text_1": "a", "text_2": []}, "text_2"),
    (SCORE, {"model": "m", "text_1": "a", "text_2": "b", "stream": True}, "stream"),
])
def test_bad_fields_get_a_400_naming_them(api, body, param):
    with pytest.raises(ClientError) as e:
        api.read(body)
    assert e.value.status == 400 and e.value.param == param


def test_rerank_is_served_on_its_aliases_and_routes_query_then_documents():
    assert BY_PATH["/rerank"] is BY_PATH["/v2/rerank"] is BY_PATH["/v1/rerank"] is RERANK
    body = {"model": "m", "query": "q", "documents": ["one", {"text": "two"}, [5, 6], {"image": "x"}], "top_n": 1}
    assert RERANK.read(body) == PREFILL_ONLY
    assert RERANK.view(body) == {"prompt": "q\none\ntwo\n5 6\n"}
    assert SCORE.path == "/v1/score" and SCORE.aliases == ()
    # the engine tokenizes the query with each document: the view is no exact prompt
    assert not RERANK.exact_view and not SCORE.exact_view and EMBED.exact_view


def test_score_routes_both_sides_as_one_prompt():
    assert SCORE.read({"model": "m", "text_1": "a", "text_2": ["b", "c"]}) == PREFILL_ONLY
    assert SCORE.view({"text_1": "a", "text_2": ["b", "c"]}) == {"prompt": "a\nb\nc"}
    assert SCORE.view({"text_1": ["a"], "text_2": "b"}) == {"prompt": "a\nb"}


def test_usage_is_prompt_tokens_or_total_tokens_and_never_output():
    assert EMBED.counts({"prompt_tokens": 5, "total_tokens": 5}) == (5, None, None)
    assert RERANK.counts({"prompt_tokens": 14, "total_tokens": 14}) == (14, None, 0)
    assert RERANK.counts({"total_tokens": 9}) == (9, None, 0)  # a usage of total_tokens only
    assert SCORE.counts({"prompt_tokens": 3, "completion_tokens": 7}) == (3, None, 0)
    assert RERANK.counts({}) == (None, None, 0)
