"""OpenAI's Responses API (``POST /v1/responses``), as vLLM, SGLang and llama.cpp
serve it: ``input`` (a string, or an array of items: messages with text content
parts, function calls and their outputs), ``instructions``, ``max_output_tokens``.
Its stream is a sequence of typed events (``event: response.output_text.delta``...)
that ends with ``response.completed`` (or ``response.incomplete``, ``response.failed``),
whose ``response.usage`` counts ``input_tokens`` (``input_tokens_details.cached_tokens``)
and ``output_tokens``. The prompt is routed as the chat conversation the engine renders
from it: ``instructions`` as the system message, then each input item.

A stream may be continued on another backend only by token ids (the Responses API has
no way to ask an engine to go on with a partial assistant message), so only with the
model's tokenizer configured: a completions request whose prompt is the conversation
rendered by the chat template, as routing tokenized it, followed by the ids of the text
relayed (:meth:`Responses.token_continuation`), its chunks rewritten into the client's
Responses events (:class:`CompletionsAsResponses`). Not continued: ``tools``, input
items other than messages of text, structured output (``text.format`` other than
``text``), ``top_logprobs``, ``include`` asking for logprobs; and at the failure, an
answer whose first output item is not a message of text (reasoning, a function call)
or that had ended (:meth:`Responses.relayed_text`)."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.apis.base import Api, Fields, missing, optional_int, read_model, read_stream
from gateway.apis.openai_completions import Completions

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


# the request fields a token continuation carries over, as completions fields
_TOKEN_CARRIED = {"temperature": "temperature", "top_p": "top_p", "user": "user", "seed": "seed",
                  "top_k": "top_k", "min_p": "min_p", "stop": "stop", "ignore_eos": "ignore_eos",
                  "repetition_penalty": "repetition_penalty", "frequency_penalty": "frequency_penalty",
                  "presence_penalty": "presence_penalty", "priority": "priority", "cache_salt": "cache_salt",
                  "stop_token_ids": "stop_token_ids", "logit_bias": "logit_bias",
                  "skip_special_tokens": "skip_special_tokens"}
# the stream events before and at the first output text, which add no text
_OPENING = frozenset(("response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"))


def _text_message(item: Any) -> bool:
    """Whether an input item is a message whose content is text (a string or text parts)."""
    if isinstance(item, str):
        return True
    if not isinstance(item, dict) or item.get("type", "message") != "message" or not isinstance(item.get("role"), str):
        return False
    content = item.get("content")
    return isinstance(content, str) or (isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") in _TEXT_PARTS for p in content))


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

    continues_text = False

    def continuable(self, data: dict[str, Any]) -> bool:
        fmt = data.get("text")
        fmt = fmt.get("format") if isinstance(fmt, dict) else None
        include = data.get("include")
        return not data.get("tools") and not data.get("top_logprobs") and \
            not (isinstance(fmt, dict) and fmt.get("type") not in (None, "text")) and \
            not (isinstance(include, list) and any("logprobs" in str(i) for i in include)) and \
            all(_text_message(item) for item in input_items(data))

    def relayed_text(self, event: dict[str, Any]) -> str | None:
        kind = event.get("type")
        if kind in _OPENING:
            item = event.get("item")
            part = event.get("part")
            if event.get("output_index", 0) != 0 or (isinstance(item, dict) and item.get("type") != "message") or \
                    (isinstance(part, dict) and part.get("type") != "output_text"):
                return None
            return ""
        if kind == "response.output_text.delta" and event.get("output_index") == 0 and \
                event.get("content_index") == 0 and isinstance(event.get("delta"), str):
            return event["delta"]
        return None  # the text's or the answer's end, another item, an error

    def follow(self, event: dict[str, Any], head: dict[str, Any]) -> None:
        """The response object (its ``response.created`` event's), the message item's id,
        the next ``sequence_number`` and the text so far: what the continuation's events
        are written with (:class:`CompletionsAsResponses`)."""
        kind = event.get("type")
        if kind == "response.created" and isinstance(event.get("response"), dict):
            head["response"] = event["response"]
        elif kind == "response.output_item.added" and isinstance(event.get("item"), dict):
            head["item_id"] = event["item"].get("id")
        elif kind == "response.output_text.delta" and isinstance(event.get("delta"), str):
            head["text"] = head.get("text", "") + event["delta"]
        seq = event.get("sequence_number")
        if isinstance(seq, int):
            head["sequence_number"] = seq + 1

    def token_continuation(self, data: dict[str, Any], token_ids: list[int], tokens: int,
                           room: int | None) -> dict[str, Any] | None:
        cap = data.get("max_output_tokens")
        left = cap - tokens if isinstance(cap, int) and not isinstance(cap, bool) else room
        if left is None or left < 1:
            return None
        body = {to: data[f] for f, to in _TOKEN_CARRIED.items() if data.get(f) is not None}
        body.update(model=data["model"], prompt=token_ids, max_tokens=left, stream=True,
                    stream_options={"include_usage": True})
        return body

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


class CompletionsAsResponses(Completions):
    """The stream of a Responses answer's token continuation, a completions stream, read
    as completions and rewritten into the client's Responses events, numbered on from
    the last one relayed (``sequence_number``): each text as a
    ``response.output_text.delta`` of the message item being written; at its
    ``finish_reason`` the item's end (``response.output_text.done``,
    ``response.content_part.done``, ``response.output_item.done``, with the whole text);
    at its usage ``response.completed``, the first leg's response object with that item
    as its output, ``status`` ``incomplete`` (``incomplete_details.reason``
    ``max_output_tokens``) when the answer ran out of tokens, else ``completed``, and the
    whole answer's usage. No ``[DONE]`` (Responses streams have none)."""

    relays_done = False

    def spliced(self, event: dict[str, Any], head: dict[str, Any], prompt_tokens: int | None,
                tokens: int, echo: str = "") -> list[dict[str, Any]] | None:
        out: list[dict[str, Any]] = []
        at = {"item_id": head.get("item_id"), "output_index": 0, "content_index": 0}
        for c in event.get("choices") or ():
            if not isinstance(c, dict) or c.get("index", 0) != 0:
                continue
            text = c.get("text")
            if isinstance(text, str) and text:
                head["text"] = head.get("text", "") + text
                out.append({"type": "response.output_text.delta", **at, "delta": text, "logprobs": []})
            if c.get("finish_reason") is not None:
                status = "incomplete" if c["finish_reason"] == "length" else "completed"
                whole = head.get("text", "")
                part = {"type": "output_text", "text": whole, "annotations": [], "logprobs": []}
                item = head["item"] = {"type": "message", "id": at["item_id"], "role": "assistant",
                                       "status": status, "content": [part]}
                out += [{"type": "response.output_text.done", **at, "text": whole, "logprobs": []},
                        {"type": "response.content_part.done", **at, "part": part},
                        {"type": "response.output_item.done", "output_index": 0, "item": item}]
        usage = event.get("usage")
        ended = head.get("item")
        if isinstance(usage, dict) and isinstance(ended, dict):
            pt, ct = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(pt, int) and isinstance(ct, int):
                prompt = prompt_tokens if prompt_tokens is not None else max(pt - tokens, 0)
                details = usage.get("prompt_tokens_details")
                cached = details.get("cached_tokens") if isinstance(details, dict) else None
                whole_usage = {"input_tokens": prompt,
                               "input_tokens_details": {"cached_tokens": min(cached or 0, prompt)},
                               "output_tokens": ct + tokens, "output_tokens_details": {"reasoning_tokens": 0},
                               "total_tokens": prompt + ct + tokens}
                response = dict(head.get("response") or {})
                incomplete = ended["status"] == "incomplete"
                response.update(status=ended["status"], output=[ended], usage=whole_usage,
                                incomplete_details={"reason": "max_output_tokens"} if incomplete else None)
                out.append({"type": "response.completed", "response": response})
        for e in out:
            seq = head.get("sequence_number", 0)
            e["sequence_number"] = seq
            head["sequence_number"] = seq + 1
        return out


Responses.token_leg = CompletionsAsResponses()
