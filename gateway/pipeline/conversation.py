"""Conversations the gateway keeps: the Responses API's stored responses.

An engine would keep a stored response in its own memory, so ``previous_response_id``
would work only on that instance and die with it. For an API whose adapter is
``stateful`` (:attr:`gateway.apis.base.Api.stateful`) the gateway keeps the
conversation instead, in the fleet's store (:mod:`gateway.store.responses`), under the
caller's key name:

- :func:`expand`, before the request is admitted: a turn naming its previous response
  gets that response's input and output put before its own input
  (:meth:`~gateway.apis.base.Api.expand`), so any backend can serve it (prefix
  affinity still sends it to the one holding its KV cache), and the engine is asked
  not to store it (``store: false``);
- :func:`keep`, once the turn was answered: its record (its whole input, the response
  and the session, :mod:`gateway.pipeline.session`) is stored unless the client said
  ``store: false``; a turn naming it continues its session.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import orjson

from gateway.errors import ClientError
from gateway.pipeline.context import RequestContext
from gateway.pipeline.openai_request import ParsedRequest, dumps_json, parse_request
from gateway.pipeline.session import started
from gateway.pipeline.stream_scan import TypedEventScan
from gateway.store.responses import StoreUnavailable

if TYPE_CHECKING:
    from gateway.runtime import GatewayState

log = logging.getLogger("gateway.pipeline")


def unavailable(e: StoreUnavailable) -> ClientError:
    """The 503 for a store that did not answer."""
    return ClientError(503, f"The response store is unavailable ({e}); try again shortly.", code="store_unavailable",
                       headers={"Retry-After": "1", "x-should-retry": "true"})


async def expand(state: GatewayState, parsed: ParsedRequest, owner: str) -> ParsedRequest:
    """``parsed`` as the engine gets it: with the turn its ``previous_response_id``
    names, kept for ``owner``, before its own input; ``store: false`` for the engine;
    its session is that turn's (:mod:`gateway.pipeline.session`), and a stored turn
    that continues none and names none starts one.
    Raises :class:`ClientError` 400 (an unknown or malformed previous response id,
    ``background``, which this gateway does not run) or 503 (the store did not answer)."""
    data = parsed.data
    if data.get("background"):
        raise ClientError(400, "`background` responses are not served by this gateway; send the request without "
                               "it (and stream it to see progress).", param="background", code="unsupported_parameter")
    previous = data.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str) or not previous:
            raise ClientError(400, "`previous_response_id` must be a non-empty string.", param="previous_response_id",
                              code="invalid_type")
        try:
            record = await state.responses.get(owner, previous)
        except StoreUnavailable as e:
            raise unavailable(e) from None
        if record is None:
            raise ClientError(400, f"Previous response with id '{previous}' not found.",
                              param="previous_response_id", code="previous_response_not_found")
        data = parsed.api.expand(data, record)
        chained = record.get("session")
        session = chained if isinstance(chained, str) and state.cfg.sessions.enabled else parsed.session
    else:
        session = parsed.session
        if session is None and state.cfg.sessions.enabled and data.get("store") is not False:
            session = started(owner)  # a conversation's first turn: its next ones continue its session
    expanded = parse_request(parsed.api, dumps_json({**data, "store": False}), data)
    expanded.session = session
    return expanded


def keep(state: GatewayState, ctx: RequestContext) -> None:
    """Store the answered turn ``ctx`` for its caller (unless it said ``store: false``,
    or its answer is not a response object), before the end of its answer goes out
    (:func:`gateway.pipeline.settlement.completed` calls it), so that a next turn never
    arrives before it. A store that fails is logged: the client has its answer; a next
    turn naming it gets a 400."""
    parsed = ctx.parsed
    if parsed.data.get("store") is False:
        return
    answer = _answer_object(ctx)
    if answer is None or not isinstance(answer.get("id"), str):
        return
    record = parsed.api.record(ctx.data or parsed.data, answer)
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
    if isinstance(scan, TypedEventScan) and scan.final is not None and scan.done:
        response = scan.final.get("response")
        return response if isinstance(response, dict) else None
    return None
