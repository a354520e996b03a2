"""One home for failures: the OpenAI error body, the caller's errors, the one upstream
exception hierarchy and the mapping of a final failure to the client's answer.

Client-facing errors are OpenAI-shaped::

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

Upstream failures are :class:`UpstreamError` subclasses, raised where they happen (the
transport raises :class:`ConnectFailed`, :class:`ConnectTimeout`, :class:`Disconnected`
and the timeouts its deadline was armed with); the retry policy reads ``retryable`` and
``retry_after_s``, :func:`failure_answer` reads ``status``.
"""

from __future__ import annotations

import math

import orjson
from aiohttp import web

from routing.core import RETRYABLE_STATUSES

REQUEST_ID_HEADER = "x-request-id"
BACKEND_HEADER = "x-turbo-backend"
# the openai SDKs retry 408, 409, 429 and 5xx by themselves unless the answer says
# otherwise: "false" where the gateway has retried already (or retrying cannot help),
# "true" with the wait where a retry by the client is the right thing
SHOULD_RETRY_HEADER = "x-should-retry"


def retry_later_headers(wait_s: float) -> dict[str, str]:
    """The headers of an answer the client should retry after ``wait_s`` seconds:
    ``Retry-After`` (whole seconds, at least 1), ``retry-after-ms`` and
    ``x-should-retry: true``, which the openai SDKs all honour."""
    return {"Retry-After": str(max(1, math.ceil(wait_s))), "retry-after-ms": str(max(1, math.ceil(wait_s * 1000))),
            SHOULD_RETRY_HEADER: "true"}


def reason(e: BaseException) -> str:
    """An exception in words for a log line, never empty (a timeout's own text is)."""
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


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
    """An aiohttp JSON response carrying the OpenAI error body; it says
    ``x-should-retry: false`` unless ``headers`` say otherwise."""
    return web.Response(status=status, body=error_body(message, status, code=code, param=param),
                        content_type="application/json", headers={SHOULD_RETRY_HEADER: "false", **(headers or {})})


def internal_error_answer(request_id: str) -> tuple[int, bytes, dict[str, str]]:
    """The answer to a request the gateway failed on itself (a bug, logged with its
    traceback): 500 ``internal_error``, not worth an SDK's retries."""
    return 500, error_body("The gateway hit an internal error.", 500, code="internal_error"), {
        "Content-Type": "application/json", REQUEST_ID_HEADER: request_id, SHOULD_RETRY_HEADER: "false"}


def stream_error_body(message: str, code: str) -> bytes:
    """The error that ends a stream which failed after bytes reached the client (an
    OpenAI error object, as vLLM ends a broken stream with one)."""
    return error_body(message, 502, code=code, type_="server_error")


class ClientError(Exception):
    """A request the caller got wrong (or, 503, one the gateway cannot take now);
    becomes a 4xx with an OpenAI error body, ``x-should-retry: false`` unless
    ``headers`` say otherwise (a retry-after refusal says ``true``)."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers

    def answer(self, request_id: str | None = None) -> tuple[int, bytes, dict[str, str]]:
        """The client's answer: status, OpenAI error body, headers (with
        ``x-request-id`` when given)."""
        h = dict(self.headers or {})
        h["Content-Type"] = "application/json"
        h.setdefault(SHOULD_RETRY_HEADER, "false")
        if request_id is not None:
            h.setdefault(REQUEST_ID_HEADER, request_id)
        return self.status, error_body(self.message, self.status, code=self.code, param=self.param), h

    def response(self) -> web.Response:
        status, body, headers = self.answer()
        return web.Response(status=status, body=body, headers=headers)


def unknown_route(method: str, path: str) -> ClientError:
    """404 ``unknown_route`` for a path the gateway does not serve, naming what it does."""
    return ClientError(404, f"Unknown route {method} {path}. This gateway serves the OpenAI API under /v1/ "
                       "(chat/completions, completions, responses, embeddings, rerank, score, models, usage; files "
                       "and batches with batch.enabled), Anthropic's /v1/messages, /health, /ready and /metrics; "
                       "every route is listed at GET /openapi.json.",
                       code="unknown_route")


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


class AdapterLoadFailed(UpstreamError):
    """The backend did not load the LoRA adapter the request needs on demand
    (``POST /v1/load_lora_adapter`` failed or timed out); another backend may."""

    reason = "lora_load"
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
    """The backend closed the connection or sent a truncated / malformed response.
    ``got_bytes``: whether any byte of the response had arrived (a reused connection
    closed before that is retried once on a new one: the backend never saw it)."""

    reason = "disconnected"
    status = 502

    def __init__(self, backend: str, message: str, *, got_bytes: bool = True) -> None:
        super().__init__(backend, message)
        self.got_bytes = got_bytes


class ProxyRetried(UpstreamError):
    """Behind Envoy (:mod:`gateway.epp.picker`): the request was served by another backend
    than the one picked, so the picked one failed before answering, for a reason only
    the proxy saw (refused, reset, a 5xx)."""

    reason = "proxy_retry"


class BackendStatus(UpstreamError):
    """The backend answered with a status other than 200. 429, 502, 503 and 504 are
    retryable; other 4xx and 5xx are relayed to the client as the backend sent them; a
    non-error status (204, 3xx: no completion) becomes a 502 (``backend_status`` keeps
    the backend's).

    ``openai``: the engine's caller error in OpenAI's terms, ``(status, body, code)``
    from :func:`gateway.pipeline.engine_errors.classify`. The answer then carries that status
    (400, or 404 for ``model_not_found``) and OpenAI error body, ``code`` is the OpenAI
    code (``context_length_exceeded``, ``invalid_value``,
    ``invalid_function_parameters``, ``model_not_found``; ``None`` when not
    classified) and it is not retryable: another backend of the model would fail the
    same way. ``reason`` stays ``status_<the backend's status>``."""

    RETRYABLE = RETRYABLE_STATUSES  # routing.retry: one retryable set for every retry loop
    code: str | None = None

    def __init__(self, backend: str, status: int, body: bytes, content_type: str,
                 retry_after_s: float | None = None, openai: tuple[int, bytes, str] | None = None) -> None:
        super().__init__(backend, f"backend {backend} answered HTTP {status}", retry_after_s=retry_after_s)
        self.backend_status = status
        self.status = status
        self.body = body
        if status < 400:  # 204, 3xx, ... where a completion was due: the backend's fault, and no body to relay
            self.status, self.body = 502, b""
        self.content_type = content_type
        self.retryable = status in self.RETRYABLE
        self.reason = f"status_{status}"
        if openai is not None:
            self.status, self.body, self.code = openai
            self.content_type = "application/json"
            self.retryable = False


class ApiNotServed(BackendStatus):
    """``backend`` has no route for the request's API ``api`` on ``model`` (it answered
    the API's path with a 404 not about the model, or with llama.cpp's 501 for an API
    it was not started for; ``backend`` empty: no backend of the
    model serves it): another backend may (:mod:`gateway.apis.support`), so it is
    retryable, and not the backend's fault (its breaker is untouched). When none
    serves it the client gets a 404 ``api_not_served``."""

    def __init__(self, backend: str, api: str, model: str) -> None:
        message = (f"No backend of model `{model}` serves the {api} API." if not backend
                   else f"Backend {backend} has no route for the {api} API.")
        super().__init__(backend, 404, error_body(message, 404, code="api_not_served"), "application/json")
        self.message = message
        self.retryable = bool(backend)
        self.reason = "api_not_served"


def _retry_after_header(seconds: float) -> str:
    return str(max(int(seconds + 0.999), 1))


def failure_answer(err: UpstreamError | None, no_backend_message: str | None = None,
                   no_backend_retry_after_s: float | None = None) -> tuple[int, bytes, dict[str, str]]:
    """The client's answer (status, OpenAI error body, headers) to a request that
    failed for good: ``err`` the last attempt's failure, or, with ``err`` ``None``, no
    backend could be tried (``no_backend_message``, and the wait until one may be).
    A backend's own error answer is relayed as it sent it when it is a JSON object.
    The gateway has retried already, or found that retrying cannot help: the answer
    says ``x-should-retry: false`` (a ``Retry-After`` it carries is the backend's)."""
    headers = {"Content-Type": "application/json", SHOULD_RETRY_HEADER: "false"}
    if isinstance(err, BackendStatus):
        if err.retry_after_s is not None:
            headers["Retry-After"] = _retry_after_header(err.retry_after_s)
        body = err.body
        try:
            ok = isinstance(orjson.loads(body), dict)
        except orjson.JSONDecodeError:
            ok = False
        if not ok:
            body = error_body(f"Backend {err.backend} answered HTTP {err.backend_status}.", err.status,
                              code=f"backend_status_{err.backend_status}")
        return err.status, body, headers
    if err is not None:
        return err.status, error_body(err.message, err.status, code=err.reason), headers
    if no_backend_retry_after_s is not None:
        headers["Retry-After"] = _retry_after_header(no_backend_retry_after_s)
    return 503, error_body(no_backend_message or "No backend is available.", 503, code="no_backend_available"), headers
