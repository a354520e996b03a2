"""Conversations the gateway keeps: the Responses API's stored responses and
conversations (OpenAI's Conversations API).

An engine would keep a stored response in its own memory, so ``previous_response_id``
would work only on that instance and die with it. For an API whose adapter is
``stateful`` (:attr:`gateway.apis.base.Api.stateful`) the gateway keeps the
conversation instead, in the fleet's store (:mod:`gateway.store.responses`), under the
caller's key name:

- :func:`expand`, before the request is admitted: a turn naming its previous response
  gets that response's input and output put before its own input, a turn naming a
  conversation that conversation's items (:meth:`~gateway.apis.base.Api.expand`), so
  any backend can serve it (prefix affinity still sends it to the one holding its KV
  cache), and the engine is asked not to store it (``store: false``);
- :func:`keep`, once the turn was answered: its record (its whole input, the response
  and the session, :mod:`gateway.pipeline.session`) is stored unless the client said
  ``store: false``, and its input and output items are appended to its conversation;
  a turn naming it, or the conversation, continues its session.
"""

from __future__ import annotations

import logging
import secrets
from typing import TYPE_CHECKING, Any

import orjson

from gateway.errors import ClientError
from gateway.pipeline.context import RequestContext
from gateway.pipeline.migration import Splice
from gateway.pipeline.openai_request import ParsedRequest, dumps_json, parse_request
from gateway.pipeline.session import of_conversation, started
from gateway.pipeline.stream_scan import TypedEventScan
from gateway.store.responses import StoreUnavailable

if TYPE_CHECKING:
    from gateway.runtime import GatewayState

log = logging.getLogger("gateway.pipeline")


def unavailable(e: StoreUnavailable) -> ClientError:
    """The 503 for a store that did not answer."""
    return ClientError(503, f"The response store is unavailable ({e}); try again shortly.", code="store_unavailable",
                       headers={"Retry-After": "1", "x-should-retry": "true"})


def conversation_id(data: dict[str, Any]) -> str | None:
    """The conversation request ``data`` names (``conversation``: an id, or an object
    with its ``id``), or ``None``. Raises :class:`ClientError` 400 when malformed."""
    conv = data.get("conversation")
    if conv is None:
        return None
    cid = conv.get("id") if isinstance(conv, dict) else conv
    if not isinstance(cid, str) or not cid:
        raise ClientError(400, "`conversation` must be a conversation id or an object with its `id`.",
                          param="conversation", code="invalid_type")
    return cid


async def expand(state: GatewayState, parsed: ParsedRequest, owner: str) -> ParsedRequest:
    """``parsed`` as the engine gets it: with the turn its ``previous_response_id``
    names, or the items of the conversation its ``conversation`` names, kept for
    ``owner``, before its own input; ``store: false`` for the engine (not for an API
    that only counts tokens, which stores nothing); its session is that turn's or that
    conversation's (:mod:`gateway.pipeline.session`), and a stored turn that continues
    none and names none starts one.
    Raises :class:`ClientError` 400 (an unknown, unfinished or malformed previous
    response id, both it and a conversation), 404 (an unknown conversation) or 503 (the
    store did not answer)."""
    data, api = parsed.data, parsed.api
    previous = data.get("previous_response_id")
    cid = conversation_id(data)
    sessions = state.cfg.sessions.enabled
    turn = None
    try:
        if previous is not None:
            if not isinstance(previous, str) or not previous:
                raise ClientError(400, "`previous_response_id` must be a non-empty string.",
                                  param="previous_response_id", code="invalid_type")
            if cid is not None:
                raise ClientError(400, "`previous_response_id` and `conversation` cannot be used together.",
                                  param="conversation", code="invalid_value")
            record = await state.responses.get(owner, previous)
            if record is None:
                raise ClientError(400, f"Previous response with id '{previous}' not found.",
                                  param="previous_response_id", code="previous_response_not_found")
            status = (record.get("response") or {}).get("status")
            if status in UNFINISHED:
                raise ClientError(400, f"Previous response with id '{previous}' is still {status}; wait for it to "
                                       "complete.", param="previous_response_id", code="previous_response_unfinished")
            data = api.expand(data, record)
            chained = record.get("session")
            session = chained if isinstance(chained, str) and sessions else parsed.session
        elif cid is not None:
            if await state.responses.conversation(owner, cid) is None:
                raise ClientError(404, f"Conversation with id '{cid}' not found.", param="conversation",
                                  code="conversation_not_found")
            items = await state.responses.items(owner, cid)
            data = api.expand(data, {"input": items})
            turn = (cid, len(items))
            session = of_conversation(owner, cid) if sessions else parsed.session
        else:
            session = parsed.session
            if session is None and sessions and data.get("store") is not False and not api.counts_tokens:
                session = started(owner)  # a conversation's first turn: its next ones continue its session
    except StoreUnavailable as e:
        raise unavailable(e) from None
    expanded = parse_request(api, dumps_json(data if api.counts_tokens else {**data, "store": False}), data)
    expanded.session, expanded.conversation = session, turn
    return expanded


UNFINISHED = ("queued", "in_progress")  # a background response's statuses before its end


def with_ids(items: list[Any]) -> list[Any]:
    """``items`` (input items) as a conversation keeps them: each with an ``id``
    (``msg_...`` for a message), a message's ``type`` and ``status`` set and its text
    content as a list of one text part (``input_text``, or ``output_text`` for the
    assistant's), as OpenAI lists a conversation's items."""
    out = []
    for item in items:
        if not isinstance(item, dict):
            continue
        item = dict(item)
        kind = item.setdefault("type", "message")
        if kind == "message":
            content = item.get("content")
            if isinstance(content, str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": content}]
            item.setdefault("status", "completed")
        if not isinstance(item.get("id"), str):
            item["id"] = ("msg_" if kind == "message" else "item_") + secrets.token_hex(16)
        out.append(item)
    return out


def keep(state: GatewayState, ctx: RequestContext) -> None:
    """Store the answered turn ``ctx`` for its caller (unless it said ``store: false``,
    or its answer is not a response object), and append its input and output items to
    the conversation it named, before the end of its answer goes out
    (:func:`gateway.pipeline.settlement.completed` calls it), so that a next turn never
    arrives before it. A store that fails is logged: the client has its answer; a next
    turn naming it gets a 400."""
    parsed = ctx.parsed
    if (parsed.conversation is None and parsed.data.get("store") is False) or parsed.api.counts_tokens:
        return  # nothing to keep
    answer = _answer_object(ctx)
    if answer is None or not isinstance(answer.get("id"), str):
        return
    record = parsed.api.record(ctx.data or parsed.data, answer)
    if parsed.conversation is not None:
        cid, prepended = parsed.conversation
        answer["conversation"] = {"id": cid}
        output = answer.get("output")
        turn = with_ids(record["input"][prepended:]) + (output if isinstance(output, list) else [])
        if not state.responses.append_items(ctx.key_name, cid, turn):
            log.warning("request %s: conversation %s not appended to: an item exceeds responses.max_record_bytes",
                        ctx.request_id, cid)
    if parsed.data.get("store") is False:
        return
    if parsed.session is not None:
        record["session"] = parsed.session
    if not state.responses.put(ctx.key_name, answer["id"], record):
        log.warning("request %s: response %s not stored: its record exceeds responses.max_record_bytes",
                    ctx.request_id, answer["id"])


def _answer_object(ctx: RequestContext) -> dict[str, Any] | None:
    """The answer's object: a whole answer's JSON, or the response a stream's last
    event carried."""
    if ctx.answer is not None:
        try:
            obj = orjson.loads(ctx.answer)
        except orjson.JSONDecodeError:
            return None
        return obj if isinstance(obj, dict) else None
    scan = ctx.scan
    final = scan.final if isinstance(scan, (TypedEventScan, Splice)) else None  # Splice: a continuation's
    if final is not None and scan is not None and scan.done:
        response = final.get("response")
        return response if isinstance(response, dict) else None
    return None
