"""Settlement: what happens when an attempt or a request ends, in one home.

An answered request counts its tokens, teaches the decision core (the backend's
outcome for its circuit breaker, the tokens it produced for the load model, ``usage``
for the token estimator) and releases its reservation; a failed attempt reports its
failure the same way, once, whichever leg it was (the decode or single leg, the prefill
leg); a request that failed for good gets its error answer. Every settling step of
every data plane is a call into this module:

| when | call | caller |
|---|---|---|
| the first byte goes to the client | :func:`first_byte` | the relay (from the read callback, :class:`~gateway.pipeline.relay.EarlyAnswer`, or its coroutine) |
| the answer ended | :func:`completed` (a Responses turn kept: :func:`gateway.pipeline.conversation.keep`), :func:`finish` | the relay |
| an attempt failed | :func:`attempt_failed` | the retry loop (:func:`~gateway.pipeline.attempt.with_retries`), the prefill leg, the endpoint picker |
| the client left | :func:`client_left` | the attempt, the endpoint picker |
| the request failed for good | :func:`failed`, :func:`stream_failed` | the director, the retry loop |
| the prefill leg succeeded | :func:`leg_completed` | :mod:`~gateway.pipeline.prefill` |
| Envoy relayed the answer | :func:`proxied_status`, :func:`proxied_end` | :mod:`gateway.epp.picker` |
| any exit | :func:`release` | the retry loop, the prefill leg, the endpoint picker |

A reservation's release is idempotent (:class:`routing.core.Reservation`), so
:func:`release`, the safety net, may follow any of them; the usage ledger gets one entry
per request (:func:`finish`). A request that ended before it completed (the client left,
its stream broke) is charged what it cost: its prompt and the completion tokens relayed
to the client (:func:`_charge_relayed`).
"""  # noqa: E501 - a table, one row a line

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from gateway.apis.base import reshape
from gateway.errors import (
    BACKEND_HEADER,
    REQUEST_ID_HEADER,
    BackendStatus,
    ConnectFailed,
    ConnectTimeout,
    UpstreamError,
    failure_answer,
    stream_error_body,
)
from gateway.ops import access_log
from gateway.pipeline import conversation, migration
from gateway.pipeline.context import RequestContext, ServedMetrics
from gateway.pipeline.downstream import ClientGone
from gateway.pipeline.stream_scan import StreamScan, whole_usage
from gateway.tenancy.usage_ledger import cost_nanos
from routing.core import BackendState, NoBackendAvailable, Reservation

if TYPE_CHECKING:
    from gateway.runtime import GatewayState

log = logging.getLogger("gateway.pipeline")


def _pool(state: GatewayState, ctx: RequestContext) -> str:
    b = state.core.fleet.backends.get(ctx.backend) if ctx.backend else None
    return b.spec.pool if b is not None else "none"


def served(state: GatewayState, ctx: RequestContext) -> ServedMetrics:
    """The metric children of the backend that answered ``ctx`` (cached per model,
    backend and API, made anew when a reload moved the backend to another pool)."""
    api = ctx.parsed.api.name
    key = (ctx.model, ctx.backend, api)
    pool = _pool(state, ctx)
    cache = state.served_metrics
    s = cache.get(key)
    if s is None or s.pool != pool:
        s = cache[key] = ServedMetrics(state.metrics, ctx.model, ctx.backend or "none", pool, api)
    ctx.served = s
    return s


def first_byte(state: GatewayState, ctx: RequestContext, reservation: Reservation | None, at: float,
               head: bytes = b"") -> None:
    """The answer's first byte goes to the client at loop time ``at``: the TTFT, and
    the backend's first token when the answer is a stream (``reservation`` given).
    ``head``: the answer's first bytes, when the caller has them (the trace reads the
    response's id from them)."""
    if reservation is not None:
        reservation.first_token(at)
    s = served(state, ctx)  # the answering backend is known from here on
    if ctx.ttft_s is not None:  # a continuation (gateway.pipeline.migration): the client's first byte went earlier
        return
    ttft = ctx.ttft_s = at - ctx.arrival
    s.ttft.observe(ttft)
    s.pool_ttft.observe(ttft)
    if ctx.trace is not None:
        ctx.trace.first_token(at, ttft, head)
        ctx.trace.exemplar(ttft, s.ttft, s.pool_ttft)


def completed(state: GatewayState, ctx: RequestContext, reservation: Reservation, usage: Any,
              events: int | StreamScan, whole: bool = False) -> None:
    """A response completed: count its tokens (``usage`` as the backend reported it,
    else ``events``, the streamed content events, or the stream's scan, whose events
    are then counted), teach the decision core and release the reservation. ``whole``:
    a non-streamed answer, whose timing says nothing about the backend's TTFT or ITL."""
    model = ctx.model
    s = ctx.served or served(state, ctx)
    completion: int | None = None
    prompt: int | None = None
    cached = 0
    if isinstance(usage, dict):
        m = ctx.migration  # a token continuation's usage is completions': migration.leg_api
        api = ctx.parsed.api if m is None or m.leg is None else m.leg
        pt, reported_cached, ct = api.counts(usage)
        if pt is not None:
            prompt = pt
            s.prompt_tokens.inc(pt)
        if ct is not None:
            completion = ct
        if reported_cached is not None:
            cached = reported_cached
            s.cached_tokens.inc(cached)
            if ctx.decision is not None:
                state.core.learn_cached(ctx.decision, prompt or 0, cached)
                predicted = ctx.decision.detail.get("matched_tokens", 0)
                s.predicted_cached_tokens.inc(predicted)
                s.reported_prompt_tokens.inc(prompt or 0)
                prefix_predicted, prefix_reported = s.prefix(ctx.decision.evidence)
                prefix_predicted.inc(predicted)
                prefix_reported.inc(cached)
    if completion is None:
        completion = (events if isinstance(events, int) else events.content_events) or None
    if completion:
        s.completion_tokens.inc(completion)
    est = ctx.estimate
    if est is not None:
        state.core.learn_usage(model, est.size_bytes, prompt, completion)
    now = state.loop.time()
    reservation.outcome(True, now)
    counted_prompt = max(int(prompt if prompt is not None else (est.prompt_tokens if est else 0)), 0)
    ctx.usage = (counted_prompt, min(cached, counted_prompt), max(completion or 0, 0))
    ctx.tokens = counted_prompt + (completion or 0)
    reservation.release(now, completion, whole)
    if ctx.parsed.api.stateful:  # a Responses turn: kept for the next one before its end goes out
        conversation.keep(state, ctx)


def _charge_relayed(ctx: RequestContext) -> None:
    """A request that reached a backend ended before it completed (the client left,
    its stream broke): count what it cost in ``ctx.usage`` and ``ctx.tokens`` (the
    ledger's entry, the per-key token limit): its prompt and the completion tokens
    relayed to the client, as the engine's ``usage`` says when the stream got that far,
    else one per content event relayed (the prompt: the estimate). A request that
    completed keeps its counts."""
    if ctx.usage is not None or not ctx.attempts:
        return
    scan = ctx.scan
    prompt = cached = completion = None
    if scan is not None and scan.usage is not None:
        prompt, cached, completion = migration.leg_api(ctx).counts(scan.usage)
    if prompt is None:
        prompt = ctx.estimate.prompt_tokens if ctx.estimate is not None else 0
    if completion is None:
        completion = scan.content_events if scan is not None else 0
    prompt, completion = max(int(prompt), 0), max(completion, 0)
    ctx.usage = (prompt, min(cached or 0, prompt), completion)
    ctx.tokens = prompt + completion


def proxied_status(state: GatewayState, ctx: RequestContext, backend: BackendState, reservation: Reservation,
                   status: int, retry_after_s: float | None = None) -> None:
    """A proxy (Envoy, behind the endpoint picker) relayed ``backend``'s answer with
    ``status`` other than 200 (0: none): the backend's outcome (its 4xx are not its
    faults), the reservation released, the backend kept out of routing for as long as
    it asked (``retry_after_s``, its ``Retry-After``), the failure and the request
    counted."""
    now = state.loop.time()
    reservation.outcome(status < 500 and status != 0, now)
    reservation.release(now)
    if retry_after_s is not None:
        state.core.cool_down(backend, now + retry_after_s)
    if status >= 500 or status == 0:
        state.metrics.child(state.metrics.upstream_errors, backend.name, "backend_status").inc()
    finish(state, ctx, status)


def proxied_end(state: GatewayState, ctx: RequestContext, reservation: Reservation, scan: StreamScan | None,
                whole: bytes | None) -> None:
    """A proxy relayed a 200 answer to its end: settle it with what its body showed
    (``scan``: a stream's scan; ``whole``: a whole answer's first bytes; neither when
    the proxy did not show the body)."""
    if scan is not None:
        completed(state, ctx, reservation, scan.usage, scan)
    else:
        if ctx.served is None:
            first_byte(state, ctx, None, state.loop.time())
        completed(state, ctx, reservation, whole_usage(whole, ctx.parsed.api) if whole else None, 0, whole=True)
    finish(state, ctx, 200)


def leg_completed(state: GatewayState, reservation: Reservation, tokens: int = 1) -> None:
    """A leg that is not the client's answer (the prefill leg) completed with
    ``tokens`` generated: its first token and its end are now, the backend succeeded."""
    end = state.loop.time()
    reservation.first_token(end)
    reservation.outcome(True, end)
    reservation.release(end, tokens)


def release(state: GatewayState, reservation: Reservation) -> None:
    """Release ``reservation`` now, whatever became of its attempt: the safety net every
    exit path calls (a release is idempotent, so an attempt that settled already is
    untouched)."""
    reservation.release(state.loop.time())


def attempt_failed(state: GatewayState, backend: BackendState, reservation: Reservation, err: UpstreamError) -> None:
    """One attempt on ``backend`` (a :class:`routing.core.BackendState`) failed with
    ``err``: the circuit breaker hears of it (a backend's 4xx answers and 429s are not
    its faults), the reservation is released, the failure counted, and the backend
    kept out of routing for as long as it asked (``Retry-After``) or, when it refused
    the connection, ``retries.failed_backend_cooldown_s``."""
    now = state.loop.time()
    reservation.outcome(isinstance(err, BackendStatus) and err.status < 500, now)
    reservation.release(now)
    m = state.metrics
    m.child(m.upstream_errors, backend.name, err.reason).inc()
    if err.retry_after_s is not None:
        state.core.cool_down(backend, now + err.retry_after_s)
    elif isinstance(err, (ConnectFailed, ConnectTimeout)):
        state.core.cool_down(backend, now + state.cfg.retries.failed_backend_cooldown_s)


def finish(state: GatewayState, ctx: RequestContext, status: int) -> None:
    """Count the request's final ``status`` (and its end-to-end time when 200), and its
    usage in the ledger (:mod:`gateway.tenancy.usage_ledger`) under its caller's key name."""
    if ctx.migration is not None:  # a stream continued elsewhere: every leg is charged
        migration.settle(ctx)
    account(state, ctx, status)
    if ctx.trace is not None:
        ctx.trace.finish(status, ctx.model, ctx.usage, ctx.fallback_reason)
    endpoint = ctx.parsed.api.name
    access_log.completion(ctx.request_id, endpoint, status, ctx.model or ctx.parsed.model, ctx.backend,
                          ctx.ttft_s, ctx.usage, state.loop.time() - ctx.arrival, len(ctx.attempts))
    m = state.metrics
    m.child(m.api_requests, endpoint, str(status)).inc()
    if status == 200:
        s = ctx.served or served(state, ctx)
        s.ok.inc()
        s.pool_ok.inc()
        e2e = state.loop.time() - ctx.arrival
        s.e2e.observe(e2e)
        if ctx.trace is not None:
            ctx.trace.exemplar(e2e, s.e2e)
        return
    m.child(m.requests, ctx.model or ctx.parsed.model, ctx.backend or "none", str(status)).inc()
    m.child(m.pool_requests, _pool(state, ctx), str(status)).inc()


def account(state: GatewayState, ctx: RequestContext, status: int) -> None:
    """The usage ledger's one entry for a settled request: its tokens (``ctx.usage``,
    set by :func:`completed`; none when it never completed), an error unless
    ``status`` is 200, its cost at ``usage.prices``; and the per-key token counters."""
    model = ctx.model or ctx.parsed.model
    prompt, cached, completion = ctx.usage or (0, 0, 0)
    price = state.cfg.usage.prices.get(model)
    state.usage.record(ctx.key_name, model, prompt, cached, completion, status != 200,
                       cost_nanos(price, prompt, cached, completion) if price is not None else 0)
    if ctx.usage is not None:
        m = state.metrics
        key = m.key_label(ctx.key_name)  # auth.metrics_key_labels: hashed by default
        s = ctx.served
        if s is not None and s.model == model:
            prompt_c, cached_c, completion_c = s.key_tokens(key)
        else:  # charged before any answer (the client left, the stream broke)
            prompt_c, cached_c, completion_c = (m.child(m.key_tokens, key, model, "prompt"),
                                                m.child(m.key_tokens, key, model, "cached_prompt"),
                                                m.child(m.key_tokens, key, model, "completion"))
        prompt_c.inc(prompt)
        cached_c.inc(cached)
        completion_c.inc(completion)


def client_left(state: GatewayState, ctx: RequestContext, backend: str) -> None:
    """The client went away during an attempt on ``backend`` (status 499); it is
    charged its prompt and what was relayed to it."""
    state.metrics.child(state.metrics.client_disconnects, backend).inc()
    _charge_relayed(ctx)
    finish(state, ctx, 499)


async def failed(state: GatewayState, ctx: RequestContext, err: UpstreamError | None,
                 no_backend: NoBackendAvailable | None = None) -> None:
    """The request failed for good before any backend byte reached the client: answer
    it with the last attempt's failure ``err``, or with ``no_backend`` when no backend
    could be tried (:func:`gateway.errors.failure_answer`). A stream whose head went
    out already (keep-alive comments) ends with that error body as its last event."""
    if err is not None:
        status, body, headers = failure_answer(err)
    else:
        assert no_backend is not None
        status, body, headers = failure_answer(None, str(no_backend), no_backend.retry_after_s)
    if ctx.down.started:
        reason = err.reason if err is not None else "no_backend_available"
        message = err.message if err is not None else str(no_backend)
        return await _end_stream(state, ctx, reason, status, message, ctx.parsed.api.error_event(status, body))
    headers[REQUEST_ID_HEADER] = ctx.request_id
    if ctx.backend:
        headers[BACKEND_HEADER] = ctx.backend
    finish(state, ctx, status)
    ctx.down.respond(status, reshape(ctx.parsed.api, status, body), headers)


async def stream_failed(state: GatewayState, ctx: RequestContext, err: UpstreamError) -> None:
    """A stream failed after its first event reached the client: end it with an error
    event (no ``[DONE]``), after the bytes withheld until then (a partial line, ended),
    and count it, charged its prompt and what was relayed."""
    scan = ctx.scan
    prefix = scan.flush() + b"\n\n" if scan is not None and scan.tail else b""
    _charge_relayed(ctx)
    await _end_stream(state, ctx, err.reason, err.status, err.message,
                      prefix + ctx.parsed.api.error_event(502, stream_error_body(err.message, err.reason)))


async def _end_stream(state: GatewayState, ctx: RequestContext, reason: str, status: int, message: str,
                      event: bytes) -> None:
    """End a stream whose head went out with the error ``event``; count it."""
    backend = ctx.backend or "none"
    state.metrics.child(state.metrics.stream_errors, backend, reason).inc()
    log.warning("stream %s from %s failed after its head went out: %s", ctx.request_id, backend, message)
    try:
        await ctx.down.end_stream(event)
    except ClientGone:
        pass
    finish(state, ctx, status)
