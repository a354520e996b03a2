"""The access log: one line per request at info level on the ``gateway.access`` logger.

A completion request's line is written when it is settled (:func:`completion`): its
id, route, status, model, the backend that answered, the time to its first byte, its
tokens and its duration; a request refused before it was routed (:func:`refused`)
gives its id, route, status and error code. Other routes get the method, path and
status (:func:`route`); the probes (``/health``, ``/ready``, ``/metrics``) only when
they fail. A line never carries a key, a header or any part of the body.
"""

from __future__ import annotations

import logging

from gateway.apis.registry import BY_NAME

log = logging.getLogger("gateway.access")

_ROUTES = {name: f"POST {api.path}" for name, api in BY_NAME.items()}
PROBES = frozenset({"/health", "/ready", "/metrics"})


def enabled() -> bool:
    return log.isEnabledFor(logging.INFO)


def completion(request_id: str, endpoint: str, status: int, model: str, backend: str, ttft_s: float | None,
               usage: tuple[int, int, int] | None, duration_s: float, attempts: int) -> None:
    """A settled completion request (status 499: the client left)."""
    if not log.isEnabledFor(logging.INFO):
        return
    ttft = f"{ttft_s * 1000:.0f}" if ttft_s is not None else "-"
    prompt, cached, completion_tokens = usage if usage is not None else ("-", "-", "-")
    log.info("request %s %s %d model=%s backend=%s ttft_ms=%s prompt_tokens=%s cached_tokens=%s "
             "completion_tokens=%s duration_ms=%.0f attempts=%d", request_id, _ROUTES.get(endpoint, endpoint),
             status, model, backend or "-", ttft, prompt, cached, completion_tokens, duration_s * 1000, attempts)


def refused(request_id: str, endpoint: str, status: int, code: str | None) -> None:
    """A completion request answered with an error before it was routed (its key, its
    body, its model, a limit)."""
    if log.isEnabledFor(logging.INFO):
        log.info("request %s %s %d error=%s", request_id, _ROUTES.get(endpoint, endpoint), status, code or "-")


def route(request_id: str, method: str, path: str, status: int) -> None:
    """A request to any other route (the probes only when they fail)."""
    if log.isEnabledFor(logging.INFO) and (status >= 400 or path not in PROBES):
        log.info("request %s %s %s %d", request_id, method, path, status)
