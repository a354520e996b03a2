"""OpenAI's Chat Completions (``POST /v1/chat/completions``) and Completions
(``POST /v1/completions``): the two APIs every engine serves, whose streams end with
``data: [DONE]`` and carry their usage when asked (``stream_options.include_usage``,
which the gateway asks for on the client's behalf:
:func:`gateway.pipeline.openai_request.request_usage`)."""

from __future__ import annotations

from typing import Any

from gateway.apis.base import Api, Fields, missing, optional_int, read_model, read_stream
from gateway.errors import ClientError


def _openai_fields(data: dict[str, Any]) -> Fields:
    model, stream = read_model(data), read_stream(data)
    opts = data.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise ClientError(400, "`stream_options` must be an object.", param="stream_options", code="invalid_type")
        include_usage = bool(opts.get("include_usage", False))
    max_tokens = optional_int(data, "max_tokens", 1)
    mct = optional_int(data, "max_completion_tokens", 1)
    return Fields(model, stream, include_usage, max_tokens if max_tokens is not None else mct)


class ChatCompletions(Api):
    """``POST /v1/chat/completions``: ``messages`` (a non-empty array of objects with
    a string ``role``), rendered through the model's chat template."""

    name, path, operation = "chat", "/v1/chat/completions", "chat"
    disaggregates = True

    def read(self, data: dict[str, Any]) -> Fields:
        fields = _openai_fields(data)
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages:
            raise missing("messages", data, "a non-empty array")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ClientError(400, f"`messages[{i}]` must be an object with a string `role`.",
                                  param=f"messages[{i}]", code="invalid_value")
        return fields


class Completions(Api):
    """``POST /v1/completions``: ``prompt`` (a string, token ids, or an array of
    either), sent to the engine as text."""

    name, path, operation = "completions", "/v1/completions", "text_completion"
    prompt_kind, prompt_param = "completions", "prompt"
    disaggregates = True

    def read(self, data: dict[str, Any]) -> Fields:
        fields = _openai_fields(data)
        prompt = data.get("prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt)):
            raise missing("prompt", data, "a string or a non-empty array")
        return fields
