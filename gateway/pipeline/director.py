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
from dataclasses import dataclass, field
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
from gateway.pipeline import attempt, prefill, settle
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
from gateway.pipeline.relay import KeepAlives, StreamScan, close_comment
from gateway.pipeline.settle import ServedMetrics
from gateway.tenancy.keys import ANONYMOUS, Caller
from routing.core import DECODE, SERVING, Decision, NoBackendAvailable, PromptEstimate, RouteRequest, UnknownModel

if TYPE_CHECKING:
    from gateway.runtime import GatewayState

log = logging.getLogger("gateway.pipeline")

PRIORITY_HEADER = "x-turbo-priority"  # "batch": a batch line, admitted by the batch gate

# One attempt on one backend: ``(state, ex, client, reservation)``; raises an
# UpstreamError when the request may be tried elsewhere (see attempt.run).
Send = Callable[["GatewayState", "Exchange", Any, Any], Awaitable[None]]


@dataclass(slots=True)
class Exchange:
    """One client request's progress across attempts."""

    down: Downstream  # where the answer goes
    parsed: ParsedRequest
    request_id: str
    arrival: float  # loop time the request arrived
    model: str = ""  # the model being served: the requested one, or a fallback (routing.fallbacks)
    data: dict[str, Any] | None = None  # the request object for ``model`` (set by forward)
    fallback_reason: str = ""  # why ``model`` is a fallback ("" when it is the requested model)
    keepalive: KeepAlives | None = None  # where its keep-alive comments fall due, while its first event is awaited
    backend: str = ""  # the backend of the current (or last) attempt
    estimate: PromptEstimate | None = None
    request: RouteRequest | None = None  # what the decision core routes on the current model
    decision: Decision | None = None
    body: bytes = b""  # what is sent upstream: the client's bytes unless a leg rewrote them
    scan: StreamScan | None = None  # the stream being relayed, if any
    attempts: list[tuple[str, float, str]] = field(default_factory=list)  # (backend, start time, outcome)
    tokens: int | None = None  # prompt + completion tokens of a completed response (per-key token limits)
    usage: tuple[int, int, int] | None = None  # (prompt, cached prompt, completion) tokens of a completed response
    key_name: str = ANONYMOUS  # the caller's key name, whose usage ledger counts it (gateway.tenancy.usage_ledger)
    served: ServedMetrics | None = None  # the answering backend's metric children, once it answered
    ttft_s: float | None = None  # arrival to the answer's first byte (s), once it went out
    subset: frozenset[str] | None = None  # the only backends it may go to (a proxy's subset hint), None: any
    send: Send = attempt.run  # the attempt step: the gateway's own, or the endpoint picker's (gateway.epp.picker)


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
    ex: Exchange
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
        ex = Exchange(down, parsed, request_id, arrival, subset=subset, send=send, key_name=caller.name)
        # 429 when over a per-key limit; a token limit charges the prompt and max_tokens up front
        permit = state.limiter.acquire(key, prompt + (parsed.max_tokens or 0) if token_limit else 0.0)
        charge = await state.admission.admit(parsed.model, caller.name, caller.priority, prompt, caller.weight)
        await forward(state, ex)
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
            prompt_used, _, completion = ex.usage or (None, None, None)
            charge.settle(prompt_used, completion, dispatched=bool(ex.attempts))
        if permit is not None:
            permit.release(ex.tokens, dispatched=bool(ex.attempts))
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
            await forward(state, Exchange(down, parsed, request_id, state.loop.time(), key_name=key_name))
        else:
            async with gate.admit(parsed):  # the line's TTFT starts once the gate let it in
                await forward(state, Exchange(down, parsed, request_id, state.loop.time(), key_name=key_name))
    except ClientError as e:
        status, body, headers = e.answer()
        return status, headers, body
    headers = dict(down.headers)
    headers.setdefault("x-request-id", request_id)
    return down.status, headers, down.body


async def forward(state: GatewayState, ex: Exchange) -> None:
    """Serve ``ex`` on its model and, when a model cannot serve it, on the requested
    model's fallbacks (``routing.fallbacks``: the first one of its chain not yet tried
    whose triggers include the failure, while the retry budget lasts); the answer
    goes to ``ex.down``. A stream whose first event is long in coming gets keep-alive
    comments meanwhile (``streaming``). Never raises an :class:`UpstreamError`; raises
    :class:`ClientGone` (or ``CancelledError``) when the client left."""
    parsed = ex.parsed
    t0 = state.loop.time()
    ex.model, ex.data, ex.body = parsed.model, parsed.data, parsed.body
    ka = state.cfg.streaming
    if parsed.stream and ka.keepalive_after_s is not None and ex.down.keepalive:
        ex.keepalive = state.keepalives
        ex.keepalive.add(ex, ka.keepalive_after_s, ka.keepalive_every_s)
    tried = [parsed.model]
    try:
        while True:
            failure = await _on_model(state, ex, t0)
            if failure is None:  # answered (or a stream that failed after its first byte)
                return
            err, no_backend = failure
            reason = fallback_trigger(err, no_backend)
            chain = state.cfg.routing.fallbacks.get(parsed.model, ()) if reason is not None else ()
            nxt = next((f.model for f in chain if reason in f.on and f.model not in tried), None)
            if nxt is None or reason is None or not state.retry.within_budget(t0, state.loop.time()):
                return await settle.failed(state, ex, err, no_backend)
            m = state.metrics
            m.child(m.fallbacks, ex.model, nxt, reason).inc()
            log.info("request %s: model %s failed (%s); falling back to %s", ex.request_id, ex.model, reason, nxt)
            tried.append(nxt)
            ex.model, ex.fallback_reason = nxt, reason
            ex.backend, ex.decision = "", None  # the fallback's own backends from here on
            ex.data = {**parsed.data, "model": nxt}
            ex.body = orjson.dumps(ex.data)
    finally:
        if ex.keepalive is not None:
            task = ex.keepalive.discard(ex)
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


async def _token_ids(state: GatewayState, ex: Exchange) -> Sequence[int] | None:
    """The prompt's token ids by ``ex.model``'s own tokenizer, or ``None`` (no
    tokenizer, or a prompt it cannot reproduce). A long encoding runs in the loop's
    default executor (``tokenizers`` releases the GIL), so other requests go on
    meanwhile; the prefix cache makes a conversation's next turn short. Without a
    tokenizer, a completions prompt given as token ids is taken as it is when a
    backend of the model publishes KV events (its token-exact keys need them)."""
    data = ex.data or ex.parsed.data
    tz = state.core.tokenization(ex.model, ex.parsed.endpoint, data)
    if tz is None:
        if ex.parsed.endpoint == "completions" and state.core.wants_token_ids(ex.model):
            return prompt_token_ids(data)
        return None
    if tz.offload:
        await state.loop.run_in_executor(None, tz.encode)
    return tz.token_ids()


async def _on_model(state: GatewayState, ex: Exchange,
                    t0: float) -> tuple[UpstreamError | None, NoBackendAvailable | None] | None:
    """Estimate, plan, route, attempt and retry on ``ex.model``, within the retry
    budget counted from ``t0``. Returns ``None`` once the client was answered (or its
    stream ended with an error event after the first byte), else the final failure:
    the last attempt's, or the reason no backend could be tried. One function on
    purpose: the retry loop is the request's story and reads top to bottom."""
    loop = state.loop
    core, policy, m = state.core, state.retry, state.metrics
    parsed = ex.parsed
    first = len(ex.attempts)  # the attempts on earlier models do not count against this one's
    token_ids = await _token_ids(state, ex)
    ex.estimate, req = await off_loop(len(parsed.body), core.request, ex.model, parsed.prompt_text, parsed.max_tokens,
                                      parsed.cache_salt, parsed.stream, token_ids)
    ex.request = req
    if token_ids is not None:  # an exact count: a prompt that fits on no backend is refused unsent
        limit = core.context_exceeded(ex.model, len(token_ids), parsed.max_tokens)
        if limit is not None:
            answer = context_length_exceeded(limit, len(token_ids), parsed.max_tokens, parsed.endpoint)
            return BackendStatus("", answer[0], answer[1], "application/json", openai=answer), None
    req.subset = ex.subset
    now = loop.time()
    plan = core.plan(req, now, state.cfg.routing.long_prompt_tokens)
    roles, remote = plan.roles, False  # the first route reuses the plan's prefix match
    if plan.kind == "disaggregated":
        params = await prefill.run(state, ex, req)
        if params is not None:
            ex.body = orjson.dumps({**(ex.data or ex.parsed.data), "kv_transfer_params": params})
            roles, remote = DECODE, True
        else:  # the prefill leg failed: a decode or mixed backend computes the prompt itself
            roles = SERVING
        m.child(m.disaggregated, "ok" if remote else "fallback").inc()
        now = loop.time()
    pools, stable_pools = core.canary_pools(ex.model)
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
            if e.retry_after_s is not None and policy.may_wait(e.retry_after_s, len(ex.attempts) - first, t0, now,
                                                               breaker_open=e.breaker_open):
                await asyncio.sleep(e.retry_after_s)
                now = loop.time()
                continue
            return (last, None) if last is not None else (None, e)
        m.child(m.decisions, decision.policy, decision.reason).inc()
        backend = decision.backend
        ex.backend, ex.decision = backend.name, decision
        ex.attempts.append((backend.name, now, "started"))
        try:
            client = state.clients[backend.name]
            if backend.needs_load(ex.model):  # a LoRA adapter it may load on demand (rare: once per backend)
                lora = state.cfg.models[ex.model].lora
                timeout_s = next(b.lora.load_timeout_s for b in state.cfg.backends if b.name == backend.name)
                assert lora is not None
                await state.adapters.ensure(core, client, ex.model, lora.path, timeout_s)
            await ex.send(state, ex, client, reservation)
            return None
        except UpstreamError as err:
            settle.attempt_failed(state, backend, reservation, err)
            ex.attempts[-1] = (backend.name, now, err.reason)
            if ex.scan is not None:  # the backend's bytes already reached the client: end the stream
                await settle.stream_failed(state, ex, err)
                return None
            last, now = err, loop.time()
            delay = policy.after_failure(err, len(ex.attempts) - first, t0, now)
            if delay is None:
                return err, None
            excluded.add(backend.name)
            if stable_pools is not None:  # a canary failed: retry on the stable pool
                pools, stable_pools = stable_pools, None
                m.child(m.canary_fallbacks, err.reason).inc()
            m.child(m.retries, err.reason).inc()
            log.info("retrying request %s after %s from %s (attempt %d)", ex.request_id, err.reason, backend.name,
                     len(ex.attempts))
            await asyncio.sleep(delay)
            now = loop.time()
        finally:
            reservation.release(loop.time())
