"""OpenAI's Chat Completions (``POST /v1/chat/completions``) and Completions
(``POST /v1/completions``): the two APIs every engine serves, whose streams end with
``data: [DONE]`` and carry their usage when asked (``stream_options.include_usage``,
which the gateway asks for on the client's behalf:
:func:`gateway.pipeline.openai_request.request_usage`).

A stream of either may be continued on another backend (:mod:`gateway.pipeline.migration`):
chat as the conversation with the text so far as a last assistant message that the
engine continues (``continue_final_message: true``, ``add_generation_prompt: false``:
vLLM's and SGLang's fields; llama.cpp continues a last assistant message by itself),
completions as the prompt followed by the text so far. Not continued, because the
continuation could not be faithful: ``n`` or ``best_of`` above 1, logprobs asked for
(``logprobs``, ``top_logprobs``, ``prompt_logprobs``), ``echo``, a completions
``suffix`` or a prompt that is not one string, structured output (``response_format``
``json_object`` or ``json_schema``, vLLM's ``guided_*`` and ``structured_outputs``: the
engine would constrain the continuation as a whole new document), a forced tool call
(``tool_choice`` ``required`` or a named function); and at the failure, an answer that
had started a tool call or reasoning, or had ended (:meth:`relayed_text`).

With the model's tokenizer configured, both are continued by token ids instead
(:meth:`ChatCompletions.token_continuation`): a completions request whose prompt is the
prompt's ids followed by the answer's, which needs no chat template on the engine and
re-tokenizes nothing; a chat's continuation is read as completions chunks and rewritten
into chat chunks (:class:`CompletionsAsChat`). Not for a chat whose rendering the
gateway may not reproduce, or whose answer the engine parses: ``tools`` or ``functions``,
content other than text, the chat template's options (``chat_template``,
``chat_template_kwargs``, ``documents``, ``add_generation_prompt``,
``continue_final_message``); those keep the text continuation."""

from __future__ import annotations

from typing import Any

from gateway.apis.base import Api, Fields, check_chat_messages, missing, optional_int, read_model, read_stream
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


_UNFAITHFUL = ("logprobs", "top_logprobs", "prompt_logprobs", "echo", "guided_json", "guided_regex",
               "guided_choice", "guided_grammar", "structured_outputs")
# every field that may make a request not continuable: most requests set none of them
_CHECKED = frozenset((*_UNFAITHFUL, "n", "best_of", "response_format", "tool_choice", "suffix"))


def _continuable(data: dict[str, Any]) -> bool:
    """The conditions both APIs share (see the module doc)."""
    present = _CHECKED.intersection(data)
    return not present or _faithful(data, present)


def _faithful(data: dict[str, Any], present: frozenset[str]) -> bool:
    """Whether the fields of ``data`` named in ``present`` allow a faithful continuation."""
    if data.get("n") not in (None, 1) or data.get("best_of") not in (None, 1) or data.get("suffix"):
        return False
    if any(data[f] is not None and data[f] is not False for f in present.intersection(_UNFAITHFUL)):
        return False  # logprobs 0 asks for logprobs too
    rf, tc = data.get("response_format"), data.get("tool_choice")
    return not (isinstance(rf, dict) and rf.get("type") not in (None, "text")) and \
        not (tc == "required" or isinstance(tc, dict))


def _relayed_text(event: dict[str, Any], chat: bool) -> str | None:
    """The text choice 0 of one stream event adds (see :meth:`Api.relayed_text`)."""
    choices = event.get("choices")
    if not isinstance(choices, list) or "error" in event:
        return None
    text = ""
    for c in choices:
        if not isinstance(c, dict) or c.get("index", 0) != 0 or c.get("finish_reason") is not None \
                or c.get("logprobs"):
            return None
        if chat:
            delta = c.get("delta")
            if not isinstance(delta, dict) or delta.get("tool_calls") or delta.get("function_call") \
                    or delta.get("reasoning_content") or delta.get("reasoning") or delta.get("refusal"):
                return None
            part = delta.get("content")
        else:
            part = c.get("text")
        if part is not None and not isinstance(part, str):
            return None
        text += part or ""
    return text


def _rest(data: dict[str, Any], tokens: int) -> dict[str, Any] | None:
    """``data`` with its output-token caps (and ``min_tokens``) reduced by ``tokens``,
    or ``None`` when no token is left."""
    out = dict(data)
    for f in ("max_tokens", "max_completion_tokens"):
        cap = data.get(f)
        if isinstance(cap, int) and not isinstance(cap, bool):
            if cap - tokens < 1:
                return None
            out[f] = cap - tokens
    floor = data.get("min_tokens")
    if isinstance(floor, int) and not isinstance(floor, bool) and floor > 0:
        out["min_tokens"] = max(floor - tokens, 0)
    return out


def _spliced(event: dict[str, Any], head: dict[str, Any], prompt_tokens: int | None, tokens: int,
             chat: bool) -> dict[str, Any] | None:
    """See :meth:`Api.spliced`: the client's ``id``, ``created`` and ``model``; the role-only
    first chunk of a chat continuation dropped; usage rewritten for the whole answer."""
    choices = event.get("choices")
    if chat and isinstance(choices, list) and len(choices) == 1 and "usage" not in event:
        c = choices[0]
        delta = c.get("delta") if isinstance(c, dict) else None
        if isinstance(delta, dict) and "role" in delta and not any(v for k, v in delta.items() if k != "role") \
                and c.get("finish_reason") is None:
            return None
    event.update(head)
    usage = event.get("usage")
    if isinstance(usage, dict):
        pt, ct = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(pt, int) and isinstance(ct, int):
            prompt = prompt_tokens if prompt_tokens is not None else max(pt - tokens, 0)
            usage = {**usage, "prompt_tokens": prompt, "completion_tokens": ct + tokens,
                     "total_tokens": prompt + ct + tokens}
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                usage["prompt_tokens_details"] = {**details, "cached_tokens": min(details["cached_tokens"], prompt)}
            event["usage"] = usage
    return event


# the request fields a token continuation carries over: vLLM's sampling parameters that
# both APIs share (https://docs.vllm.ai/en/latest/api/vllm/sampling_params.html) and OpenAI's
_TOKEN_CARRIED = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "frequency_penalty",
                  "presence_penalty", "repetition_penalty", "length_penalty", "ignore_eos", "min_tokens",
                  "logit_bias", "allowed_token_ids", "bad_words", "skip_special_tokens",
                  "spaces_between_special_tokens", "include_stop_str_in_output", "user", "priority", "cache_salt",
                  "stream_options", "return_token_ids")
# chat fields that change how the engine renders the prompt or reads the answer
_CHAT_RENDERED = ("tools", "functions", "chat_template", "chat_template_kwargs", "documents",
                  "add_generation_prompt", "continue_final_message", "mm_processor_kwargs")


def _token_body(data: dict[str, Any], token_ids: list[int], tokens: int, room: int | None) -> dict[str, Any] | None:
    """See :meth:`Api.token_continuation` (both APIs)."""
    out = _rest(data, tokens)
    if out is None:
        return None
    caps = [out[f] for f in ("max_tokens", "max_completion_tokens") if isinstance(data.get(f), int)]
    left = min(caps) if caps else room
    if left is None or left < 1:
        return None
    body = {k: out[k] for k in _TOKEN_CARRIED if k in out}
    body.update(model=data["model"], prompt=token_ids, max_tokens=left, stream=True)
    return body


def _text_only(content: Any) -> bool:
    """Whether chat ``content`` is text: a string, or text parts only."""
    if content is None or isinstance(content, str):
        return True
    return isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content)


class ChatCompletions(Api):
    """``POST /v1/chat/completions``: ``messages`` (a non-empty array of objects with
    a string ``role``), rendered through the model's chat template."""

    name, path, operation = "chat", "/v1/chat/completions", "chat"
    disaggregates = streams_token_ids = True
    session_field, user_field = "prompt_cache_key", "user"

    def read(self, data: dict[str, Any]) -> Fields:
        fields = _openai_fields(data)
        check_chat_messages(data)
        return fields

    def continuable(self, data: dict[str, Any]) -> bool:
        return _continuable(data)

    def relayed_text(self, event: dict[str, Any]) -> str | None:
        return _relayed_text(event, True)

    def continuation(self, data: dict[str, Any], text: str, tokens: int) -> dict[str, Any] | None:
        out = _rest(data, tokens)
        if out is None:
            return None
        messages = list(data["messages"])
        last = messages[-1]
        if data.get("continue_final_message") is True and last.get("role") == "assistant" \
                and isinstance(last.get("content"), str):  # the client's own start of the answer, continued
            messages[-1] = {**last, "content": last["content"] + text}
        else:
            messages.append({"role": "assistant", "content": text})
        out.update(messages=messages, continue_final_message=True, add_generation_prompt=False)
        return out

    def token_continuation(self, data: dict[str, Any], token_ids: list[int], tokens: int,
                           room: int | None) -> dict[str, Any] | None:
        if any(data.get(f) not in (None, [], {}) for f in _CHAT_RENDERED) or \
                not all(_text_only(m.get("content")) and not m.get("tool_calls") for m in data["messages"]):
            return None
        return _token_body(data, token_ids, tokens, room)

    def spliced(self, event: dict[str, Any], head: dict[str, Any], prompt_tokens: int | None,
                tokens: int, echo: str = "") -> dict[str, Any] | None:
        return _spliced(event, head, prompt_tokens, tokens, True)


class Completions(Api):
    """``POST /v1/completions``: ``prompt`` (a string, token ids, or an array of
    either), sent to the engine as text."""

    name, path, operation = "completions", "/v1/completions", "text_completion"
    prompt_kind, prompt_param = "completions", "prompt"
    disaggregates = streams_token_ids = True
    session_field, user_field = "prompt_cache_key", "user"

    def read(self, data: dict[str, Any]) -> Fields:
        fields = _openai_fields(data)
        prompt = data.get("prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt)):
            raise missing("prompt", data, "a string or a non-empty array")
        return fields

    def continuable(self, data: dict[str, Any]) -> bool:
        return isinstance(data.get("prompt"), str) and _continuable(data)

    def relayed_text(self, event: dict[str, Any]) -> str | None:
        return _relayed_text(event, False)

    def continuation(self, data: dict[str, Any], text: str, tokens: int) -> dict[str, Any] | None:
        out = _rest(data, tokens)
        if out is not None:
            out["prompt"] = data["prompt"] + text
        return out

    def token_continuation(self, data: dict[str, Any], token_ids: list[int], tokens: int,
                           room: int | None) -> dict[str, Any] | None:
        return _token_body(data, token_ids, tokens, room)

    def spliced(self, event: dict[str, Any], head: dict[str, Any], prompt_tokens: int | None,
                tokens: int, echo: str = "") -> dict[str, Any] | list[dict[str, Any]] | None:
        return _spliced(event, head, prompt_tokens, tokens, False)


class CompletionsAsChat(Completions):
    """The stream of a chat answer's token continuation, a completions stream, read as
    completions and rewritten into the client's chat stream: each chunk as a chat chunk
    (``object`` ``chat.completion.chunk``, choice ``text`` as ``delta.content``, its
    ``finish_reason``, ``stop_reason`` and ``token_ids`` kept) with the client's
    ``id``, ``created`` and ``model`` and the whole answer's usage (:func:`_spliced`)."""

    def spliced(self, event: dict[str, Any], head: dict[str, Any], prompt_tokens: int | None,
                tokens: int, echo: str = "") -> dict[str, Any] | None:
        out = _spliced(event, head, prompt_tokens, tokens, False)
        if out is None:
            return None
        out["object"] = "chat.completion.chunk"
        choices = out.get("choices")
        if isinstance(choices, list):
            out["choices"] = [_as_chat_choice(c) if isinstance(c, dict) else c for c in choices]
        return out


def _as_chat_choice(c: dict[str, Any]) -> dict[str, Any]:
    """A completions stream choice as a chat one."""
    out: dict[str, Any] = {"index": c.get("index", 0), "delta": {"content": c.get("text") or ""},
                           "logprobs": None, "finish_reason": c.get("finish_reason")}
    for f in ("stop_reason", "token_ids"):
        if f in c:
            out[f] = c[f]
    return out


ChatCompletions.token_leg = CompletionsAsChat()
Completions.token_leg = Completions()
