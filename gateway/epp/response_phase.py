"""The response phase of a request the endpoint picker handed to Envoy
(:func:`gateway.epp.picker.hand_off` reads the messages): what Envoy's response
messages tell about the attempt, and the settlement they lead to. The served endpoint
tells whether Envoy retried elsewhere (the chosen backend then failed: its breaker
hears it and the reservation moves to the one that served); the status settles
failures; with ``listen.epp.response_body`` the body gives the first token's time and
the final ``usage``. An error status an engine may give a caller's error in its own
words (:data:`~gateway.pipeline.engine_errors.CLASSIFIED_STATUSES`) has its body read
whole (the picker asks Envoy to buffer it) and, when classified, rewritten in OpenAI's
terms as on the gateway's own data plane (:func:`on_error_body`); a 200's body is
never held. A response is settled once (:attr:`Served.settled`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway.apis.base import reshape
from gateway.epp.ext_proc import headers_of, served_endpoint
from gateway.errors import SHOULD_RETRY_HEADER, ProxyRetried
from gateway.pipeline import engine_errors, settlement
from gateway.pipeline.context import RequestContext
from gateway.pipeline.headers import response_headers
from gateway.pipeline.retry import parse_retry_after
from gateway.pipeline.stream_scan import StreamScan, scan_for
from routing.core import BackendState, Reservation

if TYPE_CHECKING:
    from gateway.runtime import GatewayState

MAX_WHOLE_BYTES = 4 * 1024 * 1024  # a whole answer's bytes kept to read its usage


class Served:
    """Where a handed-off request stands in its response phase."""

    __slots__ = ("backend", "reservation", "status", "scan", "whole", "settled", "error", "retry_after_s")

    def __init__(self, backend: BackendState, reservation: Reservation) -> None:
        self.backend = backend
        self.reservation = reservation
        self.status = 0
        self.scan: StreamScan | None = None
        self.whole: bytearray | None = None
        self.settled = False
        self.error: bytearray | None = None  # an error answer's body, read whole to classify it
        self.retry_after_s: float | None = None  # an error answer's Retry-After


def on_response_headers(state: GatewayState, ctx: RequestContext, served: Served, msg: Any) -> dict[str, str]:
    """The response's head: who served it, its status. Returns the headers added to
    the client's answer."""
    status_text = next((h.raw_value.decode() if h.raw_value else h.value
                        for h in msg.response_headers.headers.headers if h.key == ":status"), "0")
    served.status = status = int(status_text) if status_text.isdigit() else 0
    if status != 200:
        served.retry_after_s = parse_retry_after(headers_of(msg.response_headers).get("retry-after"))
    now = state.loop.time()
    endpoint = served_endpoint(msg)
    client = state.clients.get(served.backend.name)
    if endpoint and client is not None and endpoint != client.endpoint:
        other = next((c for c in state.clients.values() if c.endpoint == endpoint), None)
        if other is not None:  # Envoy retried elsewhere: the chosen backend failed before answering
            err = ProxyRetried(served.backend.name, f"backend {served.backend.name} failed; Envoy retried on "
                                                    f"{other.state.name}")
            settlement.attempt_failed(state, served.backend, served.reservation, err)
            ctx.attempts[-1] = (served.backend.name, ctx.attempts[-1][1], err.reason)
            served.backend = other.state
            assert ctx.request is not None  # routed before it was sent
            served.reservation = state.core.reserve(ctx.request, other.state, now)
            ctx.backend = other.state.name
            ctx.attempts.append((other.state.name, now, "started"))
    if status in engine_errors.CLASSIFIED_STATUSES:
        served.error = bytearray()  # settled with its body (on_error_body)
    elif status != 200:
        served.settled = True
        settlement.proxied_status(state, ctx, served.backend, served.reservation, status, served.retry_after_s)
    elif not state.cfg.listen.epp.response_body:
        settlement.served(state, ctx)
    extra = response_headers(ctx, served.backend.name)
    if status != 200:  # Envoy retried already, as the gateway would have: the client should not
        extra[SHOULD_RETRY_HEADER] = "false"
    return extra


def on_response_body(state: GatewayState, ctx: RequestContext, served: Served, chunk: bytes, end: bool) -> None:
    """A chunk of a 200 response's body: the first token of a stream, its events and
    ``usage``; a whole answer's bytes."""
    if ctx.parsed.stream:
        if served.scan is None:
            if not chunk and not end:
                return
            settlement.first_byte(state, ctx, served.reservation, state.loop.time(), chunk)
            served.scan = ctx.scan = scan_for(ctx.parsed.api)
        served.scan.feed(chunk)
    else:
        if served.whole is None:
            served.whole = bytearray()
        if len(served.whole) + len(chunk) <= MAX_WHOLE_BYTES:
            served.whole += chunk
    if end:
        settle_end(state, ctx, served)


def settle_end(state: GatewayState, ctx: RequestContext, served: Served) -> None:
    """A 200 response ended: settle it with what its body showed (nothing, without
    body processing); a whole answer's body is the request's answer (what a Responses
    turn keeps, :mod:`gateway.pipeline.conversation`)."""
    served.settled = True
    whole = ctx.answer = bytes(served.whole) if served.whole else None
    settlement.proxied_end(state, ctx, served.reservation, served.scan, whole)


def on_error_body(state: GatewayState, ctx: RequestContext, served: Served, chunk: bytes,
                  end: bool) -> tuple[int, bytes, dict[str, str]] | None:
    """A chunk of an error answer's body (Envoy sends it whole, buffered). At its end
    the answer is classified (:func:`gateway.pipeline.engine_errors.classify`) and
    settled with the status the client gets. Returns the rewritten answer, ``(status,
    error body in the API's shape, headers to set)``, when an engine's caller error was recognised,
    else ``None`` (relayed as the engine sent it)."""
    assert served.error is not None
    served.error += chunk
    if not end:
        return None
    served.settled = True
    answer = engine_errors.classify(served.status, bytes(served.error), ctx.parsed.endpoint)
    status = served.status if answer is None else answer[0]
    settlement.proxied_status(state, ctx, served.backend, served.reservation, status, served.retry_after_s)
    if answer is None or (answer[0] == served.status and answer[1] == served.error):
        return None
    body = reshape(ctx.parsed.api, answer[0], answer[1])  # in the shape that API's clients parse
    return answer[0], body, {"content-type": "application/json", "content-length": str(len(body)),
                             SHOULD_RETRY_HEADER: "false"}


def settle_closed(state: GatewayState, ctx: RequestContext, served: Served) -> None:
    """Envoy closed or reset the stream before the response's body ended: without
    body processing that is how a 200 ends; an error answer without a body settles
    with its status; otherwise the client left."""
    if served.status == 200 and not state.cfg.listen.epp.response_body:
        settle_end(state, ctx, served)
    elif served.error is not None:
        served.settled = True
        settlement.proxied_status(state, ctx, served.backend, served.reservation, served.status,
                                  served.retry_after_s)
    else:
        served.settled = True
        settlement.client_left(state, ctx, served.backend.name)
