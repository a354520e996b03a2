"""Fallback models: where a request goes when its model cannot serve it.

``routing.fallbacks`` gives each model a chain of other models and the failures that
send a request down it (:func:`trigger`: ``unavailable``, ``timeout``,
``first_token_timeout``, ``context_length``). :func:`take` moves the request context to
the first model of its chain not yet tried, while the retry budget lasts.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import orjson

from gateway.errors import (
    BackendStatus,
    ConnectFailed,
    ConnectTimeout,
    Disconnected,
    FirstByteTimeout,
    IdleTimeout,
    TotalTimeout,
    UpstreamError,
)
from gateway.pipeline.context import Failure, RequestContext
from routing.core import NoBackendAvailable

if TYPE_CHECKING:
    from gateway.runtime import GatewayState

log = logging.getLogger("gateway.pipeline")


def take(state: GatewayState, ctx: RequestContext, failure: Failure, tried: list[str], t0: float) -> bool:
    """After ``ctx.model`` failed for good with ``failure``: move ``ctx`` to the next
    model of the requested model's fallback chain whose triggers include the failure
    and that is not in ``tried`` (which gets it), while the retry budget of a request
    whose first attempt began at ``t0`` lasts.
    Returns whether it did (``False``: the failure is the answer)."""
    reason = trigger(*failure)
    parsed = ctx.parsed
    chain = state.cfg.routing.fallbacks.get(parsed.model, ()) if reason is not None else ()
    nxt = next((f.model for f in chain if reason in f.on and f.model not in tried), None)
    if nxt is None or not state.retry.within_budget(t0, state.loop.time()):
        return False
    assert reason is not None
    m = state.metrics
    m.child(m.fallbacks, ctx.model, nxt, reason).inc()
    log.info("request %s: model %s failed (%s); falling back to %s", ctx.request_id, ctx.model, reason, nxt)
    tried.append(nxt)
    ctx.model, ctx.fallback_reason = nxt, reason
    ctx.backend, ctx.decision = "", None  # the fallback's own backends from here on
    ctx.data = {**parsed.data, "model": nxt}
    ctx.body = orjson.dumps(ctx.data)
    return True


def trigger(err: UpstreamError | None, no_backend: NoBackendAvailable | None) -> str | None:
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
