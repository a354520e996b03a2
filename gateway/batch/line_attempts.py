"""One batch line's attempts: :func:`run_with_retries`.

Up to ``max_attempts`` attempts of at most ``request_timeout_s`` each, full-jitter
exponential backoff between them (:class:`gateway.pipeline.retry.Retrier`, the gateway's
one retry executor); connect errors, timeouts and the one retryable set of
:mod:`routing.retry` (429, 502, 503, 504) are retried, other statuses are final (the
gateway already retried its backends' failures behind them). A ``batch_deferred``
answer (no spare capacity) or ``rate_limit_exceeded`` (the owner's key at its limits:
in-process lines pass the owner's limits and admission as any request of that key) is
waited out and not counted. The final failure goes to the error file: the backend's
HTTP status and error body as ``response``, or ``error`` ``{code, message}`` when no
answer came.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp
import orjson

from gateway.batch.batch_gate import DEFERRED_CODE
from gateway.batch.output_lines import output_line
from gateway.pipeline.retry import Retrier, RetryPolicy, retryable_status
from gateway.store.background_sync import raise_if_cancel_swallowed

log = logging.getLogger("gateway.batch")

LIMITED_CODE = "rate_limit_exceeded"  # the gateway's per-key limits (gateway.tenancy.limits)
MAX_LIMITED_WAIT_S = 5.0  # a line over its key's limits asks again within this long


def _retry_after_s(headers: dict[str, str]) -> float:
    """The answer's ``retry-after-ms`` or ``Retry-After`` in seconds (1 when absent)."""
    for name, scale in (("retry-after-ms", 0.001), ("Retry-After", 1.0)):
        v = headers.get(name) or headers.get(name.lower())
        if v:
            try:
                return max(float(v) * scale, 0.0)
            except ValueError:
                pass
    return 1.0


def _error_code(body: bytes) -> str | None:
    try:
        obj = orjson.loads(body)
        return obj["error"].get("code") if isinstance(obj, dict) and isinstance(obj.get("error"), dict) else None
    except (orjson.JSONDecodeError, AttributeError, TypeError):
        return None



async def run_with_retries(sender, url: str, body: bytes, custom_id: str | None, *, request_timeout_s: float,
                           policy: RetryPolicy, request_id: str, before_send=None,
                           paused=None, key_name: str | None = None) -> tuple[bool, bytes] | None:
    """Send one line with up to ``policy.max_attempts`` attempts (the policy's backoff
    between them; a ``batch_deferred`` or ``rate_limit_exceeded`` answer is waited
    out and not counted), on
    behalf of ``key_name`` (the batch's owner; see the senders). Returns (ok, the
    output or error line), or ``None`` when ``before_send()`` says to stop."""
    retrier = Retrier(policy, time.monotonic())
    deferrals = 0
    while True:
        raise_if_cancel_swallowed()  # a cancelled line stops even if a Redis call swallowed the cancel
        if before_send is not None:
            if not await before_send():
                return None
            raise_if_cancel_swallowed()  # before_send calls Redis: a cancel lost there must not send
        rid = f"{request_id}-{retrier.attempts}-{deferrals}"
        status: int | None = None
        headers: dict[str, str] = {}
        data = b""
        err: dict[str, Any] | None = None
        try:
            status, headers, data = await sender.send(url, body, rid, key_name)
        except TimeoutError:
            err = {"code": "timeout", "message": f"No answer within the per-request timeout of {request_timeout_s} s"}
        except (aiohttp.ClientError, OSError) as e:
            err = {"code": "connection_error", "message": f"Could not reach the server: {e}"}
        if status == 200:
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                obj = data.decode("utf-8", "replace")
            return True, output_line(custom_id, 200, headers.get("x-request-id", rid), obj, None)
        if paused is not None:
            await paused()
        code = _error_code(data) if status == 429 else None
        if code in (DEFERRED_CODE, LIMITED_CODE):
            # no spare capacity, or the owner's key at its limits: wait, not counted as an attempt
            deferrals += 1
            wait = 0.25 if code == DEFERRED_CODE else min(_retry_after_s(headers), MAX_LIMITED_WAIT_S)
            await asyncio.sleep(policy.rng.uniform(0.2, 1.0) * wait)
            continue
        retrier.started()
        attempts = retrier.attempts
        delay = retrier.after_failure(retryable_status(status), time.monotonic())
        if delay is None:
            if status is None:
                assert err is not None
                return False, output_line(custom_id, None, None, None,
                                          {"code": err["code"], "message": f"{err['message']} ({attempts} attempts)."})
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                obj = {"error": {"message": data.decode("utf-8", "replace")[:2000], "type": "server_error",
                                 "param": None, "code": None}}
            return False, output_line(custom_id, status, headers.get("x-request-id", rid), obj, None)
        log.info("%s: attempt %d failed (%s); retrying in %.2f s", request_id, attempts,
                 status or (err or {}).get("code"), delay)
        await retrier.backoff(delay)
