"""The prefill leg of a disaggregated request (vLLM's disaggregated-serving proxy flow).

The prompt is first prefilled on a ``prefill`` backend (``max_tokens`` 1, not
streamed, ``kv_transfer_params.do_remote_decode``); its answer's ``kv_transfer_params``
then go with the request to a ``decode`` backend, which pulls the KV cache instead of
recomputing it. The leg is an attempt like any other: the same transport, deadlines,
retry policy and failure reporting (a failing prefill backend opens its circuit
breaker like any backend).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import orjson

from gateway.errors import UpstreamError
from gateway.pipeline import attempt, settlement
from gateway.pipeline.context import RequestContext
from gateway.pipeline.retry import Retrier
from routing.core import DECODE, PREFILL, SERVING, NoBackendAvailable, RouteRequest

if TYPE_CHECKING:
    from gateway.runtime import GatewayState

log = logging.getLogger("gateway.pipeline")

_PREFILL_ONLY = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


def _prefill_body(data: dict[str, Any]) -> bytes:
    data = dict(data)
    data.pop("stream_options", None)
    data.update(stream=False, max_tokens=1, kv_transfer_params=_PREFILL_ONLY)
    if "max_completion_tokens" in data:
        data["max_completion_tokens"] = 1
    return orjson.dumps(data)


async def run(state: GatewayState, ctx: RequestContext, base: RouteRequest) -> dict[str, Any] | None:
    """Prefill ``ctx``'s prompt on the ``prefill`` pool, retrying on other prefill
    backends as the retry policy allows (:class:`~gateway.pipeline.retry.Retrier`).
    Returns the ``kv_transfer_params`` the decode leg must carry, or ``None`` when the
    leg failed (the caller falls back to a backend that computes the prompt itself). A
    client that goes away cancels the leg with the request (its connection is closed,
    the engine aborts). Each attempt settles through :mod:`~gateway.pipeline.settlement`."""
    loop = state.loop
    parsed = ctx.parsed
    body = _prefill_body(ctx.data or parsed.data)
    excluded: set[str] = set()
    retrier = Retrier(state.retry, loop.time())
    trace = ctx.trace
    while True:
        req = RouteRequest(ctx.model, frozenset(excluded), base.prompt_text, base.prompt_bytes, base.block_hashes,
                           base.prompt_tokens, 1, base.tokens_per_block, PREFILL, stream=False,
                           token_ids=base.token_ids, token_keys=base.token_keys)
        now = loop.time()
        try:
            decision, reservation = state.core.route(req, now)
        except NoBackendAvailable:
            return None
        retrier.started()
        backend = decision.backend
        client = state.clients[backend.name]
        if trace is not None:
            trace.attempt_began(decision, backend.spec.pool, now, ctx.model, client.pool.host, client.pool.port)
        try:
            payload = await attempt.fetch(client, parsed.api, body, ctx.request_id,
                                          trace.propagation if trace is not None else b"")
            obj = orjson.loads(payload)
        except (UpstreamError, orjson.JSONDecodeError) as e:
            err = e if isinstance(e, UpstreamError) else UpstreamError(backend.name, f"invalid JSON: {e}")
            if trace is not None:
                trace.attempt_ended(err)
            settlement.attempt_failed(state, backend, reservation, err)
            delay = retrier.after_failure(err.retryable, loop.time())
            if delay is None:
                return None
            excluded.add(backend.name)
            await retrier.backoff(delay)
            continue
        except BaseException:  # the client left (cancelled), or a bug
            settlement.release(state, reservation)
            raise
        if trace is not None:
            trace.attempt_ended()
        settlement.leg_completed(state, reservation)
        params = obj.get("kv_transfer_params") if isinstance(obj, dict) else None
        if isinstance(params, dict):
            return params
        log.warning("prefill backend %s returned no kv_transfer_params; falling back", backend.name)
        return None


async def leg(state: GatewayState, ctx: RequestContext) -> tuple[frozenset[str] | None, bool]:
    """The director's prefill step of a disaggregated request: prefill ``ctx``'s prompt
    (:func:`run`) and point its decode leg at the KV it left (``ctx.body`` gets the
    ``kv_transfer_params``). Returns the roles of the backends the request goes to
    next and whether its prompt's KV arrives by transfer: ``decode`` ones when the leg
    succeeded, else any serving backend, which computes the prompt itself."""
    assert ctx.request is not None and ctx.data is not None
    if ctx.trace is not None:
        ctx.trace.leg_began()
    params = await run(state, ctx, ctx.request)
    if ctx.trace is not None:
        ctx.trace.leg_ended(params is not None)
    m = state.metrics
    if params is None:  # the prefill leg failed: a decode or mixed backend computes the prompt itself
        m.child(m.disaggregated, "fallback").inc()
        return SERVING, False
    ctx.body = orjson.dumps({**ctx.data, "kv_transfer_params": params})
    m.child(m.disaggregated, "ok").inc()
    return DECODE, True
