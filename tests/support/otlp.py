"""An OTLP/HTTP traces receiver for the tests (:class:`OtlpReceiver`): a real HTTP server
on 127.0.0.1 decoding what the OpenTelemetry SDK's exporter sends (OTLP/JSON), and the
helpers that read the span trees it kept."""

from __future__ import annotations

import base64
import gzip
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent: str
    kind: int
    attrs: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    status: int
    start: int
    end: int
    resource: dict[str, Any] = field(default_factory=dict)


def value_of(v: dict[str, Any]) -> Any:
    """An OTLP/JSON ``AnyValue`` as Python (``intValue`` is a decimal string there)."""
    for kind, got in v.items():
        if kind == "intValue":
            return int(got)
        if kind == "arrayValue":
            return [value_of(x) for x in got.get("values", [])]
        return got
    return None


def attrs_of(items: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {a["key"]: value_of(a.get("value", {})) for a in items or ()}


@dataclass
class OtlpReceiver:
    """An OTLP/HTTP traces endpoint (``POST /v1/traces``) keeping every span: JSON, as the
    gateway's exporter sends it, or protobuf, as Envoy's does."""

    spans: list[Span] = field(default_factory=list)
    url: str = ""
    exports: int = 0  # export requests received

    async def _traces(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        req = json.loads(body) if request.content_type == "application/json" else _from_protobuf(body)
        for rs in req.get("resourceSpans", []):
            resource = attrs_of(rs.get("resource", {}).get("attributes"))
            for ss in rs.get("scopeSpans", []):
                for s in ss.get("spans", []):
                    self.spans.append(Span(
                        s["name"], s["traceId"], s["spanId"], s.get("parentSpanId", ""), s["kind"],
                        attrs_of(s.get("attributes")),
                        [(e["name"], attrs_of(e.get("attributes"))) for e in s.get("events", [])],
                        s.get("status", {}).get("code", 0), int(s["startTimeUnixNano"]),
                        int(s["endTimeUnixNano"]), resource))
        self.exports += 1
        return web.json_response({})

    @asynccontextmanager
    async def running(self) -> AsyncIterator[OtlpReceiver]:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/traces"
        try:
            yield self
        finally:
            await runner.cleanup()


def _from_protobuf(body: bytes) -> dict[str, Any]:
    """An OTLP protobuf export as its OTLP/JSON form (ids in hex, not base64)."""
    from google.protobuf.json_format import MessageToDict
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    req = MessageToDict(ExportTraceServiceRequest.FromString(body), use_integers_for_enums=True)
    for rs in req.get("resourceSpans", []):
        # field 2 of ResourceSpans is `scope_spans`; the older OTLP schema that xds-protos
        # installs as opentelemetry.proto names the same field `instrumentation_library_spans`
        if "instrumentationLibrarySpans" in rs:
            rs["scopeSpans"] = rs.pop("instrumentationLibrarySpans")
        for ss in rs.get("scopeSpans", []):
            for s in ss.get("spans", []):
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in s:
                        s[key] = base64.b64decode(s[key]).hex()
    return req


def children(spans: list[Span], parent: Span) -> list[Span]:
    return sorted((s for s in spans if s.parent == parent.span_id), key=lambda s: s.start)


def strings(spans: list[Span]) -> list[str]:
    out = []
    for s in spans:
        out += [s.name, *map(str, s.attrs.values()), *map(str, s.resource.values())]
        for name, attrs in s.events:
            out += [name, *map(str, attrs.values())]
    return out




def tracing_config(receiver: OtlpReceiver, **extra: Any) -> dict[str, Any]:
    """The ``tracing`` section of a gateway exporting to ``receiver``."""
    return {"enabled": True, "endpoint": receiver.url, "service_name": "gw-under-test", **extra}
