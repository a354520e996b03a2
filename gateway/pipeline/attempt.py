"""Attempts: route, send, wait for the head and the first body bytes under the
attempt's deadlines, hand the answer to the relay; retry a failure elsewhere.

:func:`with_retries` is the director's "route, attempt, retry" step: it routes the
request, makes one attempt with the request's :data:`~gateway.pipeline.context.Send`
(:func:`run`, the gateway's own; or the endpoint picker's hand-off), and after a
failure retries on another backend as the one retry executor
(:class:`~gateway.pipeline.retry.Retrier`) allows. :func:`run` is one attempt.

Everything up to the first byte sent to the client can still be retried elsewhere;
a failure raises an :class:`~gateway.errors.UpstreamError` (with ``ctx.down.started``
when bytes had already reached the client). After that, an eligible stream is continued
on another backend by the same loop (:mod:`~gateway.pipeline.migration`), any other
ends with an error event. The attempt's timeouts live in one typed
object, :class:`~gateway.pipeline.deadlines.Deadlines`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from msgspec.structs import replace

from gateway.apis.base import Api
from gateway.errors import REQUEST_ID_HEADER, ApiNotServed, BackendStatus, Disconnected, UpstreamError
from gateway.pipeline import engine_errors, migration, relay, settlement, token_continuation
from gateway.pipeline.context import Failure, RequestContext
from gateway.pipeline.deadlines import Deadlines
from gateway.pipeline.downstream import ClientGone
from gateway.pipeline.openai_request import request_usage
from gateway.pipeline.retry import Retrier, parse_retry_after
from gateway.request_ids import upstream_id
from gateway.upstream.client import BackendClient, header_value
from gateway.upstream.connection import Exchange as Upstream
from routing.core import BackendState, NoBackendAvailable, Reservation

if TYPE_CHECKING:
    from gateway.runtime import GatewayState

log = logging.getLogger("gateway.pipeline")

_MAX_ERROR_BODY_BYTES = 64 * 1024
_JSON_HEADERS = b"Content-Type: application/json\r\nAccept: application/json\r\n"
_STREAM_HEADERS = b"Content-Type: application/json\r\nAccept: text/event-stream\r\n"


async def with_retries(state: GatewayState, ctx: RequestContext, retrier: Retrier, roles: frozenset[str] | None,
                       remote_prefill: bool, now: float) -> Failure | None:
    """Route ``ctx`` on ``ctx.model`` (backends of ``roles``; ``remote_prefill``: the
    prompt's KV arrives by transfer) from loop time ``now``, attempt it with
    ``ctx.send`` and retry a failure on another backend while ``retrier`` allows (a
    canary that fails or cannot take it goes to the stable pool; a backend's
    ``Retry-After`` is waited for when no other can take it). Every attempt's
    reservation is released on every path (:func:`~gateway.pipeline.settlement.release`).
    Returns ``None`` once the client was answered (or its stream ended with an error
    event after the first byte), else the final failure: the last attempt's, or why no
    backend could be tried."""
    loop, core, m = state.loop, state.core, state.metrics
    req = ctx.request
    assert req is not None
    pools, stable_pools = core.canary_pools(ctx.model)
    excluded: set[str] = set()
    subset = _served_by(state, ctx) if state.api_support.unserved else req.subset
    if _api_unserved(ctx, subset):
        return ApiNotServed("", ctx.parsed.endpoint, ctx.model), None
    last: UpstreamError | None = None
    while True:
        if (roles, remote_prefill, pools) != (req.roles, req.remote_prefill, req.pools) or excluded or \
                subset is not req.subset:
            req = ctx.request = replace(req, roles=roles, remote_prefill=remote_prefill, pools=pools,
                                        exclude=frozenset(excluded), subset=subset)
        try:
            decision, reservation = core.route(req, now)
        except NoBackendAvailable as e:
            if stable_pools is not None:  # no canary backend can take it: the stable pool does
                pools, stable_pools = stable_pools, None
                m.child(m.canary_fallbacks, "no_canary_backend").inc()
                continue
            if e.retry_after_s is not None and retrier.may_wait(e.retry_after_s, now, e.breaker_open):
                await asyncio.sleep(e.retry_after_s)
                now = loop.time()
                continue
            if ctx.scan is not None and last is not None:  # no backend to continue the stream on: it ends
                await settlement.stream_failed(state, ctx, last)
                return None
            return (last, None) if last is not None else (None, e)
        backend = decision.backend
        if ctx.scan is not None and backend.name in excluded:  # a stream is continued on another backend only
            assert last is not None
            settlement.release(state, reservation)
            await settlement.stream_failed(state, ctx, last)
            return None
        m.child(m.decisions, decision.policy, decision.reason).inc()
        ctx.backend, ctx.decision = backend.name, decision
        ctx.attempts.append((backend.name, now, "started"))
        retrier.attempts += 1
        trace = ctx.trace
        try:
            client = state.clients[backend.name]
            if trace is not None:
                trace.attempt_began(decision, backend.spec.pool, now, ctx.model, client.pool.host, client.pool.port)
            if backend.needs_load(ctx.model):  # a LoRA adapter it may load on demand (rare: once per backend)
                await _load_adapter(state, ctx, backend, client)
            await ctx.send(state, ctx, client, reservation)
            return None
        except UpstreamError as err:
            if trace is not None:
                trace.attempt_ended(err)
            settlement.attempt_failed(state, backend, reservation, err)
            ctx.attempts[-1] = (backend.name, now, err.reason)
            if isinstance(err, ApiNotServed):  # from now on, no request of the API goes there
                mig = ctx.migration  # a token continuation's API is completions
                state.api_support.learn(mig.leg.name if mig is not None and mig.leg is not None
                                        else ctx.parsed.endpoint, backend.name)
                subset = _served_by(state, ctx)
                if _api_unserved(ctx, subset):
                    return ApiNotServed("", ctx.parsed.endpoint, ctx.model), None
            last, now = err, loop.time()
            delay = retrier.after_failure(err.retryable, now)
            # the backend's bytes already reached the client: continue the stream elsewhere, or end it
            if ctx.scan is not None and (delay is None or not migration.prepare(state, ctx, err, backend.name)):
                await settlement.stream_failed(state, ctx, err)
                return None
            if delay is None:
                return err, None
            excluded.add(backend.name)
            if stable_pools is not None:  # a canary failed: retry on the stable pool
                pools, stable_pools = stable_pools, None
                m.child(m.canary_fallbacks, err.reason).inc()
            m.child(m.retries, err.reason).inc()
            log.info("retrying request %s after %s from %s (attempt %d)", ctx.request_id, err.reason, backend.name,
                     len(ctx.attempts))
            await retrier.backoff(delay)
            now = loop.time()
        finally:
            settlement.release(state, reservation)
            if trace is not None:
                trace.attempt_ended()


def _served_by(state: GatewayState, ctx: RequestContext) -> frozenset[str] | None:
    """The backends ``ctx`` may go to: those of its model that serve its API
    (:mod:`gateway.apis.support`) within its subset hint; ``None``: any."""
    unserved = state.api_support.unserved_by(ctx.parsed.endpoint)
    if not unserved:
        return ctx.subset
    return frozenset(b.name for b in state.core.fleet.candidates(ctx.model)
                     if b.name not in unserved and (ctx.subset is None or b.name in ctx.subset))


def _api_unserved(ctx: RequestContext, subset: frozenset[str] | None) -> bool:
    """Whether ``subset`` (of :func:`_served_by`) is empty because no backend the
    request may go to serves its API (not because its subset hint was empty)."""
    return subset is not None and not subset and (ctx.subset is None or bool(ctx.subset))


async def _load_adapter(state: GatewayState, ctx: RequestContext, backend: BackendState,
                        client: BackendClient) -> None:
    """Load ``ctx.model``, a LoRA adapter, on ``backend`` before the attempt."""
    lora = state.cfg.models[ctx.model].lora
    timeout_s = next(b.lora.load_timeout_s for b in state.cfg.backends if b.name == backend.name)
    assert lora is not None
    await state.adapters.ensure(state.core, client, ctx.model, lora.path, timeout_s)


async def _raise_status(client: BackendClient, up: Upstream, api: Api) -> None:
    """Raise the answer ``up`` (status other than 200) to a request of ``api`` as
    :class:`BackendStatus`, with the start of its body; an engine's caller error is
    classified in OpenAI's terms (:func:`gateway.pipeline.engine_errors.classify`)."""
    try:
        body = await up.read(_MAX_ERROR_BODY_BYTES)
    except Disconnected:
        body = b""
    finally:
        up.finish()  # the caller may finish it again: a no-op
    ctype = up.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    openai = engine_errors.classify(up.status, body, api.name)
    if openai is None and _no_route(up.status, body):
        raise ApiNotServed(client.state.name, api.name, "")
    raise BackendStatus(client.state.name, up.status, body, ctype, parse_retry_after(up.headers.get("retry-after")),
                        openai)


def _no_route(status: int, body: bytes) -> bool:
    """An answer that says the path has no route: a 404 (FastAPI's ``{"detail": "Not
    Found"}``, llama.cpp's ``File Not Found``, aiohttp's ``404: Not Found``) not saying
    that the model or a resource is missing, or llama.cpp's 501 for an API it was not
    started for (``This server does not support embeddings. Start it with
    `--embeddings```; also reranking, and completions on an embedding server)."""
    low = body[:512].lower()
    if status == 501:
        return b"server does not support" in low
    return status == 404 and b"not found" in low and b"model" not in low


def _request_headers(client: BackendClient, request_id: str, stream: bool, trace: bytes = b"") -> bytes:
    """The attempt's own header lines: its own id (:func:`gateway.request_ids.upstream_id`,
    never the caller's as it is), the backend's key, if any, and ``trace``, the lines
    of its trace context (:attr:`gateway.ops.tracing.RequestTrace.propagation`)."""
    return (_STREAM_HEADERS if stream else _JSON_HEADERS) + b"%s: %s\r\n%s%s" % (
        REQUEST_ID_HEADER.encode(), header_value(upstream_id(request_id)), client.auth_line, trace)


async def run(state: GatewayState, ctx: RequestContext, client: BackendClient, reservation: Reservation) -> None:
    """Send ``ctx`` to ``client``'s backend and relay its answer to ``ctx.down``.

    Raises an :class:`~gateway.errors.UpstreamError` on failure, :class:`ClientGone`
    (or ``CancelledError``) when the client left; either way the upstream connection is
    closed at once, so the engine stops generating.
    """
    parsed = ctx.parsed
    name = client.state.name
    deadlines = Deadlines(name, client.timeouts, state.loop.time())
    early = relay.EarlyAnswer(state, ctx, reservation, deadlines) if parsed.stream and not ctx.down.may_wait else None
    body = ctx.body
    if parsed.stream and not parsed.include_usage:  # counted exactly; the relay withholds it from the client
        body = request_usage(body, ctx.data or parsed.data)
    if client.return_token_ids and parsed.stream:  # its engine streams token ids, for a continuation
        body = token_continuation.ask_token_ids(state, ctx, body)
    m = ctx.migration
    api = m.leg if m is not None and m.leg is not None else parsed.api  # a token continuation: completions
    up: Upstream | None = None
    try:
        headers = _request_headers(client, ctx.request_id, parsed.stream,
                                   ctx.trace.propagation if ctx.trace is not None else b"")
        up = await client.pool.request(api.path, headers, body, deadlines.first_byte_at, early,
                                       not parsed.stream, deadlines.first_byte_error)
        if up.status != 200:
            await _raise_status(client, up, api)
        if early is not None and early.opened:
            opened = early.opened[0]
            if isinstance(opened, BaseException):
                raise opened
            return await relay.stream(state, ctx, name, up, b"", reservation, deadlines, opened)
        if not parsed.stream or not up.headers.get("content-type", "").lower().startswith("text/event-stream"):
            if ctx.keepalive is not None:  # no comment may start while the whole answer arrives
                task = ctx.keepalive.discard(ctx)
                if task is not None:
                    await task
            if ctx.down.started:  # keep-alive comments went out: the answer must be a stream
                raise UpstreamError(name, f"backend {name} answered a streamed request with a whole response")
            return relay.whole(state, ctx, up, await up.read(), reservation)
        # a stream: wait for its first bytes before answering the client, so that
        # everything up to here can still be retried elsewhere
        chunk = await up.wait_first_body()
        if not chunk:
            raise Disconnected(name, f"backend {name} ended the stream without sending an event")
        return await relay.stream(state, ctx, name, up, chunk, reservation, deadlines)
    except (ClientGone, asyncio.CancelledError):
        settlement.client_left(state, ctx, name)
        raise
    finally:
        if early is not None:
            early.stop()
        if up is not None:
            up.finish()  # back to the pool when complete, else closed (the engine aborts)


async def fetch(client: BackendClient, api: Api, body: bytes, request_id: str, trace: bytes = b"") -> bytes:
    """Send a non-streamed request of ``api`` to ``client``'s backend and return the whole 200
    response body (the prefill leg of a disaggregated request); ``trace``: the header
    lines of its trace context. Raises an :class:`~gateway.errors.UpstreamError`."""
    deadlines = Deadlines(client.state.name, client.timeouts, client.pool.loop.time())
    up = await client.pool.request(api.path, _request_headers(client, request_id, False, trace), body,
                                   deadlines.first_byte_at, deadline_error=deadlines.first_byte_error)
    if up.status != 200:
        await _raise_status(client, up, api)
    try:
        return await up.read()
    finally:
        up.finish()
