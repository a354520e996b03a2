"""The vocabulary of Envoy's ``ext_proc`` protocol as the endpoint picker speaks it
(:mod:`gateway.epp.picker`; :mod:`gateway.epp.envoy_config` configures Envoy with the
same names): the service, headers and metadata names, the readers of Envoy's messages
and the builders of the picker's answers.
"""

from __future__ import annotations

from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from multidict import CIMultiDict

from gateway.apis.registry import BY_PATH

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
MAX_RETRIES = "x-envoy-max-retries"  # the request's retries, set by the picker (Envoy's router reads it)
UPSTREAM_ADDRESS = "upstream.address"  # the ext_proc response attribute naming the endpoint that answered
COMPLETION_PATHS = BY_PATH  # the APIs the picker routes (gateway/apis/registry.py): canonical path -> adapter
ANSWERED_PATHS = ("/health", "/ready", "/v1/models", "/v1/conversations")  # answered by the picker itself
# and every path under these: /v1/models/{id}, the stored routes (gateway.server.stored_routes)
ANSWERED_PREFIXES = ("/v1/models", "/v1/responses", "/v1/conversations")
# headers that carry the caller's credentials: never passed on to a backend
CALLER_CREDENTIALS = ("authorization", "x-api-key", "cookie", "proxy-authorization")


def headers_of(msg: Any) -> CIMultiDict:
    """A headers message's fields as a case-insensitive mapping."""
    out: CIMultiDict = CIMultiDict()
    for h in msg.headers.headers:
        out.add(h.key, h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value)
    return out


def header_option(key: str, value: str) -> base_pb2.HeaderValueOption:
    """A header to set (replacing one of the same name)."""
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
                                      append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def _struct_str(s: Any, *path: str) -> str | None:
    """The string at ``path`` in a ``google.protobuf.Struct`` map, or ``None``."""
    for i, key in enumerate(path):
        if key not in s.fields:
            return None
        v = s.fields[key]
        if i == len(path) - 1:
            if v.HasField("string_value"):
                return v.string_value
            if v.HasField("list_value"):
                return ",".join(x.string_value for x in v.list_value.values if x.HasField("string_value"))
            return None
        if not v.HasField("struct_value"):
            return None
        s = v.struct_value
    return None


def subset_hint(msg: Any) -> list[str] | None:
    """The endpoints of the request's subset hint (``None`` when it has none)."""
    md = msg.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in md:
        return None
    value = _struct_str(md[SUBSET_NAMESPACE], SUBSET)
    if value is None:
        return None
    return [e.strip() for e in value.split(",") if e.strip()]


def served_endpoint(msg: Any) -> str | None:
    """The endpoint that answered, from a response-phase message: the metadata the
    protocol names, else Envoy's ``upstream.address`` attribute."""
    md = msg.metadata_context.filter_metadata
    if LB_NAMESPACE in md:
        value = _struct_str(md[LB_NAMESPACE], SERVED)
        if value:
            return value
    for attrs in msg.attributes.values():
        value = _struct_str(attrs, UPSTREAM_ADDRESS)
        if value:
            return value
    return None


# The answers that let a message go on unchanged, built once: they never vary, and each
# would otherwise be constructed per message (per response chunk with response bodies on).
UNCHANGED = {
    "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()),
    "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),
    "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
}
HEADERS_UNCHANGED = pb.ProcessingResponse(request_headers=pb.HeadersResponse())


def error_body_mode(duplex: bool) -> ProcessingMode:
    """The processing mode the picker asks for (``mode_override``, in its answer to the
    response headers) when a completion's answer is an error it may rewrite: the
    response body buffered, sent whole in one message while Envoy holds the headers;
    the request's modes as they were (``duplex``: ``FULL_DUPLEX_STREAMED``)."""
    return ProcessingMode(
        request_body_mode=ProcessingMode.FULL_DUPLEX_STREAMED if duplex else ProcessingMode.BUFFERED,
        request_trailer_mode=ProcessingMode.SEND if duplex else ProcessingMode.SKIP,
        response_body_mode=ProcessingMode.BUFFERED)
