"""Admin endpoints, the auth middleware, and the route of the OpenAPI document
(:mod:`gateway.server.openapi`).

Admin endpoints answer 404 (like an unknown route) unless ``admin.key_sha256`` or
``admin.key_env`` is set, and 401 without that key:

- ``GET /admin/backends``: every backend's health, breaker, draining flag and load;
- ``POST /admin/backends/{name}/drain`` / ``undrain``: stop / resume sending it new
  requests (its in-flight requests finish);
- ``POST /admin/reload``: reload the config file (as SIGHUP does); 200, or 400 with
  the reason the new config was rejected (the running one stays);
- ``GET /admin/batches``: every caller's batches, newest first, with the key name that
  created each (``owner``; ``None`` for batches from before owners were kept, which
  with client keys no ``/v1/batches`` caller sees); ``status`` filter (repeatable or
  comma-separated), ``limit`` / ``after`` pages;
- ``GET /admin/batches/{id}``: one batch with its ``request_counts``, ``progress``
  (results recorded, lines in flight, lines enqueued) and the shared line ``queue``
  (length, pending, consumers);
- ``POST /admin/batches/{id}/cancel``: cancel any caller's batch, as
  ``POST /v1/batches/{id}/cancel`` does (404 unknown, 409 finalizing or finished);
- ``GET /admin/usage?key=&model=&since=&until=``: the usage ledger's hourly buckets
  and totals (:mod:`gateway.tenancy.usage_ledger`), every key's or one key's.

``GET /v1/usage?model=&since=&until=`` answers the same for the caller's own key only
(its client key authenticates it; ``key`` naming another key is 403).

The batch endpoints answer 404 ``batch_disabled`` when ``batch.enabled`` is off.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from datetime import UTC, datetime

import orjson
from aiohttp import web

from gateway.apis.base import reshape
from gateway.apis.registry import BY_PATH
from gateway.errors import ClientError, retry_later_headers
from gateway.ops import access_log
from gateway.paths import CANONICAL_PATH
from gateway.pipeline.openai_request import UNREADABLE_BODY, unreadable_body
from gateway.request_ids import REQUEST_ID
from gateway.runtime import STATE
from gateway.server.openapi import OPENAPI_BYTES, OPENAPI_NO_ADMIN_BYTES
from gateway.tenancy.keys import CALLER, check_admin


def _state(request: web.Request):
    return request.app[STATE]


@web.middleware
async def auth_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Authenticate ``/v1/*`` callers on the head, before any of the body is read: a
    request without a valid key gets a 401 (an OpenAI error, from the outer
    middleware) and, when it has a body, the connection is closed after it, the body
    never read. Also turns a request body that cannot be read as its
    ``Content-Encoding`` says (found by
    tests/integration/server/test_fuzz.py: it was a 500) into a 400."""
    path = request.get(CANONICAL_PATH, request.path)
    if path.startswith("/v1/"):
        try:
            request[CALLER] = _state(request).keyring.authenticate(request.headers)
        except ClientError as e:
            api = BY_PATH.get(path) if request.method == "POST" else None
            status, body, headers = e.answer()
            if api is not None:  # in the shape that API's clients parse
                body = reshape(api, status, body)
            resp = web.Response(status=status, body=body, headers=headers)
            if api is not None:
                access_log.refused(request[REQUEST_ID], api.name, e.status, e.code)
            if request.can_read_body:
                # no lingering read of the body aiohttp would otherwise discard for up to 10 s
                request.protocol._lingering_time = 0.0
                resp.force_close()
            return resp
    try:
        return await handler(request)
    except UNREADABLE_BODY as e:
        raise unreadable_body(request, e) from None


def _json(obj, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


async def _backends(request: web.Request) -> web.Response:
    state = _state(request)
    check_admin(request, state.admin_digest)
    now = asyncio.get_running_loop().time()
    out = []
    for b in state.fleet.backends.values():
        br = b.breaker
        out.append({"name": b.name, "pool": b.spec.pool, "models": sorted(b.models()), "healthy": b.healthy,
                    "draining": b.draining, "breaker": br.state, "breaker_opened_total": br.opened_total,
                    "cooling_down_s": max(b.cooldown_until - now, 0.0), "in_flight": b.in_flight,
                    "remote_in_flight": b.remote_in_flight})
    return _json({"object": "list", "data": out})


async def _set_draining(request: web.Request, draining: bool) -> web.Response:
    state = _state(request)
    check_admin(request, state.admin_digest)
    name = request.match_info["name"]
    b = state.fleet.backends.get(name)
    if b is None:
        raise ClientError(404, f"No backend named `{name}`.", code="backend_not_found")
    b.draining = draining
    logging.getLogger("gateway.ops.admin").warning("backend %s %s by the admin API", name,
                                               "drained" if draining else "undrained")
    return _json({"name": name, "draining": draining, "in_flight": b.in_flight})


async def _drain(request: web.Request) -> web.Response:
    return await _set_draining(request, True)


async def _undrain(request: web.Request) -> web.Response:
    return await _set_draining(request, False)


async def _reload(request: web.Request) -> web.Response:
    from gateway.ops.config_reload import reload_from_file

    state = _state(request)
    check_admin(request, state.admin_digest)
    if state.config_path is None:
        raise ClientError(409, "This gateway was not started from a config file; nothing to reload.",
                          code="no_config_file")
    ok, message = await reload_from_file(request.app, "admin API")
    if not ok:
        raise ClientError(400, message, code="invalid_config")
    return _json({"status": "reloaded"})


def _batch_runtime(request: web.Request):
    """Admin check first (404 when admin is off, 401 without the key), then the batch
    runtime (404 ``batch_disabled`` without ``batch.enabled``)."""
    from gateway.batch.batch_runtime import BATCH

    check_admin(request, _state(request).admin_digest)
    if BATCH not in request.app:
        raise ClientError(404, "The batch API is not enabled (batch.enabled).", code="batch_disabled")
    return request.app[BATCH]


async def _batches(request: web.Request) -> web.Response:
    from gateway.batch.api import admin_list

    return _json(await admin_list(_batch_runtime(request), request))


async def _batch(request: web.Request) -> web.Response:
    from gateway.batch.api import admin_detail

    return _json(await admin_detail(_batch_runtime(request), request.match_info["batch_id"]))


async def _cancel_batch(request: web.Request) -> web.Response:
    from gateway.batch.api import admin_batch_object, cancel

    rt = _batch_runtime(request)
    f = await cancel(rt, request.match_info["batch_id"])
    logging.getLogger("gateway.ops.admin").warning("batch %s (owner %s) cancelled by the admin API: %s", f["id"],
                                               f.get("owner"), f["status"])
    return _json(admin_batch_object(f))


def _usage_param(request: web.Request, name: str) -> str | None:
    """Query parameter ``name`` of a usage request (``None``: absent or empty).
    Raises :class:`ClientError` 400 when it is given more than once."""
    values = request.query.getall(name, ())
    if len(values) > 1:
        raise ClientError(400, f"`{name}` is given {len(values)} times; give it once (one {name} per request).",
                          param=name, code="invalid_value")
    return values[0] if values and values[0] != "" else None


def _usage_time(request: web.Request, name: str, default: float) -> float:
    """Query parameter ``name``: Unix seconds or an ISO 8601 time (UTC unless it says
    otherwise); ``default`` when absent. Raises :class:`ClientError` 400."""
    raw = _usage_param(request, name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        try:
            t = datetime.fromisoformat(raw)
        except ValueError:
            raise ClientError(400, f"`{name}` must be Unix seconds or an ISO 8601 time, not {raw!r}.",
                              param=name, code="invalid_value") from None
        value = (t if t.tzinfo is not None else t.replace(tzinfo=UTC)).timestamp()
    if not math.isfinite(value) or value < 0:
        raise ClientError(400, f"`{name}` must be a time after 1970, not {raw!r}.", param=name, code="invalid_value")
    return value


async def usage_report(state, key: str | None, request: web.Request) -> dict:
    """The usage ledger's answer for ``key`` (``None``: every key) and the request's
    ``model``, ``since`` (default: 24 hours ago) and ``until`` (default: now) query
    parameters: the hourly buckets that start in ``[since rounded down to its hour,
    until)``, at most ``usage.retention_days`` back and at most ``usage.max_query_hours``
    hours (the answer's ``since`` is where it started: :func:`gateway.tenancy.usage_ledger.summarize`).
    Raises :class:`ClientError` 400 on a bad parameter, 503 when Redis is unreachable."""
    from gateway.tenancy.usage_ledger import HOUR_S, summarize

    now = time.time()
    until = _usage_time(request, "until", now)
    since = _usage_time(request, "since", until - 24 * HOUR_S)
    if since > until:
        raise ClientError(400, "`since` is after `until`.", param="since", code="invalid_value")
    oldest = (int(now // HOUR_S) - state.cfg.usage.retention_days * 24) * HOUR_S
    since_hour = int(max(since, oldest) // HOUR_S)
    # hours that start before ``until``; none is in the future
    until_hour = max(min(int(-(-until // HOUR_S)), int(now // HOUR_S) + 1), since_hour)
    since_hour = max(since_hour, until_hour - state.cfg.usage.max_query_hours)  # bounded work per call
    model = _usage_param(request, "model")
    if state.usage_sync is not None:
        try:
            buckets = await state.usage_sync.read(key, model, since_hour, until_hour)
        except Exception as e:  # noqa: BLE001 - any Redis failure is a 503, not a 500
            raise ClientError(503, f"The usage ledger's store is unreachable ({type(e).__name__}); "
                              "counts are buffered meanwhile.", code="usage_store_unavailable",
                              headers=retry_later_headers(5.0)) from None
    else:
        buckets = state.usage.local_query(key, model, since_hour, until_hour)
    return summarize(buckets, since=since_hour * HOUR_S, until=until_hour * HOUR_S)


async def _admin_usage(request: web.Request) -> web.Response:
    state = _state(request)
    check_admin(request, state.admin_digest)
    return _json(await usage_report(state, _usage_param(request, "key"), request))


async def _own_usage(request: web.Request) -> web.Response:
    caller = request[CALLER]
    asked = _usage_param(request, "key")
    if asked and asked != caller.name:
        raise ClientError(403, "An API key sees only its own usage.", param="key", code="permission_denied")
    return _json(await usage_report(_state(request), caller.name, request))


async def _openapi(request: web.Request) -> web.Response:
    """The document of what this gateway serves: without an admin key the ``/admin/``
    routes answer as unknown ones, so they are left out."""
    admin = _state(request).admin_digest is not None
    return web.Response(body=OPENAPI_BYTES if admin else OPENAPI_NO_ADMIN_BYTES, content_type="application/json")


def setup_admin(app: web.Application) -> None:
    app.router.add_get("/admin/backends", _backends)
    app.router.add_post("/admin/backends/{name}/drain", _drain)
    app.router.add_post("/admin/backends/{name}/undrain", _undrain)
    app.router.add_post("/admin/reload", _reload)
    app.router.add_get("/admin/batches", _batches)
    app.router.add_get("/admin/batches/{batch_id}", _batch)
    app.router.add_post("/admin/batches/{batch_id}/cancel", _cancel_batch)
    app.router.add_get("/admin/usage", _admin_usage)
    app.router.add_get("/v1/usage", _own_usage)
    app.router.add_get("/openapi.json", _openapi)
