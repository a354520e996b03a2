"""OpenTelemetry traces: ``tracing`` (:mod:`gateway.ops.tracing`)."""

from __future__ import annotations

import importlib.util
from urllib.parse import urlsplit

from pydantic import (
    Field,
    field_validator,
)

from gateway.config.base import Strict

OTEL_EXTRA = "pip install 'turbo-gateway[otel]'"


class Tracing(Strict):
    """OpenTelemetry traces of every completion request, exported over OTLP/HTTP
    (JSON encoding). A key left unset takes the standard ``OTEL_*`` environment variable,
    then the SDK's default. Changing it needs a restart."""

    enabled: bool = Field(
        False, description="Trace completion requests (needs the `otel` extra: `" + OTEL_EXTRA + "`). Off: "
        "nothing of OpenTelemetry is imported. `OTEL_SDK_DISABLED=true` turns it off too.")
    endpoint: str | None = Field(
        None, description="The OTLP/HTTP traces URL, e.g. `http://otel-collector:4318/v1/traces`. Unset: "
        "`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, else `OTEL_EXPORTER_OTLP_ENDPOINT` + `/v1/traces`, else "
        "`http://localhost:4318/v1/traces`.")
    sample_ratio: float | None = Field(
        None, ge=0, le=1, description="Parent-based sampling: a request whose `traceparent` says sampled (or "
        "not) follows it; a request starting a trace is sampled at this ratio. Unset: `OTEL_TRACES_SAMPLER` "
        "and `OTEL_TRACES_SAMPLER_ARG`, else every request.")
    service_name: str | None = Field(
        None, min_length=1, description="The `service.name` of the spans. Unset: `OTEL_SERVICE_NAME`, else "
        "`turbo-gateway`.")
    record_key_name: bool = Field(
        False, description="Record the caller's key name (`auth.keys[].name`, never the key) on the request's "
        "span as `turbo.key.name`.")

    @field_validator("endpoint")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is not None:
            u = urlsplit(v)
            if u.scheme not in ("http", "https") or not u.hostname:
                raise ValueError(f"must be an http:// or https:// URL, not {v!r}")
        return v


def sdk_installed() -> bool:
    """Whether the OpenTelemetry SDK and its OTLP/JSON exporter can be imported (looked
    up, not imported: :func:`gateway.config.resolve.resolve` asks when tracing is on)."""
    try:
        return all(importlib.util.find_spec(m) is not None
                   for m in ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.json.http"))
    except ModuleNotFoundError:
        return False
