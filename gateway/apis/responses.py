"""OpenAI's Responses API (``POST /v1/responses``), as vLLM, SGLang and llama.cpp
serve it: ``input`` (a string, or an array of items: messages with text content
parts, function calls and their outputs), ``instructions``, ``max_output_tokens``.
Its stream is a sequence of typed events (``event: response.output_text.delta``...)
that ends with ``response.completed`` (or ``response.incomplete``, ``response.failed``),
whose ``response.usage`` counts ``input_tokens`` (``input_tokens_details.cached_tokens``)
and ``output_tokens``. The prompt is routed as the chat conversation the engine renders
from it: ``instructions`` as the system message, then each input item."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.apis.base import Api, Fields, missing, optional_int, read_model, read_stream

_GATEWAY_FIELDS = ("previous_response_id", "conversation")  # state the gateway keeps: never sent to an engine
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text"}


def _content(content: Any) -> Any:
    """A Responses content (a string, or parts) as chat content: text parts as chat's
    ``{"type": "text"}`` parts, other parts as they are."""
    if not isinstance(content, list):
        return content
    out = []
    for p in content:
        if isinstance(p, dict) and p.get("type") in _TEXT_PARTS and isinstance(p.get("text"), str):
            out.append({"type": "text", "text": p["text"]})
        else:
            out.append(p)
    return out


def chat_messages(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages a Responses request ``data`` amounts to: ``instructions`` as
    a system message, a string ``input`` as a user message, message items as messages
    and other items (function calls, their outputs, reasoning) as messages of their
    type, holding their JSON."""
    out: list[dict[str, Any]] = []
    instructions = data.get("instructions")
    if isinstance(instructions, str) and instructions:
        out.append({"role": "system", "content": instructions})
    inp = data.get("input")
    if isinstance(inp, str):
        out.append({"role": "user", "content": inp})
        return out
    for item in inp or ():
        if not isinstance(item, dict):
            continue
        if isinstance(item.get("role"), str) and item.get("type", "message") == "message":
            out.append({"role": item["role"], "content": _content(item.get("content"))})
        else:
            out.append({"role": str(item.get("type", "item")),
                        "content": orjson.dumps(item, option=orjson.OPT_SORT_KEYS).decode()})
    return out


def input_items(data: dict[str, Any]) -> list[Any]:
    """A request's ``input`` as a list of items (a string is one user message)."""
    inp = data.get("input")
    if isinstance(inp, str):
        return [{"type": "message", "role": "user", "content": inp}]
    return list(inp) if isinstance(inp, list) else []


class Responses(Api):
    """``POST /v1/responses`` (see the module docstring)."""

    name, path, operation = "responses", "/v1/responses", "chat"
    prompt_param = "input"
    stateful = True
    session_field: str | None = "prompt_cache_key"
    user_field: str | None = "user"
    end_events = frozenset((b"response.completed", b"response.incomplete", b"response.failed"))
    delta_event = b"response.output_text.delta"

    def read(self, data: dict[str, Any]) -> Fields:
        model, stream = read_model(data), read_stream(data)
        inp = data.get("input")
        if not isinstance(inp, (str, list)):
            raise missing("input", data, "a string or an array of input items")
        return Fields(model, stream, True, optional_int(data, "max_output_tokens", 1))

    def view(self, data: dict[str, Any]) -> dict[str, Any]:
        view: dict[str, Any] = {"messages": chat_messages(data)}
        if data.get("tools"):
            view["tools"] = data["tools"]
        return view

    def expand(self, data: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
        """``data`` whose ``previous_response_id`` named the turn ``record`` (or whose
        ``conversation`` holds the items ``record["input"]``): its input is that turn's
        input, that turn's output items, then its own input; the ``instructions`` stay
        its own (the API does not carry them over)."""
        response = record.get("response")
        output = response.get("output") if isinstance(response, dict) else None
        out = {k: v for k, v in data.items() if k not in _GATEWAY_FIELDS}
        out["input"] = [*record.get("input", ()), *(output if isinstance(output, list) else ()), *input_items(data)]
        return out

    def record(self, data: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
        return {"input": input_items(data), "response": answer}

    def usage_in(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        usage = obj.get("usage")
        if not isinstance(usage, dict):  # a stream's last event: {"type": "response.completed", "response": {...}}
            response = obj.get("response")
            usage = response.get("usage") if isinstance(response, dict) else None
        return usage if isinstance(usage, dict) else None

    def counts(self, usage: dict[str, Any]) -> tuple[int | None, int | None, int | None]:
        it, ot = usage.get("input_tokens"), usage.get("output_tokens")
        details = usage.get("input_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return (it if isinstance(it, int) else None, max(cached, 0) if isinstance(cached, int) else None,
                ot if isinstance(ot, int) else None)


class InputTokens(Responses):
    """``POST /v1/responses/input_tokens``: a Responses request (``input`` optional,
    nothing generated; ``previous_response_id`` and ``conversation`` expanded by the
    gateway as for a turn) whose answer is ``{"object": "response.input_tokens",
    "input_tokens": N}``: the gateway's own when the model's tokenizer is configured
    (the chat template renders the input as the engine does), else a backend's that
    serves the path, else the gateway's estimate."""

    name, path, operation = "input_tokens", "/v1/responses/input_tokens", "count_tokens"
    generates = False
    counts_tokens = True
    session_field: str | None = None
    user_field: str | None = None
    end_events = frozenset()
    delta_event = b""

    def read(self, data: dict[str, Any]) -> Fields:
        model = read_model(data)
        inp = data.get("input")
        if inp is not None and not isinstance(inp, (str, list)):
            raise missing("input", data, "a string or an array of input items")
        return Fields(model, False, True, 0)

    def token_count_answer(self, prompt_tokens: int) -> bytes | None:
        return orjson.dumps({"object": "response.input_tokens", "input_tokens": prompt_tokens})
