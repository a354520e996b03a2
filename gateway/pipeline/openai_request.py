"""Reading and validating request bodies (JSON objects; each API's fields are read
by its adapter, :mod:`gateway.apis`).

Validation is permissive by design (DESIGN.md section 1): the few fields the gateway
reads are checked, and every other field passes through to the backend untouched,
because the gateway forwards the original body bytes, never a re-serialization (a
stream's body gets ``stream_options.include_usage`` spliced in when the client did not
ask for it: :func:`request_usage`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.web_protocol import RequestPayloadError

from gateway.apis.base import Api
from gateway.errors import ClientError
from routing.core import ServedModel, canonical_prompt

T = TypeVar("T")


@dataclass(slots=True)
class ParsedRequest:
    """What the gateway reads from a request of one API (``api``, its adapter).

    ``body`` is the exact bytes received (forwarded as is) and ``data`` their parsed
    object (read-only: a copy is re-serialized only for the legs of a disaggregated
    request, which must carry ``kv_transfer_params``); ``prompt_text`` is the
    canonical prompt (:func:`routing.estimate.canonical_prompt`), for routing;
    ``cache_salt`` is vLLM's per-tenant prefix-cache salt when the caller sent one.
    ``max_tokens`` is the output-token cap (0: an API that generates nothing).
    ``session`` is the session it is a turn of, scoped by the caller's key
    (:mod:`gateway.pipeline.session`; ``None``: none). ``conversation``: for a turn of
    a conversation the gateway keeps (:mod:`gateway.pipeline.conversation`), its id
    and how many of its items were put before the turn's own input.
    """

    api: Api
    body: bytes
    data: dict[str, Any]
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    prompt_text: str
    cache_salt: str | None = None
    session: str | None = None
    conversation: tuple[str, int] | None = None

    @property
    def endpoint(self) -> str:
        """The API's name (``chat``, ``completions``, ``responses``...)."""
        return self.api.name


def _is_json_type(content_type: str) -> bool:
    ct = content_type.lower()
    return ct == "application/json" or (ct.startswith("application/") and ct.endswith("+json"))


UNREADABLE_BODY = (RequestPayloadError, ContentEncodingError)  # aiohttp: a body its Content-Encoding does not decode


def unreadable_body(request: web.Request, e: Exception) -> ClientError:
    """The 400 for a request body that cannot be read as its ``Content-Encoding``
    says (one of :data:`UNREADABLE_BODY`)."""
    enc = request.headers.get("Content-Encoding", "identity")
    return ClientError(400, f"The request body could not be read (Content-Encoding: {enc[:40]}): "
                            f"{getattr(e, 'message', None) or type(e).__name__}", code="invalid_body")


async def read_body(request: web.Request, max_bytes: int) -> bytes:
    """Read an aiohttp request's body. Raises :class:`ClientError` 413 (over
    ``max_bytes`` bytes) or 400 (not readable as its ``Content-Encoding`` says)."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise ClientError(413, f"Request body of {request.content_length} bytes exceeds the limit of {max_bytes} "
                          "bytes.", code="request_too_large")
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ClientError(413, f"Request body exceeds the limit of {max_bytes} bytes.",
                          code="request_too_large") from None
    except UNREADABLE_BODY as e:
        raise unreadable_body(request, e) from None
    if len(body) > max_bytes:
        raise ClientError(413, f"Request body exceeds the limit of {max_bytes} bytes.", code="request_too_large")
    return body


def check_json_content_type(content_type: str | None) -> None:
    """Raises :class:`ClientError` 415 unless ``content_type`` (the header value, or
    ``None`` when absent) is JSON (``application/json`` or ``application/*+json``)."""
    if content_type == "application/json":
        return
    if content_type:
        mime = content_type.split(";", 1)[0].strip().lower()
        if not _is_json_type(mime):
            raise ClientError(415, f"Unsupported content type `{mime}`; send `Content-Type: application/json`.",
                              code="unsupported_media_type")


LARGE_BODY_BYTES = 1 << 20  # parsed and estimated off the event loop from this size on


async def off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, in the loop's default executor when it works on ``size`` bytes of
    at least :data:`LARGE_BODY_BYTES` (a long prompt's parse or estimate would stall
    every other request meanwhile), else at once."""
    if size < LARGE_BODY_BYTES:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def parse_body(api: Api, body: bytes, held: frozenset[str] = frozenset(), strip: bool = False) -> ParsedRequest:
    """``body`` parsed and validated as a request of ``api`` (:func:`parse_json_object`,
    :func:`parse_request`, ``held`` and ``strip`` as there)."""
    return parse_request(api, body, parse_json_object(body), held, strip)


def parse_json_object(body: bytes) -> dict[str, Any]:
    """``body`` parsed as a JSON object. Integers beyond 64 bits, valid JSON that
    orjson refuses, are parsed by the standard library instead. Raises
    :class:`ClientError` 400 (malformed JSON, not an object)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        if "64-bit" not in str(e):
            raise ClientError(400, f"We could not parse the JSON body of your request: {e}",
                              code="invalid_json") from None
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as e2:
            raise ClientError(400, f"We could not parse the JSON body of your request: {e2}",
                              code="invalid_json") from None
    if not isinstance(data, dict):
        raise ClientError(400, "The request body must be a JSON object.", code="invalid_json")
    return data


def hold_back(body: bytes, data: dict[str, Any], held: frozenset[str], strip: bool) -> tuple[bytes, dict[str, Any]]:
    """The request ``body`` (parsed: ``data``) without the engine-control fields in
    ``held`` (``limits.engine_fields`` less the caller's grants): unchanged when it
    carries none (one pass over its top-level keys), else with them removed when
    ``strip``. Raises :class:`ClientError` 400 naming the first such field otherwise."""
    if held.isdisjoint(data):
        return body, data
    found = [k for k in data if k in held]
    if not strip:
        raise ClientError(400, f"`{found[0]}` steers the engine and only the gateway may set it; remove it from the "
                               "request.", param=found[0], code="unsupported_parameter")
    data = {k: v for k, v in data.items() if k not in held}
    return orjson.dumps(data), data


def parse_request(api: Api, body: bytes, data: dict[str, Any], held: frozenset[str] = frozenset(),
                  strip: bool = False) -> ParsedRequest:
    """Validate the fields the gateway reads from a request of ``api`` (its adapter's
    :meth:`~gateway.apis.base.Api.read`). ``held`` and ``strip``: the engine-control
    fields the caller may not set, and what to do with them (:func:`hold_back`).

    Raises :class:`ClientError` 400 naming the offending field.
    """
    if held and not held.isdisjoint(data):
        body, data = hold_back(body, data, held, strip)
    if api.variants:  # an API whose requests come in more than one form (tokenize: a prompt, or messages)
        api = api.variant(data)
    model, stream, include_usage, max_tokens = api.read(data)
    salt = data.get("cache_salt")
    return ParsedRequest(api, body, data, model, stream, include_usage, max_tokens,
                         canonical_prompt(api.prompt_kind, api.view(data)), salt if isinstance(salt, str) else None)


_ASK_USAGE = b'"stream_options":{"include_usage":true},'


def request_usage(body: bytes, data: dict[str, Any]) -> bytes:
    """The streamed request ``body`` (a JSON object; ``data``: its fields, or those of
    the object it was serialized from) asking the engine for the final usage chunk
    (``stream_options.include_usage``) that the client did not ask for. A body without
    ``stream_options`` gets it by one splice, the body bytes otherwise forwarded as
    they are; one with other stream options is re-serialized with ``include_usage``
    set and ``continuous_usage_stats`` (vLLM's usage in every chunk) removed."""
    if "stream_options" not in data:
        i = body.find(b"{") + 1
        return body[:i] + _ASK_USAGE + body[i:]
    obj = parse_json_object(body)
    opts = obj.get("stream_options")
    opts = {k: v for k, v in opts.items() if k != "continuous_usage_stats"} if isinstance(opts, dict) else {}
    obj["stream_options"] = {**opts, "include_usage": True}
    return dumps_json(obj)


def dumps_json(obj: dict[str, Any]) -> bytes:
    """``obj`` as compact JSON bytes; an integer beyond 64 bits (which orjson does not
    write, though a request may carry one) by the standard library."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def prompt_token_ids(data: dict[str, Any]) -> list[int] | None:
    """A completions request's prompt when it is given as token ids (one flat array
    of ints in ``[0, 2**32)``, the OpenAI ``prompt`` form an engine takes as is), else
    ``None``: the token ids the engine will see, with no tokenizer needed."""
    prompt = data.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return None
    for t in prompt:
        if type(t) is not int or not 0 <= t < 2**32:
            return None
    return prompt


def model_card(model: ServedModel, created: int) -> dict[str, Any]:
    """One model of ``GET /v1/models`` (OpenAI's fields, and vLLM's ``parent`` (the
    base model of a LoRA adapter) and ``max_model_len`` (tokens) when known)."""
    card: dict[str, Any] = {"id": model.name, "object": "model", "created": created, "owned_by": "turbo-gateway"}
    if model.parent is not None:
        card["parent"] = model.parent
    if model.max_model_len is not None:
        card["max_model_len"] = model.max_model_len
    return card


def models_list(models: list[ServedModel], created: int) -> dict[str, Any]:
    """The ``GET /v1/models`` body (OpenAI list format, cards of :func:`model_card`)."""
    return {"object": "list", "data": [model_card(m, created) for m in models]}
