"""What the Files and Batches HTTP API's handlers share (:mod:`gateway.batch.api`,
:mod:`gateway.batch.files_api`): who the caller is and what it may see
(:func:`visible`), the answer while the batch store is unreachable, quotas and
expiry parameters, JSON answers."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import redis.exceptions
from aiohttp import web

from gateway.batch.batch_runtime import BATCH
from gateway.batch.job_store import (
    BatchStore,
)
from gateway.errors import SHOULD_RETRY_HEADER, ClientError, retry_later_headers
from gateway.runtime import STATE
from gateway.tenancy.keys import CALLER

PURPOSES = frozenset({"batch", "batch_output", "fine-tune", "assistants", "vision", "user", "evals"})
EXPIRES_MIN_S, EXPIRES_MAX_S = 3600, 30 * 86400  # OpenAI's bounds of `expires_after.seconds`
_QUOTA_WHAT = {"files": "files", "bytes": "bytes of files", "batches": "unfinished batches"}


def quota_exceeded(what: str, limit: int | None) -> ClientError:
    """429 ``quota_exceeded``: the key holds as many files, bytes or unfinished batches
    as its quota allows (``batch.max_*_per_key``); not worth retrying until it deletes
    some or a batch ends."""
    return ClientError(429, f"This API key holds the most {_QUOTA_WHAT[what]} it may ({limit}); delete files or "
                       "wait for batches to end.", code="quota_exceeded", headers={SHOULD_RETRY_HEADER: "false"})


def expires_after(anchor: str | None, seconds: Any, param: str) -> int | None:
    """``expires_after`` / ``output_expires_after`` -> seconds after creation (``None``
    when not given); 400 unless the anchor is ``created_at`` and the seconds within
    OpenAI's bounds."""
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise ClientError(400, f"`{param}.anchor` must be 'created_at'.", param=f"{param}.anchor")
    try:
        n = int(seconds)
    except (TypeError, ValueError):
        n = 0
    if not EXPIRES_MIN_S <= n <= EXPIRES_MAX_S:
        raise ClientError(400, f"`{param}.seconds` must be an integer from {EXPIRES_MIN_S} to {EXPIRES_MAX_S}.",
                          param=f"{param}.seconds")
    return n


def json_answer(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


STORE_RETRY_S = 5.0  # the wait suggested to a client while the batch store is unreachable


def store_unavailable(e: Exception) -> ClientError:
    """The answer while the batch store (Redis) cannot be reached: 503
    ``batch_store_unavailable`` with a retry-after, as ``/v1/usage`` answers its own
    store's outage; nothing was recorded."""
    return ClientError(503, f"The batch store (Redis) is unreachable ({type(e).__name__}); nothing was recorded, "
                       "retry later.", code="batch_store_unavailable", headers=retry_later_headers(STORE_RETRY_S))


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def store_errors(handler: Handler) -> Handler:
    """``handler`` answering 503 (:func:`store_unavailable`) when Redis fails."""
    @functools.wraps(handler)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except redis.exceptions.RedisError as e:
            raise store_unavailable(e) from None

    return wrapped


def store_of(request: web.Request) -> BatchStore:
    return request.app[BATCH].store


def caller_scope(request: web.Request) -> tuple[str, str | None]:
    """(the caller's name, recorded as the ``owner`` of what it creates; its scope:
    ``None`` when it sees every record, i.e. no client keys are configured, else its key
    name). The auth middleware has set the caller on every ``/v1/`` request; should it
    be missing, the caller is authenticated here (never assumed anonymous)."""
    caller = request.get(CALLER)
    if caller is None:
        caller = request.app[STATE].keyring.authenticate(request.headers)
    return caller.name, (None if caller.key is None else caller.name)


def visible(owner: str | None, scope: str | None) -> bool:
    """Whether a caller with ``scope`` (see :func:`caller_scope`) may see a record created by
    ``owner``. Without keys (``scope`` ``None``) everything is visible; with keys, only
    the caller's own records: an owner-less record (made before owners were kept) is
    then visible to no caller, only to the admin endpoints."""
    return scope is None or (owner is not None and owner == scope)
