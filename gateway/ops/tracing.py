"""OpenTelemetry traces of completion requests (``tracing`` in ``backends.yaml``).

Imported only when ``tracing.enabled`` (by the app's start, :func:`start`): with tracing
off, no module of OpenTelemetry is loaded and the pipeline's only cost is an ``is None``
test of ``state.tracer`` and ``ctx.trace`` at each step.

One request is one trace (:class:`RequestTrace`, ``ctx.trace``), a tree of spans::

    POST /v1/chat/completions      SERVER, the request (parent: the caller's traceparent)
    ├── admission                  the limits, the batch gate, the admission queue's wait
    ├── prefill                    the prefill leg of a disaggregated request
    │   ├── route                  the decision: policy, backend, reason, evidence, pool
    │   └── chat {model}           CLIENT, one prefill attempt
    ├── route                      one per attempt
    ├── chat {model}               CLIENT, one per attempt: retries and fallbacks are siblings
    │   └── relay                  first byte to the client .. end; events first_token, end
    └── ...

Attributes follow the OpenTelemetry GenAI semantic conventions (``gen_ai.operation.name``,
``gen_ai.request.model``, ``gen_ai.response.id``, ``gen_ai.usage.input_tokens``,
``gen_ai.usage.output_tokens``, ``server.address``); the gateway's own are under
``turbo.``. No prompt or completion text, no header and no key is ever recorded (the
key's name only with ``tracing.record_key_name``). The caller's ``traceparent`` and
``tracestate`` are honoured through the SDK's propagators (``OTEL_PROPAGATORS``; W3C
trace context and baggage by default), and each attempt sends the backend its own
``traceparent``, so that the engine's spans join the trace. An unsampled request makes
no span below its root but still propagates its (unsampled) trace context.

While a request's span is current, log records carry ``trace_id`` and ``span_id``
(hex), which the JSON log lines print (:mod:`gateway.server.run`). A sampled request's
TTFT and end-to-end times are its histograms' exemplars, labelled with its ``trace_id``
(``/metrics`` in the OpenMetrics format shows them).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Awaitable, Iterable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.exporter.otlp.json.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, StatusCode

from gateway.config import Tracing as TracingConfig
from gateway.errors import BackendStatus, UpstreamError

if TYPE_CHECKING:
    from gateway.apis.base import Api
    from gateway.pipeline.openai_request import ParsedRequest
    from routing.core import Decision

log = logging.getLogger("gateway.tracing")

DEFAULT_SERVICE_NAME = "turbo-gateway"
# the response's own id: the first "id" member of its JSON, a plain token (never text)
_RESPONSE_ID = re.compile(rb'[{,]\s*"id"\s*:\s*"([A-Za-z0-9_.:-]{1,128})"')
_ID_SCAN_BYTES = 4096


def disabled_by_env() -> bool:
    """``OTEL_SDK_DISABLED=true``: the standard switch that turns the SDK off."""
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


class Tracer:
    """One gateway's tracer provider: its spans go through a batching processor (a
    thread of the SDK) to ``exporter`` (default: OTLP/HTTP at ``cfg.endpoint``, else
    the ``OTEL_EXPORTER_OTLP_*`` variables). ``loop``: the loop serving requests, whose
    clock the pipeline's times are read on."""

    def __init__(self, cfg: TracingConfig, loop: asyncio.AbstractEventLoop, version: str = "unknown",
                 exporter: SpanExporter | None = None) -> None:
        self.cfg = cfg
        self.loop = loop
        name = cfg.service_name or os.environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME
        sampler = ParentBased(TraceIdRatioBased(cfg.sample_ratio)) if cfg.sample_ratio is not None else None
        self.provider = TracerProvider(sampler=sampler,  # None: OTEL_TRACES_SAMPLER, else parent-based always-on
                                       resource=Resource.create({SERVICE_NAME: name, SERVICE_VERSION: version}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter or OTLPSpanExporter(endpoint=cfg.endpoint)))
        self.tracer = self.provider.get_tracer("turbo-gateway", version)
        _correlate_logs()

    def request(self, api: Api, headers: Mapping[str, str], request_id: str) -> RequestTrace:
        """The trace of one request of ``api`` (its adapter) whose head ``headers``
        arrived now; its span is current until :meth:`RequestTrace.end`."""
        return RequestTrace(self, api, headers, request_id)

    def prefer(self, headers: MutableMapping[str, str], outer: Iterable[tuple[str, str | bytes]]) -> None:
        """Let the trace context in ``outer`` (the fields of the propagators, e.g.
        ``traceparent`` and ``tracestate``), when it has one, stand for the one in
        ``headers`` (a request's, changed in place): the endpoint picker's ext_proc
        call carries Envoy's own span, a descendant of the caller's, when Envoy traces."""
        fields = propagate.get_global_textmap().fields
        found = {k.lower(): v for k, v in outer if isinstance(v, str) and k.lower() in fields}
        if found:
            for k in fields:
                if k in headers:
                    del headers[k]  # every value of it, in a multidict
            headers.update(found)

    def epoch_ns(self, t: float) -> int:
        """Loop time ``t`` as nanoseconds since the epoch (what span times are in)."""
        return time.time_ns() - int((self.loop.time() - t) * 1e9)

    async def shutdown(self) -> None:
        """Export what is still buffered and stop (in a thread: the export is blocking
        I/O, and a collector may run on this loop)."""
        await asyncio.to_thread(self.provider.shutdown)


class RequestTrace:
    """The spans of one request (see the module doc). Every method is a no-op past
    the root when the request is not sampled."""

    __slots__ = ("attempt", "attempts", "carrier", "exemplar_labels", "leg", "operation", "propagation", "recording",
                 "relay", "root", "root_context", "token", "tracer")

    def __init__(self, tracer: Tracer, api: Api, headers: Mapping[str, str], request_id: str) -> None:
        self.tracer, self.operation = tracer, api.operation
        route = api.path
        parent = propagate.extract(headers)
        self.root = tracer.tracer.start_span(
            f"POST {route}", parent, SpanKind.SERVER,
            {"http.request.method": "POST", "http.route": route, "gen_ai.operation.name": api.operation,
             "turbo.request_id": request_id})
        self.root_context = trace.set_span_in_context(self.root, parent)
        self.token = otel_context.attach(self.root_context)
        self.recording = self.root.is_recording()
        # a sampled request's latencies point at its trace (OpenMetrics exemplars)
        self.exemplar_labels = {"trace_id": trace.format_trace_id(self.root.get_span_context().trace_id)} \
            if self.recording else None
        self.leg: Span | None = None  # the prefill leg, while it runs: its attempts' parent
        self.attempt: Span | None = None  # the current attempt
        self.relay: Span | None = None
        self.attempts = 0
        self.carrier: dict[str, str] = {}  # the current attempt's trace context as headers (see attempt_began)
        self.propagation = b""  # the same, as HTTP/1.1 header lines

    # --- the director -----------------------------------------------------------------------------

    async def admission(self, admitting: Awaitable[float], parsed: ParsedRequest, key_name: str) -> float:
        """Record what the request asks (``parsed``: model, stream, ``max_tokens``; the
        caller's ``key_name`` with ``tracing.record_key_name``), then await
        ``admitting`` (:meth:`gateway.pipeline.admit.Ticket.admit`, returning the
        arrival time) in the ``admission`` span. Raises what it raises."""
        if not self.recording:
            return await admitting
        attrs: dict[str, Any] = {"gen_ai.request.model": parsed.model, "turbo.request.stream": parsed.stream}
        if parsed.max_tokens is not None:
            attrs["gen_ai.request.max_tokens"] = parsed.max_tokens
        if self.tracer.cfg.record_key_name:
            attrs["turbo.key.name"] = key_name
        self.root.set_attributes(attrs)
        span = self.tracer.tracer.start_span("admission", self.root_context)
        try:
            return await admitting
        except BaseException as e:
            _failed(span, getattr(e, "code", None) or type(e).__name__)
            raise
        finally:
            span.end()

    def refused(self, status: int, code: str | None) -> None:
        """The request was answered with an error before it was routed."""
        self.root.set_attribute("http.response.status_code", status)
        _failed(self.root, code or str(status))

    def crashed(self, e: BaseException) -> None:
        """The gateway hit an internal error serving it (answered 500)."""
        self.root.set_attribute("http.response.status_code", 500)
        _failed(self.root, type(e).__qualname__)

    def end(self) -> None:
        """The request is over: its spans end, its context is no longer current."""
        for span in (self.relay, self.attempt, self.leg):
            if span is not None:
                span.end()
        self.relay = self.attempt = self.leg = None
        self.root.set_attribute("turbo.attempts", self.attempts)
        self.root.end()
        otel_context.detach(self.token)

    # --- route, attempt, prefill leg ----------------------------------------------------------------

    def attempt_began(self, decision: Decision, pool: str, since: float, model: str, host: str, port: int) -> None:
        """The decision core chose ``decision`` (a backend of ``pool`` at ``host``:``port``)
        for ``model``, having started at loop time ``since`` (the ``route`` span), and an
        attempt there begins (its CLIENT span). :attr:`carrier` is then the headers
        that carry the attempt's trace context to the backend (``traceparent``, and
        ``tracestate`` when the caller sent one), and :attr:`propagation` the same as
        header lines."""
        self.attempts += 1
        if not self.recording:
            if not self.propagation:
                self._propagate(self.root_context)
            return
        d = decision.detail
        backend = decision.backend.name
        attrs: dict[str, Any] = {"turbo.route.policy": decision.policy, "turbo.route.backend": backend,
                                 "turbo.route.reason": decision.reason, "turbo.route.pool": pool,
                                 "turbo.route.evidence": decision.evidence, "gen_ai.request.model": model,
                                 "turbo.route.matched_tokens": int(d.get("matched_tokens", 0))}
        if "ttft_est_s" in d:
            attrs["turbo.route.ttft_est_s"] = float(d["ttft_est_s"])
        if "metrics_stale" in d:
            attrs["turbo.route.metrics_stale"] = True
        tracer, parent = self.tracer.tracer, self._parent()
        tracer.start_span("route", parent, attributes=attrs, start_time=self.tracer.epoch_ns(since)).end()
        if self.attempt is not None:  # a step that raised past its end
            self.attempt.end()
        op = self.operation
        self.attempt = span = tracer.start_span(
            f"{op} {model}", parent, SpanKind.CLIENT,
            {"gen_ai.operation.name": op, "gen_ai.request.model": model, "server.address": host, "server.port": port,
             "turbo.backend": backend, "turbo.attempt": self.attempts,
             "turbo.leg": "prefill" if self.leg is not None else "serve"})
        self._propagate(trace.set_span_in_context(span, self.root_context))

    def attempt_ended(self, err: UpstreamError | None = None) -> None:
        """The current attempt ended: answered (``err`` None), or failed with ``err``
        (a no-op once it was ended)."""
        span = self.attempt
        if span is None:
            return
        if self.relay is not None:  # the stream broke after its first byte
            if err is not None:
                self.relay.add_event("end", {"error.type": err.reason})
                _failed(self.relay, err.reason)
            self.relay.end()
            self.relay = None
        if err is not None:
            if isinstance(err, BackendStatus):
                span.set_attribute("http.response.status_code", err.status)
            _failed(span, err.reason)
        span.end()
        self.attempt = None

    def leg_began(self) -> None:
        """The prefill leg of a disaggregated request begins: its attempts are the
        ``prefill`` span's children."""
        if self.recording:
            self.leg = self.tracer.tracer.start_span("prefill", self.root_context)

    def leg_ended(self, ok: bool) -> None:
        """The prefill leg ended: its KV goes to a decode backend (``ok``), or the
        request falls back to a backend that computes the prompt itself."""
        if self.leg is not None:
            self.leg.set_attribute("turbo.prefill.outcome", "ok" if ok else "fallback")
            self.leg.end()
            self.leg = None

    def _propagate(self, ctx: otel_context.Context) -> None:
        """:attr:`carrier` and :attr:`propagation`: ``ctx``'s trace context, through the
        propagators (a value with a line break, which they never make, is left out)."""
        carrier: dict[str, str] = {}
        propagate.inject(carrier, ctx)
        self.carrier = {k: v for k, v in carrier.items() if "\r" not in v and "\n" not in v and "\x00" not in v}
        self.propagation = "".join([f"{k}: {v}\r\n" for k, v in self.carrier.items()]).encode("latin-1", "replace")

    def _parent(self) -> otel_context.Context:
        return trace.set_span_in_context(self.leg, self.root_context) if self.leg is not None else self.root_context

    # --- settlement ----------------------------------------------------------------------------------

    def first_token(self, at: float, ttft_s: float, head: bytes) -> None:
        """The answer's first byte went to the client at loop time ``at`` (``ttft_s``
        after the request arrived); ``head``: the answer's first bytes (its id is read
        from them, nothing else). Opens the ``relay`` span."""
        if not self.recording:
            return
        m = _RESPONSE_ID.search(head, 0, _ID_SCAN_BYTES) if head else None
        if m is not None:
            rid = m.group(1).decode()
            self.root.set_attribute("gen_ai.response.id", rid)
            if self.attempt is not None:
                self.attempt.set_attribute("gen_ai.response.id", rid)
        start = self.tracer.epoch_ns(at)
        parent = trace.set_span_in_context(self.attempt, self.root_context) if self.attempt is not None \
            else self.root_context
        self.relay = span = self.tracer.tracer.start_span("relay", parent, start_time=start)
        span.add_event("first_token", {"turbo.ttft_s": ttft_s}, timestamp=start)

    def exemplar(self, value: float, *histograms: Any) -> None:
        """``value`` (seconds), observed in ``histograms`` (children of
        :class:`gateway.ops.request_metrics.RequestMetric`) already, becomes their
        exemplar, labelled with the trace id, when the request is sampled."""
        if self.exemplar_labels is not None:
            for h in histograms:
                h.exemplar(value, self.exemplar_labels)

    def finish(self, status: int, model: str, usage: tuple[int, int, int] | None, fallback_reason: str) -> None:
        """The request was settled with ``status`` (499: the client left) by ``model``
        (a fallback when ``fallback_reason``), having used ``usage`` (prompt, cached
        prompt, completion tokens; None when it did not complete)."""
        if not self.recording:
            return
        attrs: dict[str, Any] = {"http.response.status_code": status}
        if usage is not None:
            attrs["gen_ai.usage.input_tokens"] = usage[0]
            attrs["gen_ai.usage.cache_read.input_tokens"] = usage[1]
            attrs["gen_ai.usage.output_tokens"] = usage[2]
        for span in (self.attempt, self.root):
            if span is not None:
                span.set_attributes(attrs)
        if fallback_reason:
            self.root.set_attributes({"turbo.fallback.model": model, "turbo.fallback.reason": fallback_reason})
        if self.relay is not None:
            self.relay.add_event("end", {"http.response.status_code": status})
            if status != 200:
                self.relay.set_status(StatusCode.ERROR)
            self.relay.end()
            self.relay = None
        if status != 200:
            _failed(self.root, "client_closed" if status == 499 else str(status))


def _failed(span: Span, error_type: str) -> None:
    span.set_attribute("error.type", error_type)
    span.set_status(StatusCode.ERROR)


_log_factory_installed = False


def _correlate_logs() -> None:
    """Log records made while a span is current carry its ``trace_id`` and ``span_id``
    (hex), once per process."""
    global _log_factory_installed  # noqa: PLW0603 - the record factory is process-wide
    if _log_factory_installed:
        return
    _log_factory_installed = True
    make = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        sc = trace.get_current_span().get_span_context()
        if sc.is_valid:
            record.trace_id = format(sc.trace_id, "032x")
            record.span_id = format(sc.span_id, "016x")
        return record

    logging.setLogRecordFactory(factory)


def start(cfg: TracingConfig, loop: asyncio.AbstractEventLoop, version: str = "unknown") -> Tracer | None:
    """The gateway's tracer for ``cfg`` (enabled), or None when ``OTEL_SDK_DISABLED``."""
    if disabled_by_env():
        log.warning("tracing.enabled is set but OTEL_SDK_DISABLED=true: not tracing")
        return None
    return Tracer(cfg, loop, version)
