"""The headers of a completion's answer, built in one place.

Every answer the pipeline gives for a routed request carries its request id, the
backend that served it and the route's explanation (:data:`ROUTE_HEADER`); a stream's
head also says not to cache or buffer it. The functions take any object with the
fields of :class:`Routed` (the request context, :mod:`gateway.pipeline.context`), so that
this module depends on no step.
"""

from __future__ import annotations

from typing import Protocol

from gateway.errors import BACKEND_HEADER, REQUEST_ID_HEADER
from routing.core import Decision

ROUTE_HEADER = "x-turbo-route"


class Routed(Protocol):
    """What the headers say about a request (a :class:`~gateway.pipeline.context.RequestContext`)."""

    @property
    def request_id(self) -> str: ...

    @property
    def backend(self) -> str: ...

    @property
    def model(self) -> str: ...

    @property
    def fallback_reason(self) -> str: ...

    @property
    def decision(self) -> Decision | None: ...

    @property
    def route_details(self) -> bool: ...


def route_header(decision: Decision, fallback: str = "", fallback_reason: str = "", details: bool = True) -> str:
    """The explanation header: policy, backend and, with ``details`` (a caller allowed
    to see the cache: ``auth.route_details``), the reason, matched prefix tokens and
    the kind of evidence behind them (``precise``, ``speculative`` or ``approximate``)
    and the estimate that decided (when the policy made one), each of which tells
    whether the prompt's prefix is cached, and the output tokens the estimate expected
    (0: a prefill-only API), and for a turn of a session, the start of its id and
    whether it went to the session's ``home``, ``moved`` or is ``new``; for a request
    served by a fallback model, that model and the failure that sent it there."""
    parts = [f"policy={decision.policy}", f"backend={decision.backend.name}"]
    if details:
        d = decision.detail
        parts += [f"reason={decision.reason}", f"matched_tokens={int(d.get('matched_tokens', 0))}",
                  f"evidence={decision.evidence}"]
        if "ttft_est_s" in d:
            parts.append(f"ttft_est_ms={d['ttft_est_s'] * 1000:.1f}")
        if "output_tokens" in d:  # the decode term's length; 0: a prefill-only API (embeddings, rerank)
            parts.append(f"output_tokens_est={d['output_tokens']}")
        if "metrics_stale" in d:
            parts.append("metrics_stale=1")
        if decision.session is not None:  # 8 hex digits of the (key-scoped) session id
            parts.append(f"session={decision.session[:8]}; placement={decision.placement}")
    if fallback_reason:
        parts.append(f"fallback={fallback}; fallback_reason={fallback_reason}")
    return "; ".join(parts)


def answer_headers(r: Routed, content_type: str) -> dict[str, str]:
    """The headers of a routed request's 200 answer (``content_type``: the backend's)."""
    assert r.decision is not None
    return {"Content-Type": content_type, BACKEND_HEADER: r.backend, REQUEST_ID_HEADER: r.request_id,
            ROUTE_HEADER: route_header(r.decision, r.model, r.fallback_reason, r.route_details)}


def stream_headers(r: Routed, content_type: str) -> dict[str, str]:
    """The head of a routed request's event stream (``content_type``: the backend's)."""
    h = answer_headers(r, content_type)
    h["Cache-Control"] = "no-cache"
    h["X-Accel-Buffering"] = "no"  # an nginx in front passes the events on as they come
    return h


def keepalive_headers(r: Routed) -> dict[str, str]:
    """The head of a stream opened by a keep-alive comment, before its first event: the
    route once one was chosen."""
    h = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
         REQUEST_ID_HEADER: r.request_id}
    if r.decision is not None:
        h[BACKEND_HEADER] = r.backend
        h[ROUTE_HEADER] = route_header(r.decision, r.model, r.fallback_reason, r.route_details)
    return h


def response_headers(r: Routed, backend: str) -> dict[str, str]:
    """The headers the endpoint picker adds to a response Envoy relays from ``backend``."""
    assert r.decision is not None
    return {BACKEND_HEADER: backend, REQUEST_ID_HEADER: r.request_id,
            ROUTE_HEADER: route_header(r.decision, r.model, r.fallback_reason, r.route_details)}
