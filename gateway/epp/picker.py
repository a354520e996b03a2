"""The endpoint picker: the gateway's decision core behind Envoy.

Envoy's ``ext_proc`` filter opens one gRPC stream
(``envoy.service.ext_proc.v3.ExternalProcessor/Process``) per HTTP request; this module
answers it as the Gateway API Inference Extension's endpoint picker (EPP; protocol:
``docs/proposals/004-endpoint-picker-protocol`` in
kubernetes-sigs/gateway-api-inference-extension). A request's life:

1. **Request phase** (request body mode ``FULL_DUPLEX_STREAMED``): the headers and the
   whole body arrive; the request goes through the same front door and pipeline as one
   the gateway serves itself (:func:`gateway.pipeline.director.handle`: key, limits,
   admission, estimate, plan, route, reserve), with :func:`hand_off` as its attempt
   step. The hand-off answers Envoy with the chosen backend's ``ip:port`` in the header
   ``x-gateway-destination-endpoint`` and, followed by up to
   ``listen.epp.fallback_endpoints`` others (soonest estimated TTFT first), in the
   dynamic metadata ``envoy.lb`` / ``x-gateway-destination-endpoint``, then sends the
   body back. A request that is refused (a key over its limits, a saturated fleet: 429
   with ``Retry-After``; no backend: 503; a bad body: 400) gets an ``ImmediateResponse``
   with the OpenAI error body, as the gateway answers it itself.
2. **Response phase**: the served endpoint (the ``upstream.address`` attribute, or the
   metadata ``envoy.lb`` / ``x-gateway-destination-endpoint-served``) tells whether
   Envoy retried elsewhere (the chosen backend then failed: its breaker hears it and
   the reservation moves to the one that served); the status settles failures; with
   ``listen.epp.response_body`` the streamed body gives the first token's time and the
   final ``usage``, which teach the load model as behind the gateway's own data plane.
3. The reservation is released exactly once: at the end of the response, on an error,
   or when Envoy resets the stream (the client left).

A subset hint (filter metadata ``envoy.lb.subset_hint`` /
``x-gateway-destination-endpoint-subset``, a list of ``ip:port``) limits the choice to
those endpoints. Traces (:mod:`gateway.ops.tracing`): the parent is the span of Envoy's
ext_proc call when Envoy traces (its gRPC metadata), else the caller's ``traceparent``;
the backend gets the attempt's. The streams' gRPC server is :mod:`gateway.epp.grpc_server`;
the protocol's names and message helpers are :mod:`gateway.epp.ext_proc`; what the
response phase's messages teach, and its settlement, :mod:`gateway.epp.response_phase`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, cast

import grpc
import orjson
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from multidict import CIMultiDict

from gateway.epp.ext_proc import (
    CALLER_CREDENTIALS,
    COMPLETION_PATHS,
    DESTINATION,
    HEADERS_UNCHANGED,
    LB_NAMESPACE,
    MAX_RETRIES,
    UNCHANGED,
    error_body_mode,
    header_option,
    headers_of,
    subset_hint,
)
from gateway.epp.response_phase import Served, on_error_body, on_response_body, on_response_headers, settle_closed
from gateway.errors import REQUEST_ID_HEADER, SHOULD_RETRY_HEADER, ClientError, error_body
from gateway.paths import canonical_path
from gateway.pipeline import director, settlement
from gateway.pipeline.context import RequestContext
from gateway.pipeline.openai_request import hold_back, model_card, models_list
from gateway.request_ids import request_id, upstream_id
from gateway.server import stored_routes
from routing.core import Reservation

if TYPE_CHECKING:
    from gateway.runtime import GatewayState
    from gateway.upstream.client import BackendClient

log = logging.getLogger("gateway.epp.picker")

class EppDownstream:
    """The :class:`~gateway.pipeline.downstream.Downstream` of a request picked for
    Envoy: an answer given before the hand-off (:meth:`respond`) becomes Envoy's
    ``ImmediateResponse``; after it, Envoy relays the backend's answer itself."""

    __slots__ = ("stream", "answer", "started")
    chunked = may_wait = keepalive = False
    transport = None

    def __init__(self, stream: EppStream) -> None:
        self.stream = stream
        self.answer: tuple[int, bytes, dict[str, str]] | None = None
        self.started = False  # the hand-off went to Envoy: no status can be given any more

    def respond(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.answer = (status, body, headers)

    def start_stream_now(self, headers: dict[str, str], first: bytes, end: bool = False) -> None:
        raise RuntimeError("behind Envoy, the backend's answer goes to the client through Envoy")

    async def start_stream(self, headers: dict[str, str], first: bytes, end: bool = False) -> None:
        self.start_stream_now(headers, first, end)

    async def write(self, data: bytes) -> None:
        self.start_stream_now({}, data)

    async def end_stream(self, last: bytes = b"") -> None:
        self.start_stream_now({}, last)

    def end_stream_now(self, last: bytes = b"") -> None:
        self.start_stream_now({}, last)


class EppStream:
    """One ext_proc stream: one HTTP request through Envoy."""

    __slots__ = ("state", "context", "headers", "subset", "duplex", "body_read", "path")

    def __init__(self, state: GatewayState, context: grpc.aio.ServicerContext) -> None:
        self.state, self.context = state, context
        self.headers: CIMultiDict = CIMultiDict()
        self.subset: list[str] | None = None
        # FULL_DUPLEX_STREAMED (the protocol's mode): Envoy streams the headers and body
        # without waiting and the picker answers both at the end. BUFFERED (for failing
        # open, which duplex mode cannot): Envoy waits for the headers' answer, then
        # sends the whole body, whose answer carries the destination.
        self.duplex = True
        self.body_read = False  # the request's body was read (and must be answered)
        self.path: str | None = None  # the canonical target the backend gets, when the request's differs

    async def read(self) -> Any:
        """The next message from Envoy, or ``None`` when Envoy closed its side."""
        msg = await self.context.read()
        return None if msg is grpc.aio.EOF else msg

    async def read_body(self, limit: int) -> bytes:
        """The request body, up to its end. Raises :class:`ClientError` 413 past
        ``limit`` bytes and 400 when Envoy ended the stream before the body's end."""
        body = bytearray()
        self.body_read = True
        if not self.duplex:  # Envoy sends the buffered body once its headers are answered
            await self.context.write(HEADERS_UNCHANGED)
        while True:
            msg = await self.read()
            if msg is None:
                raise ClientError(400, "The request body ended early.", code="invalid_request_body")
            kind = msg.WhichOneof("request")
            if kind == "request_body":
                body += msg.request_body.body
                if len(body) > limit:
                    raise ClientError(413, "Request body too large.")
                if msg.request_body.end_of_stream:
                    return bytes(body)
            elif kind == "request_trailers":
                return bytes(body)

    async def run(self) -> None:
        """Serve the stream: the request phase, then (:func:`hand_off`) the response phase."""
        state = self.state
        first = await self.read()
        if first is None or first.WhichOneof("request") != "request_headers":
            return
        arrival = state.loop.time()
        self.headers = headers = headers_of(first.request_headers)
        rid = request_id(headers)
        if first.HasField("protocol_config"):
            mode = first.protocol_config.request_body_mode
            if mode not in (ProcessingMode.FULL_DUPLEX_STREAMED, ProcessingMode.BUFFERED):
                log.error("endpoint picker: request_body_mode %s is not supported (FULL_DUPLEX_STREAMED or BUFFERED)",
                          ProcessingMode.BodySendMode.Name(mode))
                await self.immediate(500, error_body("The endpoint picker cannot serve this Envoy configuration.",
                                                     500, code="internal_error"), {SHOULD_RETRY_HEADER: "false"}, rid)
                return
            self.duplex = mode == ProcessingMode.FULL_DUPLEX_STREAMED
        self.subset = subset_hint(first)
        headers[REQUEST_ID_HEADER] = rid
        target = headers.get(":path", "")
        path = canonical_path(target)
        if path != target.split("?", 1)[0]:  # the backend gets the path that was matched
            self.path = path + (target[target.index("?"):] if "?" in target else "")
        api = COMPLETION_PATHS.get(path)
        if api is None or headers.get(":method") != "POST":
            return await self._other(first, rid, headers.get(":method", ""), path)
        down = EppDownstream(self)
        max_bytes = state.cfg.limits.max_body_bytes
        body: bytes | Any = b""
        if not first.request_headers.end_of_stream:
            async def body() -> bytes:
                return await self.read_body(max_bytes)
        names = self._subset_names()
        if state.tracer is not None:  # when Envoy traces, its ext_proc call's span is the request's parent
            state.tracer.prefer(headers, self.context.invocation_metadata() or ())
        await director.handle(state, api, headers, body, down, arrival, rid, send=hand_off, subset=names)
        if down.answer is not None and not down.started:
            await self.immediate(*down.answer, rid)

    def _subset_names(self) -> frozenset[str] | None:
        if self.subset is None:
            return None
        wanted = set(self.subset)
        return frozenset(c.state.name for c in self.state.clients.values() if c.endpoint in wanted)

    async def _other(self, first: Any, rid: str, method: str, path: str) -> None:
        """Not a completion: ``GET /health``, ``/ready``, the model list and the stored
        routes (:mod:`gateway.server.stored_routes`) are answered here, as the gateway's
        own data plane answers them; a path of ``listen.epp.pass_through_paths`` is
        authenticated (its JSON body held to ``limits.engine_fields``), then goes to the
        ready backend with the fewest requests in flight, nothing reserved; a completion
        path not POSTed is a 405; any other is refused (404); under ``/v1/`` a 401 comes
        first without a valid key; a refused request's body is not read."""
        state = self.state
        try:
            if method == "GET" and path in ("/health", "/ready"):
                return await self._probe(path, rid)
            caller = state.keyring.authenticate(self.headers) if path.startswith("/v1/") else None
            if method == "GET" and (path == "/v1/models" or path.startswith("/v1/models/")):
                return await self._models(path[len("/v1/models/"):], rid)
            if path in COMPLETION_PATHS:  # not a POST: as the gateway's own stacks answer it
                raise ClientError(405, f"Method {method} is not allowed on {path}.", headers={"Allow": "POST"})
            route = stored_routes.find(method, path)  # (405: a stored route's path, another method)
            if route is None and path not in state.cfg.listen.epp.pass_through_paths:
                raise ClientError(404, f"Unknown route {method} {path}: this gateway does not serve it behind "
                                       "Envoy (listen.epp.pass_through_paths lists the paths it passes on).",
                                  code="unknown_route")
            if caller is None:
                caller = state.keyring.authenticate(self.headers)
            state.limiter.acquire(caller.key, 0.0).release(dispatched=True)  # counts against the key's request rate
            body = b"" if first.request_headers.end_of_stream else await self.read_body(state.cfg.limits.max_body_bytes)
            if route is not None:  # what the gateway keeps (stored responses, conversations): from the store
                answer = await stored_routes.call(state, route, caller.name, self.headers.get(":path", ""), body)
                return await self.immediate(200, answer, {"Content-Type": "application/json"}, rid)
            if caller.held_back and body.lstrip()[:1] == b"{":
                try:
                    data = orjson.loads(body)
                except orjson.JSONDecodeError:
                    data = None
                if isinstance(data, dict):
                    body, _ = hold_back(body, data, caller.held_back, state.keyring.strip)
        except ClientError as e:
            return await self.immediate(*e.answer(rid), rid)
        log.info("endpoint picker: pass-through %s %s for key %s (request %s)", method, path, caller.name, rid)
        names = self._subset_names()
        now = self.state.loop.time()
        ready = [c for c in self.state.clients.values()
                 if (names is None or c.state.name in names) and c.state.healthy and not c.state.draining
                 and c.state.ready_at(now) <= now]
        if not ready:
            return await self.immediate(*ClientError(503, "No backend is available.",
                                                     code="no_backend_available").answer(rid), rid)
        client = min(ready, key=lambda c: c.state.in_flight)
        sets = {REQUEST_ID_HEADER: upstream_id(rid)}
        if client.auth_header:
            sets["authorization"] = client.auth_header
        await self.forward([client.endpoint], sets, body)
        while (msg := await self.read()) is not None:
            if await self.acknowledge(msg, {}):
                break

    async def _probe(self, path: str, rid: str) -> None:
        """``GET /health`` and ``GET /ready``, answered as the gateway's own data plane does."""
        state = self.state
        if path == "/health":
            return await self.immediate(200, b'{"status":"ok"}', {"Content-Type": "application/json"}, rid)
        up = sorted(b.name for b in state.fleet.backends.values() if b.healthy)
        ready = state.health is not None and state.health.ready()
        body = orjson.dumps({"status": "ready" if ready else "not ready", "healthy_backends": up})
        await self.immediate(200 if ready else 503, body, {"Content-Type": "application/json"}, rid)

    async def _models(self, name: str, rid: str) -> None:
        """``GET /v1/models`` (``name`` empty) or ``GET /v1/models/{name}``: the fleet's
        models, as the gateway's own data plane lists them."""
        state = self.state
        fleet = state.fleet
        if not name:
            obj = models_list([fleet.describe(m) for m in fleet.models()], state.created)
        elif name in fleet.by_model:
            obj = model_card(fleet.describe(name), state.created)
        else:
            raise ClientError(404, f"The model `{name}` does not exist or is not served by this gateway.",
                              param="model", code="model_not_found")
        await self.immediate(200, orjson.dumps(obj), {"Content-Type": "application/json"}, rid)

    async def immediate(self, status: int, body: bytes, headers: dict[str, str], rid: str) -> None:
        """Answer the client from here (Envoy sends no request upstream)."""
        mutation = pb.HeaderMutation(set_headers=[header_option(k, v) for k, v in headers.items()] +
                                     [header_option(REQUEST_ID_HEADER, rid)])
        await self.context.write(pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status), headers=mutation, body=body)))

    async def forward(self, endpoints: list[str], set_headers: dict[str, str], body: bytes) -> None:
        """Send the request on to ``endpoints[0]`` (the rest: Envoy's retry order),
        with the destination and ``set_headers`` among its headers and ``body`` as its
        body (when it had one). The caller's credentials (:data:`CALLER_CREDENTIALS`)
        are removed unless ``set_headers`` gives the backend's own; the path is the one that was matched."""
        md = struct_pb2.Struct()
        md.fields[LB_NAMESPACE].struct_value.fields[DESTINATION].string_value = ",".join(endpoints)
        sets = [header_option(DESTINATION, endpoints[0])] + [header_option(k, v) for k, v in set_headers.items()]
        if self.path is not None:
            sets.append(header_option(":path", self.path))
        if self.body_read:
            sets.append(header_option("content-length", str(len(body))))
        remove = [h for h in CALLER_CREDENTIALS if h not in set_headers]
        common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=sets, remove_headers=remove),
                                   clear_route_cache=True)
        if not self.body_read:
            await self.context.write(pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common),
                                                           dynamic_metadata=md))
        elif self.duplex:
            await self.context.write(pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common),
                                                           dynamic_metadata=md))
            await self.context.write(pb.ProcessingResponse(request_body=pb.BodyResponse(
                response=pb.CommonResponse(body_mutation=pb.BodyMutation(
                    streamed_response=pb.StreamedBodyResponse(body=body, end_of_stream=True))))))
        else:  # buffered: the headers wait for this answer to the body
            common.body_mutation.body = body
            await self.context.write(pb.ProcessingResponse(request_body=pb.BodyResponse(response=common),
                                                           dynamic_metadata=md))

    async def acknowledge(self, msg: Any, response_headers: dict[str, str], whole_body: bool = False,
                          rewrite: tuple[int, bytes, dict[str, str]] | None = None) -> bool:
        """Let a response-phase message go on unchanged (``response_headers`` added
        to the response's headers; ``whole_body``: Envoy is asked to send the body
        whole, buffered, :func:`~gateway.epp.ext_proc.error_body_mode`), or, with
        ``rewrite`` ``(status, body, headers)``, replace the whole body it carries and
        the response's status and headers. Returns whether it was Envoy's last message
        of the exchange (the response body's end, or its trailers): Envoy then closes
        the stream, and the picker ends its side without waiting for that close."""
        kind = msg.WhichOneof("request")
        if kind == "response_headers":
            mutation = pb.HeaderMutation(set_headers=[header_option(k, v) for k, v in response_headers.items()])
            answer = pb.ProcessingResponse(
                response_headers=pb.HeadersResponse(response=pb.CommonResponse(header_mutation=mutation)))
            if whole_body:
                answer.mode_override.CopyFrom(error_body_mode(self.duplex))
            await self.context.write(answer)
            return False
        if rewrite is not None:
            status, body, headers = rewrite
            mutation = pb.HeaderMutation(set_headers=[header_option(":status", str(status))] +
                                         [header_option(k, v) for k, v in headers.items()])
            await self.context.write(pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
                header_mutation=mutation, body_mutation=pb.BodyMutation(body=body)))))
        elif (ack := UNCHANGED.get(kind)) is not None:
            await self.context.write(ack)
        return kind == "response_trailers" or (kind == "response_body" and msg.response_body.end_of_stream)


async def hand_off(state: GatewayState, ctx: RequestContext, client: BackendClient,
                   reservation: Reservation) -> None:
    """The endpoint picker's attempt step (:data:`gateway.pipeline.director.Send`):
    hand the request routed to ``client``'s backend to Envoy, with the alternatives
    Envoy retries on, then follow the response phase and settle it: the breaker, the
    load model and the reservation learn what happened as behind the gateway's own
    data plane. Envoy retries by itself, so this never raises an
    :class:`~gateway.errors.UpstreamError`; raises ``CancelledError`` when Envoy reset
    the stream."""
    down = cast(EppDownstream, ctx.down)  # the picker's streams answer through it
    stream = down.stream
    epp = state.cfg.listen.epp
    primary = client.state
    req = ctx.request
    assert req is not None and ctx.decision is not None
    others = [c for b in state.core.alternatives(req, primary, state.loop.time(), epp.fallback_endpoints)
              if (c := state.clients.get(b.name)) is not None and c.auth_header == client.auth_header]
    endpoints = [client.endpoint] + [c.endpoint for c in others]
    # Envoy retries on the listed endpoints only: past them its fallback (round robin)
    # would choose a backend the picker keeps out of routing (cooling down, breaker open)
    sets = {REQUEST_ID_HEADER: upstream_id(ctx.request_id),
            MAX_RETRIES: str(min(len(endpoints), state.cfg.retries.max_attempts) - 1)}
    if client.auth_header:  # the backend's own key; the caller's never goes on
        sets["authorization"] = client.auth_header
    if ctx.trace is not None:  # the attempt's span, the engine's spans' parent
        sets.update(ctx.trace.carrier)
    await stream.forward(endpoints, sets, ctx.body)
    down.started = True
    served = Served(primary, reservation)
    try:
        while (msg := await stream.read()) is not None:
            kind = msg.WhichOneof("request")
            extra: dict[str, str] = {}
            rewrite = None
            if kind == "response_headers":
                extra = on_response_headers(state, ctx, served, msg)
            elif kind == "response_body" and not served.settled:
                body = msg.response_body
                if served.error is not None:  # an error answer, whole: an engine's caller error is rewritten
                    rewrite = on_error_body(state, ctx, served, body.body, body.end_of_stream)
                else:
                    on_response_body(state, ctx, served, body.body, body.end_of_stream)
            if await stream.acknowledge(msg, extra, served.error is not None, rewrite):
                break
        if not served.settled:  # Envoy closed its side before the body's end
            settle_closed(state, ctx, served)
    except asyncio.CancelledError:
        if not served.settled:
            settle_closed(state, ctx, served)
        raise
    finally:
        settlement.release(state, served.reservation)
