"""A completion request's life, in the order it happens.

:func:`handle` is the front door that both server stacks (the lean protocol of
:mod:`gateway.server.listener` and the aiohttp routes of :mod:`gateway.server.app`) call: authenticate,
read and parse the body, admit the request (the batch gate, the caller's limits, the
admission queue) and hand it to :func:`forward`; every :class:`ClientError` becomes an
OpenAI error answer here and nowhere else. :func:`forward` carries it:

    [tokenize] -> estimate -> plan (pools) -> [prefill leg] -> route -> attempt (retry) -> relay -> settle

Each step is a call into the decision core (:mod:`routing.core`) or a module of this
package named after it: :mod:`~gateway.pipeline.attempt`, :mod:`~gateway.pipeline.retry`,
:mod:`~gateway.pipeline.relay`, :mod:`~gateway.pipeline.settle`,
:mod:`~gateway.pipeline.prefill`. The reservation taken by each route is released
exactly once on every path (success, failure, timeout, the client gone).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import orjson

from gateway.errors import (
    BackendStatus,
    ClientError,
    ConnectFailed,
    ConnectTimeout,
    Disconnected,
    FirstByteTimeout,
    IdleTimeout,
    TotalTimeout,
    UpstreamError,
    internal_error_answer,
)
from gateway.ops import access_log
from gateway.pipeline import attempt, prefill, settlement
from gateway.pipeline.context import RequestContext, Send
from gateway.pipeline.downstream import ClientGone, CollectDownstream, Downstream
from gateway.pipeline.engine_errors import context_length_exceeded
from gateway.pipeline.openai_request import (
    ParsedRequest,
    check_json_content_type,
    off_loop,
    parse_body,
    parse_completion_request,
    parse_json_object,
    prompt_token_ids,
)
from gateway.pipeline.keepalive import close_comment
from gateway.tenancy.keys import ANONYMOUS, Caller
from routing.core import DECODE, SERVING, Decision, NoBackendAvailable, PromptEstimate, RouteRequest, UnknownModel

if TYPE_CHECKING:
    from gateway.runtime import GatewayState

log = logging.getLogger("gateway.pipeline")

PRIORITY_HEADER = "x-turbo-priority"  # "batch": a batch line, admitted by the batch gate

async def handle(state: GatewayState, endpoint: str, headers: Any, body: bytes | Callable[[], Awaitable[bytes]],
                 down: Downstream, arrival: float, request_id: str, *, send: Send = attempt.run,
                 subset: frozenset[str] | None = None, caller: Caller | None = None) -> None:
    """Serve one completion request (``endpoint``: ``chat`` or ``completions``) whose
    head was read: ``headers`` (case-insensitive mapping), ``body`` the body bytes or a
    coroutine function reading them (raising :class:`ClientError` 400/413). Admit it
    (the batch gate for ``x-turbo-priority: batch``, the caller's limits, the
    admission queue; 429/503 :class:`ClientError`) and :func:`forward` it, each attempt
    made by ``send`` (the gateway's own :func:`~gateway.pipeline.attempt.run`, or the
    endpoint picker's hand-off to Envoy) on a backend in ``subset`` (names; ``None``:
    any). The answer, or the OpenAI error, goes to
    ``down``. ``caller``: who the stack found the request is from when it
    authenticated it on the head already. Raises ``CancelledError`` when the client left."""
    gate = kv = permit = charge = None
    ctx: RequestContext
    try:
        if caller is None:
            caller = state.keyring.authenticate(headers)
        check_json_content_type(headers.get("Content-Type"))
        if not isinstance(body, bytes):
            body = await body()
        parsed = await off_loop(len(body), parse_body, endpoint, body, caller.held_back, state.keyring.strip)
        check_model(state, parsed.model)
        if state.batch_gate is not None and headers.get(PRIORITY_HEADER) == "batch":
            kv = await state.batch_gate.enter(parsed)
            gate = state.batch_gate  # entered: left in the finally below
            arrival = state.loop.time()  # a batch line's TTFT starts once the gate let it in
        key = caller.key
        adm = state.cfg.admission
        by_tokens = adm.max_in_flight_per_backend is not None and adm.fairness == "tokens"
        token_limit = key is not None and key.tokens_per_minute is not None
        prompt = state.core.prompt_tokens(parsed.model, parsed.prompt_text) if by_tokens or token_limit else 0
        ctx = RequestContext(down, parsed, request_id, arrival, send, subset=subset, key_name=caller.name)
        # 429 when over a per-key limit; a token limit charges the prompt and max_tokens up front
        permit = state.limiter.acquire(key, prompt + (parsed.max_tokens or 0) if token_limit else 0.0)
        charge = await state.admission.admit(parsed.model, caller.name, caller.priority, prompt, caller.weight)
        await forward(state, ctx)
    except ClientError as e:
        access_log.refused(request_id, endpoint, e.status, e.code)
        if not down.started:
            down.respond(*e.answer(request_id))
    except ClientGone:
        pass
    except Exception:
        log.exception("unhandled error on POST /v1/%s (request %s)", endpoint, request_id)
        if not down.started:
            down.respond(*internal_error_answer(request_id))
    finally:
        if charge is not None:
            prompt_used, _, completion = ctx.usage or (None, None, None)
            charge.settle(prompt_used, completion, dispatched=bool(ctx.attempts))
        if permit is not None:
            permit.release(ctx.tokens, dispatched=bool(ctx.attempts))
            state.admission.pump()
        if gate is not None:
            gate.leave(kv)


def check_model(state: GatewayState, model: str) -> None:
    """Raises :class:`ClientError` 404 when no backend serves ``model``."""
    try:
        state.core.fleet.candidates(model)
    except UnknownModel as e:
        raise ClientError(404, str(e), param="model", code="model_not_found") from None


async def collect(state: GatewayState, endpoint: str, body: bytes, request_id: str,
                  key_name: str = ANONYMOUS) -> tuple[int, dict[str, str], bytes]:
    """Serve one batch line in process (no socket, no client key): through the batch
    gate, then as any request, its usage counted under ``key_name`` (the batch's
    owner). Returns the answer's status, headers and body."""
    down = CollectDownstream()
    try:
        owner = state.keyring.named(key_name)
        parsed = parse_completion_request(endpoint, body, parse_json_object(body), owner.held_back,
                                          state.keyring.strip)
        check_model(state, parsed.model)
        gate = state.batch_gate
        if gate is None:
            await forward(state, RequestContext(down, parsed, request_id, state.loop.time(), attempt.run, key_name=key_name))
        else:
            async with gate.admit(parsed):  # the line's TTFT starts once the gate let it in
                await forward(state, RequestContext(down, parsed, request_id, state.loop.time(), attempt.run, key_name=key_name))
    except ClientError as e:
        status, body, headers = e.answer()
        return status, headers, body
    headers = dict(down.headers)
    headers.setdefault("x-request-id", request_id)
    return down.status, headers, down.body


async def forward(state: GatewayState, ctx: RequestContext) -> None:
    """Serve ``ctx`` on its model and, when a model cannot serve it, on the requested
    model's fallbacks (``routing.fallbacks``: the first one of its chain not yet tried
    whose triggers include the failure, while the retry budget lasts); the answer
    goes to ``ctx.down``. A stream whose first event is long in coming gets keep-alive
    comments meanwhile (``streaming``). Never raises an :class:`UpstreamError`; raises
    :class:`ClientGone` (or ``CancelledError``) when the client left."""
    parsed = ctx.parsed
    t0 = state.loop.time()
    ctx.model, ctx.data, ctx.body = parsed.model, parsed.data, parsed.body
    ka = state.cfg.streaming
    if parsed.stream and ka.keepalive_after_s is not None and ctx.down.keepalive:
        ctx.keepalive = state.keepalives
        ctx.keepalive.add(ctx, ka.keepalive_after_s, ka.keepalive_every_s)
    tried = [parsed.model]
    try:
        while True:
            failure = await _on_model(state, ctx, t0)
            if failure is None:  # answered (or a stream that failed after its first byte)
                return
            err, no_backend = failure
            reason = fallback_trigger(err, no_backend)
            chain = state.cfg.routing.fallbacks.get(parsed.model, ()) if reason is not None else ()
            nxt = next((f.model for f in chain if reason in f.on and f.model not in tried), None)
            if nxt is None or reason is None or not state.retry.within_budget(t0, state.loop.time()):
                return await settlement.failed(state, ctx, err, no_backend)
            m = state.metrics
            m.child(m.fallbacks, ctx.model, nxt, reason).inc()
            log.info("request %s: model %s failed (%s); falling back to %s", ctx.request_id, ctx.model, reason, nxt)
            tried.append(nxt)
            ctx.model, ctx.fallback_reason = nxt, reason
            ctx.backend, ctx.decision = "", None  # the fallback's own backends from here on
            ctx.data = {**parsed.data, "model": nxt}
            ctx.body = orjson.dumps(ctx.data)
    finally:
        if ctx.keepalive is not None:
            task = ctx.keepalive.discard(ctx)
            if task is not None:
                close_comment(task)


def fallback_trigger(err: UpstreamError | None, no_backend: NoBackendAvailable | None) -> str | None:
    """The ``routing.fallbacks`` trigger a final failure matches: ``unavailable``,
    ``timeout``, ``first_token_timeout``, ``context_length``, or ``None`` for a
    caller's error that another model would refuse too."""
    if no_backend is not None or isinstance(err, (ConnectFailed, Disconnected)):
        return "unavailable"
    if isinstance(err, FirstByteTimeout):
        return "first_token_timeout"
    if isinstance(err, (ConnectTimeout, TotalTimeout, IdleTimeout)):
        return "timeout"
    if isinstance(err, BackendStatus):
        if getattr(err, "code", None) == "context_length_exceeded":
            return "context_length"
        if err.backend_status >= 500 or err.backend_status == 429:
            return "unavailable"
    return None


async def _token_ids(state: GatewayState, ctx: RequestContext) -> Sequence[int] | None:
    """The prompt's token ids by ``ctx.model``'s own tokenizer, or ``None`` (no
    tokenizer, or a prompt it cannot reproduce). A long encoding runs in the loop's
    default executor (``tokenizers`` releases the GIL), so other requests go on
    meanwhile; the prefix cache makes a conversation's next turn short. Without a
    tokenizer, a completions prompt given as token ids is taken as it is when a
    backend of the model publishes KV events (its token-exact keys need them)."""
    data = ctx.data or ctx.parsed.data
    tz = state.core.tokenization(ctx.model, ctx.parsed.endpoint, data)
    if tz is None:
        if ctx.parsed.endpoint == "completions" and state.core.wants_token_ids(ctx.model):
            return prompt_token_ids(data)
        return None
    if tz.offload:
        await state.loop.run_in_executor(None, tz.encode)
    return tz.token_ids()


async def _on_model(state: GatewayState, ctx: RequestContext,
                    t0: float) -> tuple[UpstreamError | None, NoBackendAvailable | None] | None:
    """Estimate, plan, route, attempt and retry on ``ctx.model``, within the retry
    budget counted from ``t0``. Returns ``None`` once the client was answered (or its
    stream ended with an error event after the first byte), else the final failure:
    the last attempt's, or the reason no backend could be tried. One function on
    purpose: the retry loop is the request's story and reads top to bottom."""
    loop = state.loop
    core, policy, m = state.core, state.retry, state.metrics
    parsed = ctx.parsed
    first = len(ctx.attempts)  # the attempts on earlier models do not count against this one's
    token_ids = await _token_ids(state, ctx)
    ctx.estimate, req = await off_loop(len(parsed.body), core.request, ctx.model, parsed.prompt_text, parsed.max_tokens,
                                      parsed.cache_salt, parsed.stream, token_ids)
    ctx.request = req
    if token_ids is not None:  # an exact count: a prompt that fits on no backend is refused unsent
        limit = core.context_exceeded(ctx.model, len(token_ids), parsed.max_tokens)
        if limit is not None:
            answer = context_length_exceeded(limit, len(token_ids), parsed.max_tokens, parsed.endpoint)
            return BackendStatus("", answer[0], answer[1], "application/json", openai=answer), None
    req.subset = ctx.subset
    now = loop.time()
    plan = core.plan(req, now, state.cfg.routing.long_prompt_tokens)
    roles, remote = plan.roles, False  # the first route reuses the plan's prefix match
    if plan.kind == "disaggregated":
        params = await prefill.run(state, ctx, req)
        if params is not None:
            ctx.body = orjson.dumps({**(ctx.data or ctx.parsed.data), "kv_transfer_params": params})
            roles, remote = DECODE, True
        else:  # the prefill leg failed: a decode or mixed backend computes the prompt itself
            roles = SERVING
        m.child(m.disaggregated, "ok" if remote else "fallback").inc()
        now = loop.time()
    pools, stable_pools = core.canary_pools(ctx.model)
    req.roles, req.remote_prefill = roles, remote
    excluded: set[str] = set()
    last: UpstreamError | None = None
    while True:
        req.pools = pools
        if excluded:
            req.exclude = frozenset(excluded)
        try:
            decision, reservation = core.route(req, now)
        except NoBackendAvailable as e:
            if stable_pools is not None:  # no canary backend can take it: the stable pool does
                pools, stable_pools = stable_pools, None
                m.child(m.canary_fallbacks, "no_canary_backend").inc()
                continue
            if e.retry_after_s is not None and policy.may_wait(e.retry_after_s, len(ctx.attempts) - first, t0, now,
                                                               breaker_open=e.breaker_open):
                await asyncio.sleep(e.retry_after_s)
                now = loop.time()
                continue
            return (last, None) if last is not None else (None, e)
        m.child(m.decisions, decision.policy, decision.reason).inc()
        backend = decision.backend
        ctx.backend, ctx.decision = backend.name, decision
        ctx.attempts.append((backend.name, now, "started"))
        try:
            client = state.clients[backend.name]
            if backend.needs_load(ctx.model):  # a LoRA adapter it may load on demand (rare: once per backend)
                lora = state.cfg.models[ctx.model].lora
                timeout_s = next(b.lora.load_timeout_s for b in state.cfg.backends if b.name == backend.name)
                assert lora is not None
                await state.adapters.ensure(core, client, ctx.model, lora.path, timeout_s)
            await ctx.send(state, ctx, client, reservation)
            return None
        except UpstreamError as err:
            settlement.attempt_failed(state, backend, reservation, err)
            ctx.attempts[-1] = (backend.name, now, err.reason)
            if ctx.scan is not None:  # the backend's bytes already reached the client: end the stream
                await settlement.stream_failed(state, ctx, err)
                return None
            last, now = err, loop.time()
            delay = policy.after_failure(err, len(ctx.attempts) - first, t0, now)
            if delay is None:
                return err, None
            excluded.add(backend.name)
            if stable_pools is not None:  # a canary failed: retry on the stable pool
                pools, stable_pools = stable_pools, None
                m.child(m.canary_fallbacks, err.reason).inc()
            m.child(m.retries, err.reason).inc()
            log.info("retrying request %s after %s from %s (attempt %d)", ctx.request_id, err.reason, backend.name,
                     len(ctx.attempts))
            await asyncio.sleep(delay)
            now = loop.time()
        finally:
            reservation.release(loop.time())
