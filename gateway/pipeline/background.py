"""Background responses (``background: true`` on ``POST /v1/responses``), run by the
gateway itself.

The client is answered at once with the response object in status ``queued``, under an
id the gateway gives (``resp_...``), kept in the fleet's store
(:mod:`gateway.store.responses`) under the caller's key name. The gateway then serves
the request in process, through the same front door as any (the director's ``handle``:
that key's limits and the admission queue, routing, retries, fallbacks, the usage
ledger), whole, as a batch line is served but at the caller's own priority; the runs of
this process are ``GatewayState.background``. Its record follows it: ``in_progress``
once it is sent to a backend, then the engine's response object (its id the gateway's)
once answered, or ``failed`` with the error, or ``cancelled``. ``GET
/v1/responses/{id}`` polls it from any replica.

``POST /v1/responses/{id}/cancel`` (:func:`cancel`) cancels the run on this replica
(the engine's request is aborted, as when a client leaves), or, when another replica
runs it, marks it in the shared store, which that replica reads every
:data:`CANCEL_POLL_S`; a response that already ended is answered as it is. A replica
that stops marks the runs it had as ``failed``; one killed outright leaves them
``in_progress`` until their record expires.

Not served: ``background`` with ``stream: true`` (a stream to resume later) or with
``store: false``, and in a batch line (400).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson

from gateway.apis.base import error_message
from gateway.errors import ClientError
from gateway.pipeline import attempt
from gateway.pipeline.conversation import UNFINISHED, with_ids
from gateway.pipeline.downstream import CollectDownstream
from gateway.pipeline.openai_request import ParsedRequest, dumps_json
from gateway.store.responses import StoreUnavailable

if TYPE_CHECKING:
    from gateway.pipeline.context import RequestContext
    from gateway.runtime import GatewayState
    from gateway.upstream.client import BackendClient
    from routing.core import Reservation

log = logging.getLogger("gateway.pipeline")

CANCEL_POLL_S = 0.5  # how often a run reads the shared store for a cancel asked on another replica
_ECHOED = ("instructions", "max_output_tokens", "metadata", "temperature", "top_p", "tools", "tool_choice",
           "parallel_tool_calls", "text", "reasoning", "truncation", "user")


def check(parsed: ParsedRequest, in_process: bool) -> None:
    """Refuse a background request the gateway does not serve. Raises
    :class:`ClientError` 400."""
    data = parsed.data
    if in_process:
        raise ClientError(400, "`background` is not served in a batch line.", param="background",
                          code="unsupported_parameter")
    if data.get("background") is not True:
        raise ClientError(400, "`background` must be a boolean.", param="background", code="invalid_type")
    if parsed.stream:
        raise ClientError(400, "`background` with `stream: true` is not served by this gateway; create it without "
                               "`stream` and poll `GET /v1/responses/{id}`.", param="stream",
                          code="unsupported_parameter")
    if data.get("store") is False:
        raise ClientError(400, "`background` needs `store: true`: its response is only seen by polling it.",
                          param="store", code="invalid_value")


Run = Callable[..., Awaitable[None]]  # gateway.pipeline.director.handle, which runs a request


def start(state: GatewayState, parsed: ParsedRequest, owner: str, request_id: str, handle: Run) -> bytes:
    """Keep ``parsed`` (its previous turns expanded) as ``owner``'s queued response,
    start running it with ``handle`` (the director's) and return the queued response
    object (JSON). Raises :class:`ClientError` 400 (a request too large to keep)."""
    data = parsed.data
    rid = "resp_" + secrets.token_hex(24)
    response: dict[str, Any] = {
        "id": rid, "object": "response", "created_at": int(time.time()), "status": "queued", "background": True,
        "model": parsed.model, "output": [], "usage": None, "error": None, "incomplete_details": None,
        **{k: data[k] for k in _ECHOED if k in data}}
    if parsed.conversation is not None:
        response["conversation"] = {"id": parsed.conversation[0]}
    record: dict[str, Any] = {"input": parsed.api.record(data, response)["input"], "response": response}
    if parsed.session is not None:
        record["session"] = parsed.session
    if not state.responses.put(owner, rid, record):
        raise ClientError(400, "The request is larger than responses.max_record_bytes: it cannot be kept for "
                               "`background`.", param="background", code="invalid_value")
    key = (owner, rid)
    task = asyncio.ensure_future(_run(state, parsed, owner, rid, record, request_id, handle))
    state.background[key] = task
    task.add_done_callback(lambda t: state.background.pop(key, None) if state.background.get(key) is t else None)
    return orjson.dumps(response)


async def _run(state: GatewayState, parsed: ParsedRequest, owner: str, rid: str, record: dict[str, Any],
               request_id: str, handle: Run) -> None:
    body = {k: v for k, v in parsed.data.items() if k != "background"}
    body["store"], body["stream"] = False, False
    down = CollectDownstream()
    sent = False

    async def send(state: GatewayState, ctx: RequestContext, client: BackendClient, reservation: Reservation) -> None:
        nonlocal sent
        if not sent:
            sent = True
            _update(state, owner, rid, record, status="in_progress")
        await attempt.run(state, ctx, client, reservation)

    handled = asyncio.ensure_future(handle(
        state, parsed.api, {}, dumps_json(body), down, state.loop.time(), request_id, send=send,
        caller=state.keyring.named(owner), session=parsed.session))
    try:
        await _until_done_or_cancelled(state, handled, owner, rid)
    except asyncio.CancelledError:
        handled.cancel()
        await asyncio.gather(handled, return_exceptions=True)
        if (owner, rid) in state.background:  # cancelled by a client (stop() takes its runs out first)
            _update(state, owner, rid, record, status="cancelled")
        else:
            _update(state, owner, rid, record, status="failed", error={
                "code": "gateway_stopped", "message": "The gateway running this response stopped."})
        raise
    _finish(state, parsed, owner, rid, record, down)


async def _until_done_or_cancelled(state: GatewayState, handled: asyncio.Future[None], owner: str, rid: str) -> None:
    """Wait for ``handled``; with a shared store, read every :data:`CANCEL_POLL_S`
    whether another replica asked to cancel it (then raise ``CancelledError``)."""
    store = state.responses
    while True:
        done, _ = await asyncio.wait({handled}, timeout=CANCEL_POLL_S if store.shared else None)
        if done:
            handled.result()
            return
        try:
            asked = await store.cancel_asked(owner, rid)
        except StoreUnavailable:
            continue
        if asked:
            raise asyncio.CancelledError


def _finish(state: GatewayState, parsed: ParsedRequest, owner: str, rid: str, record: dict[str, Any],
            down: CollectDownstream) -> None:
    """Keep the run's answer (``down``) as its record: the engine's response under the
    gateway's id, or ``failed`` with the error; its items appended to its conversation."""
    answer: Any = None
    if down.status == 200:
        try:
            answer = orjson.loads(down.body)
        except orjson.JSONDecodeError:
            answer = None
    if not isinstance(answer, dict):
        message, code = error_message(down.body)
        _update(state, owner, rid, record, status="failed", error={
            "code": code or f"http_{down.status}", "message": message or "The response failed."})
        return
    done = {**record, "response": {**record["response"], **answer, "id": rid, "background": True}}
    if parsed.conversation is not None:
        cid, prepended = parsed.conversation
        output = answer.get("output")
        state.responses.append_items(owner, cid, with_ids(done["input"][prepended:]) +
                                     (output if isinstance(output, list) else []))
    if not state.responses.put(owner, rid, done):
        log.warning("background response %s not stored: its record exceeds responses.max_record_bytes", rid)
        _update(state, owner, rid, record, status="failed", error={
            "code": "record_too_large", "message": "The response exceeds responses.max_record_bytes."})


def _update(state: GatewayState, owner: str, rid: str, record: dict[str, Any], **fields: Any) -> None:
    """Rewrite ``record``'s response with ``fields`` (in place, and in the store)."""
    record["response"] = {**record["response"], **fields}
    state.responses.put(owner, rid, record)


async def cancel(state: GatewayState, owner: str, rid: str, record: dict[str, Any]) -> dict[str, Any]:
    """Cancel ``owner``'s background response ``rid`` (its stored ``record``) and return
    its response object: ``cancelled``, or as it is when it already ended."""
    response: dict[str, Any] = record.get("response") or {}
    if response.get("status") not in UNFINISHED:
        return response
    task = state.background.get((owner, rid))
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    else:  # another replica runs it: it reads the mark
        state.responses.ask_cancel(owner, rid)
    cancelled = record["response"] = {**response, "status": "cancelled"}
    state.responses.put(owner, rid, record)
    return cancelled


async def stop(state: GatewayState) -> None:
    """Cancel every run of this process, each marked ``failed`` (the gateway stops)."""
    runs = list(state.background.values())
    state.background.clear()  # taken out first: their runs see a stop, not a client's cancel
    for task in runs:
        task.cancel()
    if runs:
        await asyncio.gather(*runs, return_exceptions=True)
