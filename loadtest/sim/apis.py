"""The engine APIs the simulator serves beside chat and completions, one adapter each.

Every adapter is an :class:`Api`: it reads a request body into a :class:`Job` (the
prompts as token ids, the output budget, the stream flag), shapes the whole answer from
the engine's outputs and, for a generation API, the SSE events of a streamed one, and
answers a refusal (:class:`~loadtest.sim.prompt.BadRequest`) in its own error shape. The
path a request takes (body, model, faults, engine, abort on disconnect) is the one of
:meth:`loadtest.sim.server.SimBackend.serve`, shared by all of them.

* :data:`RESPONSES`, ``POST /v1/responses`` (OpenAI Responses API as vLLM serves it):
  ``input`` (a string or a list of items: messages ``{"role", "content"}`` whose content
  is a string or ``input_text``/``output_text`` parts, ``function_call`` and
  ``function_call_output`` items), ``instructions`` (a system message), ``tools``,
  ``max_output_tokens``, ``stream``. The answer is a Response object (``resp_...``, one
  ``message`` output item with one ``output_text`` part, ``usage`` with
  ``input_tokens_details.cached_tokens``); ``status`` is ``incomplete``
  (``incomplete_details.reason: max_output_tokens``) when the budget ran out. Streamed:
  ``event: <type>`` / ``data: <json>`` pairs with a ``sequence_number`` from 0:
  ``response.created``, ``response.in_progress`` at once, ``response.output_item.added``
  and ``response.content_part.added`` with the first token, one
  ``response.output_text.delta`` per engine output, then ``response.output_text.done``,
  ``response.content_part.done``, ``response.output_item.done`` and
  ``response.completed`` (its ``response`` carries the output and the usage); no
  ``[DONE]``. The simulator stores no response: ``previous_response_id`` gets vLLM's 404
  (``Response with id '...' not found.``), as from an engine that does not have it.
* :data:`MESSAGES`, ``POST /v1/messages`` (Anthropic Messages as llama.cpp and SGLang
  serve it): ``system`` (a string or text blocks), ``messages`` (string or block
  content: text, tool_use, tool_result, image), ``tools``, ``max_tokens`` (required),
  ``stream``; a last message of the assistant is continued (Anthropic's prefill, as
  llama.cpp continues it). The answer: ``{"id": "msg_...", "type": "message", "role": "assistant",
  "model", "content": [{"type": "text", "text"}], "stop_reason": "end_turn" |
  "max_tokens", "stop_sequence": null, "usage"}``; ``usage.input_tokens`` counts the
  prompt tokens not read from the prefix cache, ``cache_read_input_tokens`` those read.
  Streamed: ``message_start`` (usage with ``output_tokens: 0``) and
  ``content_block_start`` with the first token, one ``content_block_delta``
  (``text_delta``) per engine output, ``content_block_stop``, ``message_delta``
  (``stop_reason``, ``usage.output_tokens``), ``message_stop``. Errors are Anthropic's
  ``{"type": "error", "error": {"type": "invalid_request_error" | "not_found_error" |
  ..., "message"}}``. ``POST /v1/messages/count_tokens`` answers ``{"input_tokens": N}``.
* :data:`EMBEDDINGS`, ``POST /v1/embeddings`` (vLLM's pooling answer ``{"object":
  "list", "data": [{"object": "embedding", "index", "embedding"}], "model", "usage"}``).
  Pooling APIs cost prefill only: each input is one engine request that stops after
  its prompt (the engine's ``prefill_only``), none is streamed, and ``usage`` carries
  ``prompt_tokens_details.cached_tokens`` beside vLLM's fields.
* :data:`RERANK` (``POST /v1/rerank``, ``POST /rerank``) and :data:`SCORE` (``POST
  /v1/score``) in vLLM's shapes, prefill only, one engine request per (query, document)
  pair, with deterministic scores.

Chat-like requests are rendered with :func:`~loadtest.sim.prompt.render_chat` (the
ChatML template of chat completions), so a conversation shares its prefix-cache blocks
across turns whichever API carries it.
"""

from __future__ import annotations

import base64
import hashlib
import math
import random
import struct
import uuid
from array import array
from typing import Any, NamedTuple

import orjson
from aiohttp import web

from loadtest.sim import tokenizer
from loadtest.sim.engine import RequestOutput
from loadtest.sim.prompt import BadRequest, check_token_ids, content_text, dumps, read_prompt, render_chat

Result = tuple[list[int], RequestOutput]  # (every token id generated, the last output)


class Job(NamedTuple):
    """What one API request asks of the engine."""

    model: str
    data: dict[str, Any]  # the request body
    prompts: list[list[int]]  # token ids, one engine request each (one for a generation API)
    max_tokens: int | None  # output budget; None: the server's default
    stream: bool
    text: str | None = None  # the prompt's text, from which the output follows (None: from its ids)


class Events:
    """The SSE events of one streamed answer: :meth:`head` is written at once,
    :meth:`tokens` for each engine output, :meth:`tail` after the last."""

    def head(self) -> list[bytes]:
        return []

    def tokens(self, out: RequestOutput) -> list[bytes]:
        raise NotImplementedError

    def tail(self) -> list[bytes]:
        return []


class Api:
    """One engine API: how its requests are read and its answers shaped.

    ``id_prefix`` starts the answer's ``id``; ``pooling`` APIs cost prefill only (each
    input is one engine request that stops after its prompt) and are never streamed."""

    id_prefix = "cmpl-"
    pooling = False

    def parse(self, data: dict[str, Any], tok: tokenizer.Tokenizer) -> Job:
        """The :class:`Job` of a request body (``model`` already checked). Raises
        :class:`BadRequest`."""
        raise NotImplementedError

    def whole(self, job: Job, rid: str, created: int, results: list[Result], tok: tokenizer.Tokenizer) -> dict:
        """The answer body, from each prompt's :data:`Result` in order."""
        raise NotImplementedError

    def events(self, job: Job, rid: str, created: int, tok: tokenizer.Tokenizer) -> Events:
        """The events of a streamed answer (generation APIs only)."""
        raise NotImplementedError

    def error(self, e: BadRequest) -> web.Response:
        """A refusal in this API's error shape (by default OpenAI's, as vLLM answers)."""
        return e.response()


# --- shared readers -------------------------------------------------------------------


def optional_positive_int(data: dict[str, Any], key: str) -> int | None:
    """``data[key]``: absent or null is None; anything but an integer >= 1 raises
    :class:`BadRequest` naming ``key``."""
    v = data.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise BadRequest(f"`{key}` must be an integer >= 1", key)
    return v


def stream_flag(data: dict[str, Any]) -> bool:
    s = data.get("stream", False)
    if s is None:
        return False
    if not isinstance(s, bool):
        raise BadRequest("`stream` must be a boolean", "stream")
    return s


def sse(event: str, obj: dict[str, Any]) -> bytes:
    """One SSE event with an ``event:`` line, as the Responses and Messages streams send."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


# --- Responses ------------------------------------------------------------------------

_ROLES = ("user", "assistant", "system", "developer")


def responses_messages(data: dict[str, Any]) -> list[dict[str, Any]]:
    """A Responses request's ``instructions`` and ``input`` as chat messages (for
    :func:`render_chat`). Raises :class:`BadRequest`."""
    msgs: list[dict[str, Any]] = []
    ins = data.get("instructions")
    if ins is not None:
        if not isinstance(ins, str):
            raise BadRequest("`instructions` must be a string", "instructions")
        msgs.append({"role": "system", "content": ins})
    inp = data.get("input")
    if isinstance(inp, str):
        msgs.append({"role": "user", "content": inp})
        return msgs
    if not isinstance(inp, list) or not inp:
        raise BadRequest("`input` must be a string or a non-empty list of input items", "input")
    for i, item in enumerate(inp):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in _ROLES:
            content = item.get("content")
            if not isinstance(content, (str, list)):
                raise BadRequest("a message's `content` must be a string or a list of parts",
                                 f"input.{i}.content")
            msgs.append({"role": item["role"], "content": content})
        elif kind == "function_call":
            msgs.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": item.get("call_id"), "type": "function",
                 "function": {"name": item.get("name"), "arguments": item.get("arguments")}}]})
        elif kind == "function_call_output":
            msgs.append({"role": "tool", "content": item.get("output")})
        else:
            raise BadRequest("an input item must be a message (`role` one of user, assistant, system, "
                             "developer, and `content`), a function_call or a function_call_output",
                             f"input.{i}")
    return msgs


def responses_usage(prompt: int, cached: int, output: int) -> dict[str, Any]:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output}


class Responses(Api):
    id_prefix = "resp_"

    def parse(self, data: dict[str, Any], tok: tokenizer.Tokenizer) -> Job:
        prev = data.get("previous_response_id")
        if prev is not None:
            raise BadRequest(f"Response with id '{prev}' not found.", "response_id", status=404,
                             etype="invalid_request_error")
        msgs = responses_messages(data)
        text = render_chat(msgs, data.get("tools"))
        ids = tok.tokenize(text, add_special_tokens=False)
        return Job(data["model"], data, [ids], optional_positive_int(data, "max_output_tokens"),
                   stream_flag(data), text)

    @staticmethod
    def response(job: Job, rid: str, created: int, status: str, output: list, usage: dict | None) -> dict:
        d = job.data
        return {"id": rid, "object": "response", "created_at": created, "status": status,
                "background": False, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": d.get("instructions"), "max_output_tokens": d.get("max_output_tokens"),
                "max_tool_calls": None, "metadata": d.get("metadata") or {}, "model": job.model,
                "output": output, "parallel_tool_calls": d.get("parallel_tool_calls", True),
                "previous_response_id": None, "reasoning": None, "service_tier": "auto", "store": False,
                "temperature": d.get("temperature", 1.0), "text": {"format": {"type": "text"}},
                "tool_choice": d.get("tool_choice", "auto"), "tools": d.get("tools") or [],
                "top_logprobs": 0, "top_p": d.get("top_p", 1.0), "truncation": "disabled",
                "usage": usage, "user": None}

    @staticmethod
    def message(item_id: str, text: str, status: str) -> dict[str, Any]:
        return {"type": "message", "id": item_id, "role": "assistant", "status": status,
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    def whole(self, job: Job, rid: str, created: int, results: list[Result], tok: tokenizer.Tokenizer) -> dict:
        toks, last = results[0]
        status = "incomplete" if last.finish_reason == "length" else "completed"
        output = [self.message("msg_" + uuid.uuid4().hex, tok.detokenize(toks), status)]
        return self.response(job, rid, created, status, output,
                             responses_usage(len(job.prompts[0]), last.num_cached_tokens, len(toks)))

    def events(self, job: Job, rid: str, created: int, tok: tokenizer.Tokenizer) -> Events:
        return _ResponsesEvents(self, job, rid, created, tok)


class _ResponsesEvents(Events):
    def __init__(self, api: Responses, job: Job, rid: str, created: int, tok: tokenizer.Tokenizer):
        self.api, self.job, self.rid, self.created, self.tok = api, job, rid, created, tok
        self.item_id = "msg_" + uuid.uuid4().hex
        self.seq = 0
        self.text: list[str] = []
        self.n_out = 0
        self.last: RequestOutput | None = None

    def _event(self, kind: str, **fields: Any) -> bytes:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(kind, obj)

    def head(self) -> list[bytes]:
        r = self.api.response(self.job, self.rid, self.created, "in_progress", [], None)
        return [self._event("response.created", response=r), self._event("response.in_progress", response=r)]

    def tokens(self, out: RequestOutput) -> list[bytes]:
        parts = []
        at = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        if self.last is None:
            parts.append(self._event("response.output_item.added", output_index=0,
                                     item={"type": "message", "id": self.item_id, "role": "assistant",
                                           "status": "in_progress", "content": []}))
            parts.append(self._event("response.content_part.added", **at,
                                     part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        self.last = out
        delta = self.tok.detokenize(out.new_token_ids)
        self.text.append(delta)
        self.n_out += len(out.new_token_ids)
        parts.append(self._event("response.output_text.delta", **at, delta=delta, logprobs=[]))
        return parts

    def tail(self) -> list[bytes]:
        last = self.last
        assert last is not None  # an engine request outputs at least one token
        text = "".join(self.text)
        status = "incomplete" if last.finish_reason == "length" else "completed"
        at = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        item = self.api.message(self.item_id, text, status)
        usage = responses_usage(len(self.job.prompts[0]), last.num_cached_tokens, self.n_out)
        return [self._event("response.output_text.done", **at, text=text, logprobs=[]),
                self._event("response.content_part.done", **at, part=item["content"][0]),
                self._event("response.output_item.done", output_index=0, item=item),
                self._event("response.completed",
                            response=self.api.response(self.job, self.rid, self.created, status, [item], usage))]


RESPONSES = Responses()

# --- Anthropic Messages ---------------------------------------------------------------

_ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                          529: "overloaded_error"}


def _block_text(block: Any, loc: str) -> str:
    """The text a Messages content block contributes to the rendered prompt."""
    if not isinstance(block, dict):
        raise BadRequest(f"{loc}: Input should be a valid dictionary", loc)
    kind = block.get("type")
    if kind == "text" and isinstance(block.get("text"), str):
        return block["text"]
    if kind == "tool_use":
        return orjson.dumps({"name": block.get("name"), "input": block.get("input")}).decode()
    if kind == "tool_result":
        return content_text(block.get("content"))
    if kind in ("image", "document"):
        return "<image>"
    if kind in ("thinking", "redacted_thinking"):
        return ""
    raise BadRequest(f"{loc}: a content block must be text, image, document, tool_use, tool_result or "
                     "thinking", loc)


def messages_chat(data: dict[str, Any]) -> list[dict[str, Any]]:
    """A Messages request's ``system`` and ``messages`` as chat messages (for
    :func:`render_chat`); a content block list becomes its texts joined by newlines.
    Raises :class:`BadRequest` (``param``: the field's path)."""
    msgs: list[dict[str, Any]] = []
    system = data.get("system")
    if isinstance(system, str):
        msgs.append({"role": "system", "content": system})
    elif isinstance(system, list):
        msgs.append({"role": "system", "content": "\n".join(_block_text(b, f"system.{i}")
                                                            for i, b in enumerate(system))})
    elif system is not None:
        raise BadRequest("system: Input should be a valid string or a list of text blocks", "system")
    ms = data.get("messages")
    if not isinstance(ms, list) or not ms:
        raise BadRequest("messages: Field required (a non-empty list of messages)", "messages")
    for i, m in enumerate(ms):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise BadRequest(f"messages.{i}.role: Input should be 'user' or 'assistant'", f"messages.{i}.role")
        c = m.get("content")
        if isinstance(c, list):
            c = "\n".join(_block_text(b, f"messages.{i}.content.{j}") for j, b in enumerate(c))
        elif not isinstance(c, str):
            raise BadRequest(f"messages.{i}.content: Input should be a valid string or a list of content blocks",
                             f"messages.{i}.content")
        msgs.append({"role": m["role"], "content": c})
    return msgs


def messages_usage(prompt: int, cached: int, output: int) -> dict[str, Any]:
    """Anthropic's usage: ``input_tokens`` counts the prompt tokens not read from the
    cache (as Anthropic and llama.cpp count them), ``cache_read_input_tokens`` the others."""
    return {"input_tokens": prompt - cached, "output_tokens": output, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0}


def stop_reason(out: RequestOutput) -> str:
    return "max_tokens" if out.finish_reason == "length" else "end_turn"


class Messages(Api):
    """Anthropic Messages (``POST /v1/messages``) as llama.cpp and SGLang serve it, and
    ``POST /v1/messages/count_tokens`` (:meth:`count_tokens`)."""

    id_prefix = "msg_"

    def prompt(self, data: dict[str, Any], tok: tokenizer.Tokenizer) -> tuple[list[int], str]:
        """The prompt's token ids and text. A last message of the assistant is the start
        of the answer, which the model continues (Anthropic's prefill; llama.cpp's
        default): rendered open-ended, as a chat's ``continue_final_message``."""
        msgs = messages_chat(data)
        open_ended = msgs[-1]["role"] == "assistant"
        chat = {"messages": msgs, "tools": data.get("tools"), "add_generation_prompt": not open_ended,
                "continue_final_message": open_ended}
        ids, text = read_prompt(chat, True, tok)
        assert text is not None  # a chat's prompt is text
        return ids, text

    def parse(self, data: dict[str, Any], tok: tokenizer.Tokenizer) -> Job:
        ids, text = self.prompt(data, tok)
        if data.get("max_tokens") is None:
            raise BadRequest("max_tokens: Field required", "max_tokens")
        return Job(data["model"], data, [ids], optional_positive_int(data, "max_tokens"), stream_flag(data), text)

    def count_tokens(self, data: dict[str, Any], tok: tokenizer.Tokenizer) -> dict[str, Any]:
        return {"input_tokens": len(self.prompt(data, tok)[0])}

    def whole(self, job: Job, rid: str, created: int, results: list[Result], tok: tokenizer.Tokenizer) -> dict:
        toks, last = results[0]
        return {"id": rid, "type": "message", "role": "assistant", "model": job.model,
                "content": [{"type": "text", "text": tok.detokenize(toks)}], "stop_reason": stop_reason(last),
                "stop_sequence": None, "usage": messages_usage(len(job.prompts[0]), last.num_cached_tokens, len(toks))}

    def events(self, job: Job, rid: str, created: int, tok: tokenizer.Tokenizer) -> Events:
        return _MessagesEvents(job, rid, tok)

    def error(self, e: BadRequest) -> web.Response:
        """``{"type": "error", "error": {"type", "message"}}``, the type by status as
        Anthropic's API gives it."""
        etype = _ANTHROPIC_ERROR_TYPES.get(e.status, "api_error")
        body = {"type": "error", "error": {"type": etype, "message": str(e)}}
        return web.json_response(body, status=e.status, headers=e.headers, dumps=dumps)


class _MessagesEvents(Events):
    """``message_start`` (its usage: the prompt, cached tokens known) and
    ``content_block_start`` come with the first token, as llama.cpp sends them."""

    def __init__(self, job: Job, rid: str, tok: tokenizer.Tokenizer):
        self.job, self.rid, self.tok = job, rid, tok
        self.n_out = 0
        self.last: RequestOutput | None = None

    def tokens(self, out: RequestOutput) -> list[bytes]:
        parts = []
        if self.last is None:
            usage = messages_usage(len(self.job.prompts[0]), out.num_cached_tokens, 0)
            parts.append(sse("message_start", {"type": "message_start", "message": {
                "id": self.rid, "type": "message", "role": "assistant", "model": self.job.model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": usage}}))
            parts.append(sse("content_block_start", {"type": "content_block_start", "index": 0,
                                                     "content_block": {"type": "text", "text": ""}}))
        self.last = out
        self.n_out += len(out.new_token_ids)
        parts.append(sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {
            "type": "text_delta", "text": self.tok.detokenize(out.new_token_ids)}}))
        return parts

    def tail(self) -> list[bytes]:
        assert self.last is not None  # an engine request outputs at least one token
        return [sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
                sse("message_delta", {"type": "message_delta", "delta": {
                    "stop_reason": stop_reason(self.last), "stop_sequence": None},
                    "usage": {"output_tokens": self.n_out}}),
                sse("message_stop", {"type": "message_stop"})]


MESSAGES = Messages()

# --- pooling: embeddings ----------------------------------------------------------------

EMBEDDING_DIM = 16  # length of an embedding when the request gives no ``dimensions``
MAX_EMBEDDING_DIM = 4096


def pooling_inputs(value: Any, param: str, tok: tokenizer.Tokenizer) -> list[list[int]]:
    """Token ids of each input of a pooling request: a string, a list of strings, a
    list of token ids or a list of such lists (checked as vLLM checks token ids).
    Raises :class:`BadRequest`."""
    if isinstance(value, str):
        return [tok.tokenize(value)]
    if isinstance(value, list) and value:
        if all(isinstance(x, str) for x in value):
            return [tok.tokenize(x) for x in value]
        if all(isinstance(x, list) and x for x in value):
            return [check_token_ids(x, f"body.{param}.{i}", tok.vocab_size) for i, x in enumerate(value)]
        if isinstance(value[0], (int, float)):
            return [check_token_ids(value, f"body.{param}", tok.vocab_size)]
    raise BadRequest(f"`{param}` must be a string, a list of strings, a list of token ids or a list of "
                     "non-empty lists of token ids", param)


def _unit_vector(ids: list[int], dim: int, salt: bytes = b"") -> list[float]:
    """A unit vector of ``dim`` floats derived from the token ids alone, the same in
    every run and process."""
    seed = hashlib.blake2b(salt + array("I", ids).tobytes(), digest_size=8).digest()
    rng = random.Random(int.from_bytes(seed, "little"))
    v = [rng.gauss(0.0, 1.0) for _ in range(dim)]
    norm = math.sqrt(sum(x * x for x in v)) or 1.0
    return [x / norm for x in v]


def pooling_usage(results: list[Result], prompts: list[list[int]]) -> dict[str, Any]:
    """vLLM's usage of a pooling answer (prompt tokens only) plus, as for completions,
    the prompt tokens read from the prefix cache."""
    n = sum(len(p) for p in prompts)
    return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0,
            "prompt_tokens_details": {"cached_tokens": sum(last.num_cached_tokens for _, last in results)}}


class Embeddings(Api):
    """``POST /v1/embeddings`` as vLLM serves a pooling model: ``input`` (see
    :func:`pooling_inputs`), ``encoding_format`` ``float`` (default) or ``base64``
    (little-endian float32, as OpenAI sends it), ``dimensions`` (default
    :data:`EMBEDDING_DIM`). Each input is one prefill-only engine request; its vector
    is a unit vector derived from its token ids."""

    id_prefix = "embd-"
    pooling = True

    def parse(self, data: dict[str, Any], tok: tokenizer.Tokenizer) -> Job:
        if data.get("encoding_format", "float") not in ("float", "base64", None):
            raise BadRequest("`encoding_format` must be float or base64", "encoding_format")
        dim = optional_positive_int(data, "dimensions")
        if dim is not None and dim > MAX_EMBEDDING_DIM:
            raise BadRequest(f"`dimensions` must be at most {MAX_EMBEDDING_DIM}", "dimensions")
        return Job(data["model"], data, pooling_inputs(data.get("input"), "input", tok), None, False)

    def whole(self, job: Job, rid: str, created: int, results: list[Result], tok: tokenizer.Tokenizer) -> dict:
        dim = job.data.get("dimensions") or EMBEDDING_DIM
        b64 = job.data.get("encoding_format") == "base64"
        data = []
        for i, ids in enumerate(job.prompts):
            f32 = struct.pack(f"<{dim}f", *_unit_vector(ids, dim))  # float32, as a model outputs
            emb: Any = base64.b64encode(f32).decode() if b64 else list(struct.unpack(f"<{dim}f", f32))
            data.append({"object": "embedding", "index": i, "embedding": emb})
        return {"id": rid, "object": "list", "created": created, "model": job.model, "data": data,
                "usage": pooling_usage(results, job.prompts)}


EMBEDDINGS = Embeddings()

# --- pooling: rerank and score -------------------------------------------------------


def relevance(ids: list[int]) -> float:
    """A score in (0, 1) derived from a pair's token ids alone, the same in every run."""
    h = hashlib.blake2b(b"score" + array("I", ids).tobytes(), digest_size=8).digest()
    return (int.from_bytes(h, "little") + 0.5) / 2.0**64


def pair_ids(tok: tokenizer.Tokenizer, first: str, second: str) -> list[int]:
    """The token ids of a cross-encoder's (query, document) pair: the first text, then
    the second, so the pairs of one query share its prefix blocks."""
    return tok.tokenize(first) + tok.tokenize(second, add_special_tokens=False)


class Rerank(Api):
    """``POST /v1/rerank`` and ``POST /rerank`` (vLLM's Jina/Cohere-style rerank):
    ``query``, ``documents`` (strings or ``{"text"}`` objects), ``top_n`` (0 or absent:
    all). Each (query, document) pair is one prefill-only engine request; the answer
    ``{"id", "model", "usage": {"total_tokens"}, "results": [{"index", "document":
    {"text"}, "relevance_score"}]}`` lists the documents by descending score."""

    id_prefix = "rerank-"
    pooling = True

    def parse(self, data: dict[str, Any], tok: tokenizer.Tokenizer) -> Job:
        q = data.get("query")
        if not isinstance(q, str):
            raise BadRequest("`query` must be a string", "query")
        docs = data.get("documents")
        if not isinstance(docs, list) or not docs:
            raise BadRequest("`documents` must be a non-empty list", "documents")
        texts = []
        for i, d in enumerate(docs):
            if isinstance(d, dict):
                d = d.get("text")
            if not isinstance(d, str):
                raise BadRequest("a document must be a string or {\"text\": string}", f"documents.{i}")
            texts.append(d)
        top_n = data.get("top_n")
        if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0):
            raise BadRequest("`top_n` must be an integer >= 0", "top_n")
        return Job(data["model"], {**data, "documents": texts}, [pair_ids(tok, q, d) for d in texts], None, False)

    def whole(self, job: Job, rid: str, created: int, results: list[Result], tok: tokenizer.Tokenizer) -> dict:
        docs = job.data["documents"]
        scores = [relevance(ids) for ids in job.prompts]
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        ranked = [{"index": i, "document": {"text": docs[i]}, "relevance_score": scores[i]} for i in order]
        top_n = job.data.get("top_n") or len(ranked)
        usage = pooling_usage(results, job.prompts)
        return {"id": rid, "model": job.model, "results": ranked[:top_n],
                "usage": {"total_tokens": usage["total_tokens"],
                          "prompt_tokens_details": usage["prompt_tokens_details"]}}


def _texts(v: Any, param: str) -> list[str]:
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and v and all(isinstance(x, str) for x in v):
        return v
    raise BadRequest(f"`{param}` must be a string or a non-empty list of strings", param)


class Score(Api):
    """``POST /v1/score`` (vLLM): ``text_1`` and ``text_2``, each a string or a list of
    strings, paired 1:1, 1:N or N:N. Each pair is one prefill-only engine request; the
    answer is ``{"id", "object": "list", "created", "model", "data": [{"index",
    "object": "score", "score"}], "usage"}``."""

    id_prefix = "score-"
    pooling = True

    def parse(self, data: dict[str, Any], tok: tokenizer.Tokenizer) -> Job:
        t1, t2 = _texts(data.get("text_1"), "text_1"), _texts(data.get("text_2"), "text_2")
        if len(t1) == 1:
            t1 = t1 * len(t2)
        elif len(t1) != len(t2):
            raise BadRequest("Input lengths must be either 1:1, 1:N or N:N", "text_1")
        return Job(data["model"], data, [pair_ids(tok, a, c) for a, c in zip(t1, t2, strict=True)], None, False)

    def whole(self, job: Job, rid: str, created: int, results: list[Result], tok: tokenizer.Tokenizer) -> dict:
        return {"id": rid, "object": "list", "created": created, "model": job.model,
                "data": [{"index": i, "object": "score", "score": relevance(ids)} for i, ids in enumerate(job.prompts)],
                "usage": pooling_usage(results, job.prompts)}


RERANK = Rerank()
SCORE = Score()

# The POST routes of these APIs (:meth:`loadtest.sim.server.SimBackend.app` adds them).
ROUTES: list[tuple[str, Api]] = [
    ("/v1/responses", RESPONSES),
    ("/v1/messages", MESSAGES),
    ("/v1/embeddings", EMBEDDINGS),
    ("/v1/rerank", RERANK),
    ("/rerank", RERANK),
    ("/v1/score", SCORE),
]
