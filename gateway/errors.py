"""One home for failures: the OpenAI error body and the upstream exception hierarchy.

Client-facing errors are OpenAI-shaped::

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

Upstream failures are :class:`UpstreamError` subclasses; the retry loop reads
``retryable`` and ``retry_after_s``, the error mapper reads ``status``.
"""

from __future__ import annotations

import orjson
from aiohttp import web

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def error_body(message: str, status: int, *, code: str | None = None, param: str | None = None,
               type_: str | None = None) -> bytes:
    """The OpenAI error JSON for ``status`` as bytes."""
    etype = type_ or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return orjson.dumps({"error": {"message": message, "type": etype, "param": param, "code": code}})


def error_response(message: str, status: int, *, code: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    """An aiohttp JSON response carrying the OpenAI error body."""
    return web.Response(status=status, body=error_body(message, status, code=code, param=param),
                        content_type="application/json", headers=headers)


def sse_error_event(message: str, code: str) -> bytes:
    """The SSE event that ends a stream which failed after bytes reached the client
    (the shape vLLM and OpenAI use: a ``data:`` line holding an error object)."""
    return b"data: " + error_body(message, 502, code=code, type_="server_error") + b"\n\n"


class ClientError(Exception):
    """A request the caller got wrong; becomes a 4xx with an OpenAI error body."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers

    def response(self) -> web.Response:
        return error_response(self.message, self.status, code=self.code, param=self.param, headers=self.headers)


class UpstreamError(Exception):
    """One failed attempt against a backend.

    - ``reason``: short label for metrics (``connect``, ``ttft_timeout``, ``status_503``...).
    - ``status``: HTTP status to show the client if this is the final failure.
    - ``retryable``: whether the retry policy may try again.
    - ``retry_after_s``: the backend's ``Retry-After`` in seconds, if it sent one.
    """

    reason = "upstream"
    status = 502
    retryable = True

    def __init__(self, backend: str, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.backend = backend
        self.message = message
        self.retry_after_s = retry_after_s


class ConnectFailed(UpstreamError):
    """TCP connect or TLS handshake failed (refused, unreachable, DNS)."""

    reason = "connect"
    status = 502


class ConnectTimeout(UpstreamError):
    reason = "connect_timeout"
    status = 504


class FirstByteTimeout(UpstreamError):
    """No response body byte within ``ttft_s``."""

    reason = "ttft_timeout"
    status = 504


class IdleTimeout(UpstreamError):
    """A gap between two body chunks exceeded ``idle_s``."""

    reason = "idle_timeout"
    status = 504


class TotalTimeout(UpstreamError):
    reason = "total_timeout"
    status = 504


class Disconnected(UpstreamError):
    """The backend closed the connection or sent a truncated / malformed response."""

    reason = "disconnected"
    status = 502


class BackendStatus(UpstreamError):
    """The backend answered with a status other than 200. 429, 502, 503 and 504 are
    retryable; other 4xx and 5xx are relayed to the client as the backend sent them; a
    non-error status (204, 3xx: no completion) becomes a 502 (``backend_status`` keeps
    the backend's)."""

    RETRYABLE = frozenset({429, 502, 503, 504})

    def __init__(self, backend: str, status: int, body: bytes, content_type: str,
                 retry_after_s: float | None = None) -> None:
        super().__init__(backend, f"backend {backend} answered HTTP {status}", retry_after_s=retry_after_s)
        self.backend_status = status
        self.status = status
        self.body = body
        if status < 400:  # 204, 3xx, ... where a completion was due: the backend's fault, and no body to relay
            self.status, self.body = 502, b""
        self.content_type = content_type
        self.retryable = status in self.RETRYABLE
        self.reason = f"status_{status}"
