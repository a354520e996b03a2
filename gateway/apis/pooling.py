"""The pooling APIs, answered in one pass over the prompt (prefill only, no output
tokens: :attr:`Api.generates` is off, so the decision core prices them with no decode
term): embeddings (``POST /v1/embeddings``, OpenAI's and vLLM's shape), rerank
(``POST /v1/rerank``, also ``/rerank`` and ``/v2/rerank``: vLLM's and Jina's shape) and
score (``POST /v1/score``, vLLM's). None of them streams."""

from __future__ import annotations

from typing import Any

from gateway.apis.base import Api, Fields, missing, read_model
from gateway.errors import ClientError


def _text(v: Any) -> str:
    """One input's text: a string as it is, token ids joined by spaces, a document
    object (``{"text": ...}``) by its text."""
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("text"), str):
        return v["text"]
    if isinstance(v, list):
        return " ".join(str(t) for t in v)
    return ""


def _no_stream(data: dict[str, Any]) -> None:
    if data.get("stream"):
        raise ClientError(400, "This API does not stream; remove `stream`.", param="stream", code="invalid_value")


class Embeddings(Api):
    """``POST /v1/embeddings``: ``input`` a string, an array of strings, token ids, or
    an array of token-id arrays."""

    name, path, operation = "embeddings", "/v1/embeddings", "embeddings"
    prompt_kind, prompt_param = "completions", "input"
    generates = False

    def read(self, data: dict[str, Any]) -> Fields:
        model = read_model(data)
        _no_stream(data)
        inp = data.get("input")
        if not (isinstance(inp, str) or (isinstance(inp, list) and inp)):
            raise missing("input", data, "a string or a non-empty array")
        return Fields(model, False, True, 0)

    def view(self, data: dict[str, Any]) -> dict[str, Any]:
        return {"prompt": data.get("input")}


class Rerank(Api):
    """``POST /v1/rerank`` (and ``/rerank``, ``/v2/rerank``): ``query`` and
    ``documents`` (strings or ``{"text": ...}`` objects), ``top_n``."""

    name, path, operation = "rerank", "/v1/rerank", "rerank"
    aliases: tuple[str, ...] = ("/rerank", "/v2/rerank")
    prompt_kind, prompt_param = "completions", "documents"
    generates = False
    exact_view = False  # the engine tokenizes the query with each document, not this one text

    def read(self, data: dict[str, Any]) -> Fields:
        model = read_model(data)
        _no_stream(data)
        if not isinstance(data.get("query"), str):
            raise missing("query", data, "a string")
        docs = data.get("documents")
        if not isinstance(docs, list) or not docs:
            raise missing("documents", data, "a non-empty array")
        return Fields(model, False, True, 0)

    def view(self, data: dict[str, Any]) -> dict[str, Any]:
        return {"prompt": "\n".join([_text(data.get("query")), *(_text(d) for d in data.get("documents") or ())])}

    def counts(self, usage: dict[str, Any]) -> tuple[int | None, int | None, int | None]:
        prompt, cached, _ = super().counts(usage)
        total = usage.get("total_tokens")
        return (prompt if prompt is not None else total if isinstance(total, int) else None), cached, 0


class Score(Rerank):
    """``POST /v1/score``: ``text_1`` against ``text_2`` (each a string or an array of
    strings)."""

    name, path, aliases, operation = "score", "/v1/score", (), "score"
    prompt_param = "text_2"

    def read(self, data: dict[str, Any]) -> Fields:
        model = read_model(data)
        _no_stream(data)
        for field in ("text_1", "text_2"):
            v = data.get(field)
            if not (isinstance(v, str) or (isinstance(v, list) and v)):
                raise missing(field, data, "a string or a non-empty array")
        return Fields(model, False, True, 0)

    def view(self, data: dict[str, Any]) -> dict[str, Any]:
        parts: list[Any] = []
        for field in ("text_1", "text_2"):
            v = data.get(field)
            parts.extend(v if isinstance(v, list) else [v])
        return {"prompt": "\n".join(_text(p) for p in parts)}
