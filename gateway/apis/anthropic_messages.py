"""Anthropic's Messages API (``POST /v1/messages``), as SGLang and llama.cpp serve it,
for Claude Code and other agents pointed at local models: ``system`` (a string or text
blocks), ``messages`` (string or block content), ``max_tokens`` (required), ``stream``.
Its stream is typed events (``message_start``, ``content_block_delta``,
``message_delta``, ``message_stop``): ``message_start`` carries the input usage,
``message_delta`` the output's. Its clients parse errors as
``{"type": "error", "error": {"type": ..., "message": ...}}``
(https://docs.anthropic.com/en/api/errors), the shape :meth:`Messages.error_body` gives.
``POST /v1/messages/count_tokens`` (:class:`CountTokens`) is routed like a Messages
request that generates nothing.
The prompt is routed as the chat conversation the engine renders from it.

A stream is continued on another backend with the text relayed as a last assistant
message (:meth:`Messages.continuation`), or, with the model's tokenizer configured, by
token ids (:meth:`Messages.token_continuation`): a completions request whose prompt is
the conversation rendered by the chat template, as routing tokenized it, followed by the
ids of the text relayed, its chunks rewritten into Messages events
(:class:`CompletionsAsMessages`)."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.apis.base import Api, Fields, error_message, missing, optional_int, read_model, read_stream
from gateway.apis.openai_completions import Completions
from gateway.errors import ClientError

# HTTP status -> Anthropic error type (https://docs.anthropic.com/en/api/errors)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                529: "overloaded_error"}


def _content(content: Any) -> Any:
    """Messages content (a string or blocks) as chat content: text blocks as chat's
    text parts, other blocks (images, tool use and results) as they are."""
    if not isinstance(content, list):
        return content
    return [{"type": "text", "text": b["text"]} if isinstance(b, dict) and b.get("type") == "text"
            and isinstance(b.get("text"), str) else b for b in content]


def error_type(status: int) -> str:
    """The Anthropic error type of HTTP ``status``."""
    return _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_error(status: int, message: str) -> bytes:
    """An Anthropic error body."""
    return orjson.dumps({"type": "error", "error": {"type": error_type(status), "message": message}})


class Messages(Api):
    """``POST /v1/messages`` (see the module docstring)."""

    name, path, operation = "messages", "/v1/messages", "chat"
    end_events = frozenset((b"message_stop",))
    user_field = "metadata.user_id"
    delta_event = b"content_block_delta"

    def read(self, data: dict[str, Any]) -> Fields:
        model, stream = read_model(data), read_stream(data)
        max_tokens = optional_int(data, "max_tokens", 1)
        if max_tokens is None:
            raise missing("max_tokens", data, "an integer >= 1")
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages:
            raise missing("messages", data, "a non-empty array")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
                raise ClientError(400, f"`messages[{i}]` must be an object whose `role` is `user` or `assistant`.",
                                  param=f"messages[{i}]", code="invalid_value")
        system = data.get("system")
        if system is not None and not isinstance(system, (str, list)):
            raise ClientError(400, "`system` must be a string or an array of text blocks.", param="system",
                              code="invalid_type")
        return Fields(model, stream, True, max_tokens)

    def view(self, data: dict[str, Any]) -> dict[str, Any]:
        messages: list[dict[str, Any]] = []
        system = data.get("system")
        if isinstance(system, list):
            system = "".join(b.get("text", "") for b in system if isinstance(b, dict))
        if isinstance(system, str) and system:
            messages.append({"role": "system", "content": system})
        messages.extend({"role": m.get("role"), "content": _content(m.get("content"))}
                        for m in data.get("messages") or () if isinstance(m, dict))
        view: dict[str, Any] = {"messages": messages}
        if data.get("tools"):
            view["tools"] = data["tools"]
        return view

    def usage_in(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        usage = obj.get("usage")
        if not isinstance(usage, dict):  # message_start: {"type": "message_start", "message": {..., "usage"}}
            message = obj.get("message")
            usage = message.get("usage") if isinstance(message, dict) else None
        return usage if isinstance(usage, dict) else None

    def counts(self, usage: dict[str, Any]) -> tuple[int | None, int | None, int | None]:
        """Anthropic's ``input_tokens`` leave out the prompt tokens read from or written
        to the cache (``cache_read_input_tokens``, ``cache_creation_input_tokens``):
        the prompt is their sum."""
        it, ot = usage.get("input_tokens"), usage.get("output_tokens")
        read, created = usage.get("cache_read_input_tokens"), usage.get("cache_creation_input_tokens")
        cached = read if isinstance(read, int) and read > 0 else None
        prompt = None
        if isinstance(it, int):
            prompt = it + (cached or 0) + (created if isinstance(created, int) and created > 0 else 0)
        return prompt, cached, ot if isinstance(ot, int) else None

    def continuable(self, data: dict[str, Any]) -> bool:
        """A continuation is the request with the text relayed as the start of the
        answer, a last assistant message the engine continues (Anthropic's prefill): not
        when the answer must be a tool call (``tool_choice`` ``any`` or a named tool), nor
        when the client's own start of the answer is content blocks (joined by the
        engine's template, the text would not follow on); thinking or a tool call in
        the answer stops it at the failure (:meth:`relayed_text`)."""
        tc = data.get("tool_choice")
        if isinstance(tc, dict) and tc.get("type") in ("any", "tool"):
            return False
        messages = data["messages"]
        last = messages[-1]
        return not (last.get("role") == "assistant" and not isinstance(last.get("content"), str))

    def relayed_text(self, event: dict[str, Any]) -> str | None:
        kind = event.get("type")
        if kind in ("message_start", "ping"):
            return ""
        if kind == "content_block_start":
            block = event.get("content_block")
            if event.get("index") != 0 or not isinstance(block, dict) or block.get("type") != "text":
                return None
            text = block.get("text", "")
            return text if isinstance(text, str) else None
        if kind == "content_block_delta":
            delta = event.get("delta")
            if event.get("index") != 0 or not isinstance(delta, dict) or delta.get("type") != "text_delta":
                return None
            text = delta.get("text")
            return text if isinstance(text, str) else None
        return None  # the block's or the message's end, an error, anything else

    def continuation(self, data: dict[str, Any], text: str, tokens: int) -> dict[str, Any] | None:
        left = data["max_tokens"] - tokens
        if left < 1:
            return None
        messages = list(data["messages"])
        last = messages[-1]
        if last.get("role") == "assistant":  # the client's own start of the answer, continued
            messages[-1] = {**last, "content": last["content"] + text}
        else:
            messages.append({"role": "assistant", "content": text})
        return {**data, "messages": messages, "max_tokens": left}

    def token_continuation(self, data: dict[str, Any], token_ids: list[int], tokens: int,
                           room: int | None) -> dict[str, Any] | None:
        """Not for a request with ``tools``, content other than text, or the client's own
        start of the answer (a last assistant message: routing rendered it closed, the
        engine continues it), which keep the text continuation."""
        messages = data["messages"]
        if data.get("tools") or messages[-1].get("role") == "assistant" or not all(
                isinstance(m.get("content"), str) or (isinstance(m.get("content"), list) and all(
                    isinstance(b, dict) and b.get("type") == "text" for b in m["content"])) for m in messages):
            return None
        left = data["max_tokens"] - tokens
        if left < 1:
            return None
        body = {f: data[f] for f in ("temperature", "top_p", "top_k") if data.get(f) is not None}
        if data.get("stop_sequences"):
            body["stop"] = data["stop_sequences"]
        body.update(model=data["model"], prompt=token_ids, max_tokens=left, stream=True,
                    stream_options={"include_usage": True})
        return body

    def spliced(self, event: dict[str, Any], head: dict[str, Any], prompt_tokens: int | None,
                tokens: int, echo: str = "") -> dict[str, Any] | None:
        """The continuation's ``message_start`` and the start of its first text block
        are dropped (the client has them: the first leg's message id and model); its
        ``message_delta`` usage counts the whole answer's output and, where it says
        them, the first leg's input tokens. A first text that begins with the text
        relayed (``echo``: the engine answered the assistant prefill with it, as
        llama.cpp does) has it left out, so the client does not get it twice."""
        kind = event.get("type")
        if kind == "message_start" or (kind == "content_block_start" and event.get("index") == 0):
            return None
        if echo and kind == "content_block_delta":
            delta = event.get("delta")
            if isinstance(delta, dict) and isinstance(delta.get("text"), str) and delta["text"].startswith(echo):
                return {**event, "delta": {**delta, "text": delta["text"][len(echo):]}}
        usage = event.get("usage")
        if kind == "message_delta" and isinstance(usage, dict):
            usage = dict(usage)
            out = usage.get("output_tokens")
            if isinstance(out, int):
                usage["output_tokens"] = out + tokens
            it = usage.get("input_tokens")
            if isinstance(it, int):
                read = usage.get("cache_read_input_tokens")
                read = read if isinstance(read, int) else 0
                prompt = prompt_tokens if prompt_tokens is not None else max(it + read - tokens, 0)
                cached = min(read, prompt)
                if "cache_read_input_tokens" in usage:
                    usage["cache_read_input_tokens"] = cached
                usage["input_tokens"] = prompt - cached
            return {**event, "usage": usage}
        return event

    def error_body(self, status: int, body: bytes) -> bytes:
        message, _ = error_message(body)
        if not message:
            try:
                obj = orjson.loads(body)
            except orjson.JSONDecodeError:
                obj = None
            if isinstance(obj, dict) and obj.get("type") == "error":  # already Anthropic's (the engine's own)
                return body
            message = body.decode("utf-8", "replace")[:1000] or f"HTTP {status}"
        return anthropic_error(status, message)

    def error_event(self, status: int, body: bytes) -> bytes:
        return b"event: error\ndata: " + self.error_body(status, body) + b"\n\n"


class CompletionsAsMessages(Completions):
    """The stream of a Messages answer's token continuation, a completions stream, read
    as completions and rewritten into the client's Messages events: each text as a
    ``content_block_delta`` (``text_delta``) of block 0, at its ``finish_reason``
    ``content_block_stop``, at its usage ``message_delta`` (``stop_reason``
    ``max_tokens`` when the answer ran out of tokens, ``stop_sequence`` with the stop
    string the engine names, else ``end_turn``; the whole answer's ``output_tokens``, the
    input's being the first leg's ``message_start``'s) and ``message_stop``. No
    ``[DONE]``."""

    relays_done = False

    def spliced(self, event: dict[str, Any], head: dict[str, Any], prompt_tokens: int | None,
                tokens: int, echo: str = "") -> list[dict[str, Any]] | None:
        out: list[dict[str, Any]] = []
        for c in event.get("choices") or ():
            if not isinstance(c, dict) or c.get("index", 0) != 0:
                continue
            text = c.get("text")
            if isinstance(text, str) and text:
                out.append({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}})
            finish = c.get("finish_reason")
            if finish is not None:
                stop = c.get("stop_reason")
                head["stop"] = ("max_tokens", None) if finish == "length" else \
                    ("stop_sequence", stop) if isinstance(stop, str) else ("end_turn", None)
                out.append({"type": "content_block_stop", "index": 0})
        usage = event.get("usage")
        if isinstance(usage, dict) and "stop" in head:
            ct = usage.get("completion_tokens")
            if isinstance(ct, int):
                reason, sequence = head["stop"]
                out += [{"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                         "usage": {"output_tokens": ct + tokens}},
                        {"type": "message_stop"}]
        return out


Messages.token_leg = CompletionsAsMessages()


class CountTokens(Messages):
    """``POST /v1/messages/count_tokens``: a Messages request (``max_tokens`` not
    needed) whose answer is ``{"input_tokens": N}``: the gateway's own when the model's
    tokenizer is configured (its chat template renders the messages as the engine
    does), else an engine's, at no generation cost."""

    name, path, operation = "count_tokens", "/v1/messages/count_tokens", "count_tokens"
    generates = False
    counts_tokens = True
    end_events = frozenset()

    def read(self, data: dict[str, Any]) -> Fields:
        model, _, _, _ = super().read({**data, "max_tokens": 1, "stream": False})
        return Fields(model, False, True, 0)

    def token_count_answer(self, prompt_tokens: int) -> bytes | None:
        return orjson.dumps({"input_tokens": prompt_tokens})
