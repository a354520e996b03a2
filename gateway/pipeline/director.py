"""A completion request's life, in the order it happens: :func:`handle`.

Both server stacks (the lean protocol of :mod:`gateway.server.fast_path` and the aiohttp
routes of :mod:`gateway.server.app`), the endpoint picker (:mod:`gateway.epp.picker`)
and the in-process batch consumers (:func:`collect`) call :func:`handle`, which reads
as the request's story, every step a call into a module named after it::

    authenticate -> parse -> (expand) -> admit -> [estimate -> plan -> [prefill leg] ->
        route -> attempt (retry) -> relay -> settle (keep)] for the model, then its fallbacks

- authenticate: :meth:`gateway.tenancy.keys.KeyRing.authenticate` (401);
- parse: :func:`parse` (:mod:`~gateway.pipeline.openai_request`; 400, 404, 413, 415);
- expand, for an API whose conversations the gateway keeps (Responses):
  :mod:`gateway.pipeline.conversation` (400, 404, 503; settlement keeps the answered
  turn); a background response is answered ``queued`` here and run by
  :mod:`gateway.pipeline.background`;
- admit: :class:`~gateway.pipeline.admit.Ticket` (the batch gate, the caller's limits,
  the admission queue; 429, 503), released once at the end;
- trace: with ``tracing`` on, ``ctx.trace`` (:class:`gateway.ops.tracing.RequestTrace`)
  is the request's span, told of each step by the step (``None``: tracing is off);
- estimate: :func:`gateway.pipeline.prompt.estimate` (the model's tokenizer, the
  decision core's estimate, the context-length check);
- plan: :meth:`routing.core.DecisionCore.plan` (single, or disaggregated);
- prefill leg: :func:`gateway.pipeline.prefill.leg`;
- route, attempt, retry: :func:`gateway.pipeline.attempt.with_retries` (the one retry
  executor, :class:`~gateway.pipeline.retry.Retrier`), each attempt made by
  ``ctx.send``; the attempt relays the answer (:mod:`~gateway.pipeline.relay`) and
  settles it (:mod:`~gateway.pipeline.settlement`);
- fallback: :func:`gateway.pipeline.fallback.take`;
- the error answer: :func:`gateway.pipeline.settlement.failed`.

One hook answers early: when a stream's head and first bytes arrive in one read, the
client is answered from inside the upstream connection's read callback, a loop turn
sooner (:class:`gateway.pipeline.relay.EarlyAnswer`, installed by
:func:`gateway.pipeline.attempt.run`); the story is the same, told from there.

Every :class:`ClientError` becomes an OpenAI error answer here and nowhere else. The
reservation taken by each route is released exactly once on every path (success,
failure, timeout, the client gone).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

import orjson

from gateway.apis.base import Api, reshape
from gateway.errors import REQUEST_ID_HEADER, ClientError, internal_error_answer
from gateway.ops import access_log
from gateway.pipeline import attempt, background, conversation, fallback, prefill, prompt, settlement
from gateway.pipeline.admit import Ticket
from gateway.pipeline.context import RequestContext, Send
from gateway.pipeline.downstream import ClientGone, CollectDownstream, Downstream
from gateway.pipeline.keepalive import close_comment
from gateway.pipeline.openai_request import (
    LARGE_BODY_BYTES,
    ParsedRequest,
    check_json_content_type,
    off_loop,
    parse_body,
)
from gateway.pipeline.retry import Retrier
from gateway.pipeline.session import session_of
from gateway.tenancy.keys import ANONYMOUS, Caller
from routing.core import UnknownModel

if TYPE_CHECKING:
    from gateway.runtime import GatewayState

log = logging.getLogger("gateway.pipeline")

PRIORITY_HEADER = "x-turbo-priority"  # "batch": a batch line, admitted by the batch gate


async def handle(state: GatewayState, api: Api, headers: Mapping[str, str],
                 body: bytes | Callable[[], Awaitable[bytes]], down: Downstream, arrival: float, request_id: str, *,
                 send: Send = attempt.run, subset: frozenset[str] | None = None, caller: Caller | None = None,
                 batch_owner: str | None = None, session: str | None = None) -> None:
    """Serve one request of ``api`` (its adapter, :mod:`gateway.apis`) whose head was
    read: ``headers`` (case-insensitive mapping), ``body`` the body bytes or a
    coroutine function reading them (raising :class:`ClientError` 400/413), arrived at
    loop time ``arrival``. Each attempt is made by ``send`` (the gateway's own
    :func:`~gateway.pipeline.attempt.run`, or the endpoint picker's hand-off to Envoy)
    on a backend in ``subset`` (names; ``None``: any). ``caller``: who the stack found
    the request is from when it authenticated it on the head already; ``batch_owner``:
    an in-process batch line's owner (no socket: under that key's limits and admission,
    then the batch gate, its usage counted under that name); ``session``: the session
    it is a turn of, named already (a background response's run). The answer, or the
    OpenAI error in ``api``'s shape, goes to ``down``. Raises ``CancelledError`` when the
    client left."""
    ticket, ctx, in_process = Ticket(), None, batch_owner is not None
    trace = state.tracer.request(api, headers, request_id) if state.tracer is not None else None
    try:
        if caller is None:  # 401
            caller = state.keyring.authenticate(headers) if batch_owner is None else state.keyring.named(batch_owner)
        parsed = await parse(state, api, headers, body, caller, in_process)  # 400, 404, 413, 415
        key_name = caller.name if batch_owner is None else batch_owner
        if session is not None:
            parsed.session = session
        if api.stateful:  # a Responses turn: its previous turns, from the fleet's store (400, 503)
            parsed = await conversation.expand(state, parsed, key_name)
            if parsed.data.get("background"):  # run by the gateway: queued now, polled later (400)
                background.check(parsed, in_process)
                return down.respond(200, background.start(state, parsed, key_name, request_id, handle),
                                    {"Content-Type": "application/json", REQUEST_ID_HEADER: request_id})
        # the batch class: the gateway's own lines, or a key granted it (auth.keys[].batch_priority)
        batch = state.batch_gate is not None and headers.get(PRIORITY_HEADER) == "batch" and caller.batch_priority
        admitting = ticket.admit(state, caller, parsed, batch, in_process, arrival)  # 429, 503
        arrival = await (admitting if trace is None else trace.admission(admitting, parsed, key_name))
        ring = state.keyring
        if ring.isolate:  # auth.cache_isolation: per_key
            isolate_cache(parsed, ring.cache_salt(key_name))
        ctx = RequestContext(down, parsed, request_id, arrival, send, parsed.model, parsed.data, body=parsed.body,
                             key_name=key_name, subset=subset, trace=trace,
                             route_details=ring.route_details_all or caller.route_details)
        t0 = state.loop.time()  # the retry budget counts from here
        tried = [parsed.model]
        if parsed.stream and down.keepalive:
            _await_first_event(state, ctx)
        try:
            while True:  # the requested model, then its fallbacks
                failure = await prompt.estimate(state, ctx)  # None, or a prompt too long for every backend
                if failure is None and api.counts_tokens and prompt.counted_here(state, ctx):  # from the tokenizer
                    return
                if failure is None:
                    assert ctx.request is not None
                    now = state.loop.time()
                    plan = state.core.plan(ctx.request, now, state.cfg.routing.long_prompt_tokens)
                    roles, remote = plan.roles, False
                    if plan.kind == "disaggregated" and not api.disaggregates:  # served whole, by any backend
                        roles = None
                    elif plan.kind == "disaggregated":
                        roles, remote = await prefill.leg(state, ctx)
                        now = state.loop.time()
                    # route -> attempt (ctx.send: relay, settle) -> retry elsewhere
                    failure = await attempt.with_retries(state, ctx, Retrier(state.retry, t0), roles, remote, now)
                if failure is None:  # answered (or a stream that failed after its first byte)
                    return
                if api.counts_tokens and prompt.estimated_here(state, ctx, failure):  # no backend counts it
                    return
                if not fallback.take(state, ctx, failure, tried, t0):
                    return await settlement.failed(state, ctx, *failure)
        finally:
            if ctx.keepalive is not None:
                _first_event_seen(ctx)
    except ClientError as e:
        if trace is not None:
            trace.refused(e.status, e.code)
        if not in_process:  # a batch line's refusal goes to its error file instead
            access_log.refused(request_id, api.name, e.status, e.code)
        if not down.started:
            down.respond(*reshaped(api, *e.answer(request_id)))
    except ClientGone:
        pass
    except Exception as e:
        if trace is not None:
            trace.crashed(e)
        if in_process:
            raise  # the batch consumer logs it and keeps the line pending
        log.exception("unhandled error on POST %s (request %s)", api.path, request_id)
        if not down.started:
            down.respond(*reshaped(api, *internal_error_answer(request_id)))
    finally:
        ticket.release(state, ctx)
        if trace is not None:
            trace.end()


async def parse(state: GatewayState, api: Api, headers: Mapping[str, str],
                body: bytes | Callable[[], Awaitable[bytes]], caller: Caller,
                in_process: bool = False) -> ParsedRequest:
    """Read and parse the request's body (JSON, the fields routing needs; unknown
    fields pass through; the engine-control fields ``caller`` may not set are held
    back), check that a backend serves its model and name its session
    (:mod:`gateway.pipeline.session`). Raises :class:`ClientError` 400,
    404, 413 or 415 (not 415 for ``in_process`` lines, whose content type the batch
    manager checked)."""
    if not in_process:
        check_json_content_type(headers.get("Content-Type"))
    if not isinstance(body, bytes):
        body = await body()
    if len(body) < LARGE_BODY_BYTES:  # the usual request: parsed at once, no coroutine to await
        parsed = parse_body(api, body, caller.held_back, state.keyring.strip)
    else:
        parsed = await off_loop(len(body), parse_body, api, body, caller.held_back, state.keyring.strip)
    check_model(state, parsed.model)
    parsed.session = session_of(state.cfg.sessions, api, parsed.data, headers, caller.name)
    return parsed


def isolate_cache(parsed: ParsedRequest, key_salt: str) -> None:
    """Keep ``parsed`` apart from every other key's prompts (``auth.cache_isolation:
    per_key``): its ``cache_salt`` becomes its key's salt, followed by the one the
    caller gave, if any (so a caller can split its own cache further, never join
    another key's); it seeds the prefix placement and is sent to the engine."""
    salt = key_salt if parsed.cache_salt is None else f"{key_salt}:{parsed.cache_salt}"
    parsed.data = {**parsed.data, "cache_salt": salt}
    parsed.body = orjson.dumps(parsed.data)
    parsed.cache_salt = salt


def reshaped(api: Api, status: int, body: bytes, headers: dict[str, str]) -> tuple[int, bytes, dict[str, str]]:
    """An error answer (status, OpenAI error body, headers) in ``api``'s shape."""
    return status, reshape(api, status, body), headers


def check_model(state: GatewayState, model: str) -> None:
    """Raises :class:`ClientError` 404 when no backend serves ``model``."""
    try:
        state.core.fleet.candidates(model)
    except UnknownModel as e:
        raise ClientError(404, str(e), param="model", code="model_not_found") from None


def _await_first_event(state: GatewayState, ctx: RequestContext) -> None:
    """A stream (to a client that may get comments) whose first event is long in
    coming gets keep-alive comments meanwhile (``streaming``;
    :mod:`gateway.pipeline.keepalive`)."""
    ka = state.cfg.streaming
    if ka.keepalive_after_s is not None:
        ctx.keepalive = state.keepalives
        ctx.keepalive.add(ctx, ka.keepalive_after_s, ka.keepalive_every_s)


def _first_event_seen(ctx: RequestContext) -> None:
    """No more keep-alive comments for ``ctx`` (registered with ``ctx.keepalive``): one
    still in flight is closed."""
    assert ctx.keepalive is not None
    task = ctx.keepalive.discard(ctx)
    if task is not None:
        close_comment(task)


async def collect(state: GatewayState, api: Api, body: bytes, request_id: str,
                  key_name: str = ANONYMOUS) -> tuple[int, dict[str, str], bytes]:
    """Serve one batch line in process (no socket): under the limits and admission of
    the key called ``key_name`` (the batch's owner), through the batch gate, its usage
    counted under that key. Returns the answer's status, headers and body."""
    down = CollectDownstream()
    await handle(state, api, {}, body, down, state.loop.time(), request_id, batch_owner=key_name)
    headers = dict(down.headers)
    headers.setdefault("x-request-id", request_id)
    return down.status, headers, down.body
