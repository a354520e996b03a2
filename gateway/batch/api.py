"""The OpenAI Files and Batches HTTP API (the subset batch work needs).

- ``POST /v1/files`` (multipart: ``file``, ``purpose``), ``GET /v1/files``,
  ``GET /v1/files/{id}``, ``GET /v1/files/{id}/content``, ``DELETE /v1/files/{id}``
- ``POST /v1/batches`` (``input_file_id``, ``endpoint``, ``completion_window``,
  ``metadata``), ``GET /v1/batches``, ``GET /v1/batches/{id}``,
  ``POST /v1/batches/{id}/cancel``

Object shapes, statuses, list pages (``data``, ``first_id``, ``last_id``, ``has_more``,
``after`` / ``limit``) and errors follow OpenAI's, so ``openai`` SDK calls work
unchanged. ``completion_window`` accepts ``<n>s|m|h|d`` (OpenAI: only ``24h``).

Per caller, as OpenAI scopes them to a project: with client keys configured
(``auth.keys``), a caller lists, retrieves, cancels, downloads and deletes only the files
and batches its own key created (a batch's output and error files are its owner's), and
starts batches only on its own files. Another caller's id answers exactly as an unknown
one (404), so nothing tells whether it exists. Records made before owners were kept
(owner ``None``) are then nobody's: only ``/admin/batches`` shows such batches. Without
keys (the local demo, every caller ``anonymous``) every file and batch is visible, as
before; what was created then is owned by ``anonymous``, so once keys are configured
only a key named ``anonymous`` (if any) and the admin see it. See
:func:`gateway.batch.api_common.visible`. The Files handlers are in
:mod:`gateway.batch.files_api`; this module has the Batches handlers and the routes.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from aiohttp import web

from gateway.batch.api_common import (
    caller_scope,
    expires_after,
    json_answer,
    quota_exceeded,
    store_errors,
    store_of,
    visible,
)
from gateway.batch.batch_runtime import BATCH
from gateway.batch.files_api import create_file, delete_file, file_content, get_file, list_files
from gateway.batch.job_store import (
    ENDPOINTS,
    FINAL,
    MAX_WINDOW_S,
    RUNNING,
    QuotaExceeded,
    batch_object,
    new_id,
    parse_window,
)
from gateway.errors import ClientError

# ---- batches -------------------------------------------------------------------


async def create_batch(request: web.Request) -> web.Response:
    store = store_of(request)
    try:
        data = await request.json(loads=orjson.loads)
    except (orjson.JSONDecodeError, UnicodeDecodeError):
        raise ClientError(400, "The body is not valid JSON.") from None
    if not isinstance(data, dict):
        raise ClientError(400, "The body must be a JSON object.")
    for k in ("input_file_id", "endpoint", "completion_window"):
        if not isinstance(data.get(k), str):
            raise ClientError(400, f"Missing required parameter: '{k}'.", param=k)
    endpoint = data["endpoint"]
    if endpoint not in ENDPOINTS:
        raise ClientError(400, f"Invalid value for endpoint: {endpoint!r}; supported: {', '.join(ENDPOINTS)}.",
                          param="endpoint")
    window = parse_window(data["completion_window"])
    if window is None:
        raise ClientError(400, f"Invalid value for completion_window: {data['completion_window']!r} "
                               f"(e.g. '24h'; at most {MAX_WINDOW_S // 86400}d).", param="completion_window")
    meta = data.get("metadata")
    if meta is not None and (not isinstance(meta, dict) or len(meta) > 16
                             or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        raise ClientError(400, "`metadata` must be an object of at most 16 string pairs.", param="metadata")
    oea = data.get("output_expires_after")
    if oea is not None and not isinstance(oea, dict):
        raise ClientError(400, "`output_expires_after` must be an object.", param="output_expires_after")
    output_expires_s = (expires_after(oea.get("anchor"), oea.get("seconds"), "output_expires_after")
                        if oea is not None else None)
    owner, scope = caller_scope(request)
    f = await store.get_file(data["input_file_id"])
    if f is None or not visible(f.get("owner"), scope):  # another caller's file: as an unknown one
        raise ClientError(404, f"No such File object: {data['input_file_id']}", param="input_file_id")
    if f.get("purpose") != "batch":
        raise ClientError(400, f"File {f['id']} has purpose {f.get('purpose')!r}; a batch needs purpose 'batch'.",
                          param="input_file_id")
    now = int(time.time())
    bid = new_id("batch_")
    max_active = request.app[BATCH].cfg.max_active_batches_per_key
    try:
        await store.create_batch({"id": bid, "endpoint": endpoint, "input_file_id": f["id"],
                                  "completion_window": data["completion_window"], "status": "validating",
                                  "created_at": now, "expires_at": int(now + window),
                                  "metadata": orjson.dumps(meta) if meta else None,
                                  "owner": owner,  # the key's name (never the key): scopes /v1, shown by /admin
                                  "output_expires_s": output_expires_s,
                                  "total": 0, "completed": 0, "failed": 0}, max_active=max_active)
    except QuotaExceeded:
        raise quota_exceeded("batches", max_active) from None
    request.app[BATCH].manager.wake()
    created = await store.batch_fields(bid)
    assert created is not None  # written just above
    return json_answer(batch_object(created))


async def _batch_or_404(request: web.Request) -> dict[str, str]:
    """The batch's fields, if the caller may see it; 404 otherwise (unknown or another
    caller's: the same answer)."""
    bid = request.match_info["batch_id"]
    f = await store_of(request).batch_fields(bid)
    if f is None or not visible(f.get("owner"), caller_scope(request)[1]):
        raise ClientError(404, f"No batch found with id '{bid}'.", param="batch_id")
    return f


async def get_batch(request: web.Request) -> web.Response:
    return json_answer(batch_object(await _batch_or_404(request)))


async def list_batches(request: web.Request) -> web.Response:
    """The caller's batches, newest first (every batch without keys). An ``after`` the
    caller cannot see (unknown, or another caller's) starts the page at the newest."""
    store = store_of(request)
    scope = caller_scope(request)[1]
    try:
        limit = int(request.query.get("limit", 20))
    except ValueError:
        raise ClientError(400, "`limit` must be an integer.", param="limit") from None
    if not 1 <= limit <= 100:
        raise ClientError(400, "`limit` must be between 1 and 100.", param="limit")
    after = request.query.get("after") or None
    if after is not None:
        f = await store.batch_fields(after)
        if f is None or not visible(f.get("owner"), scope):
            after = None
    try:
        fields, has_more = await store.batch_page(after=after, limit=limit, owner=scope)
    except KeyError:  # the cursor's batch left the index meanwhile
        fields, has_more = await store.batch_page(after=None, limit=limit, owner=scope)
    page = [batch_object(f) for f in fields]
    return json_answer({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                  "last_id": page[-1]["id"] if page else None, "has_more": has_more})


async def cancel(rt, batch_id: str) -> dict[str, str]:
    """Cancel a batch (``validating`` / ``in_progress`` -> ``cancelling``; the manager
    ends it ``cancelled`` once none of its lines is in flight); a batch already
    ``cancelling`` or ``cancelled`` is left as it is. Returns its fields after. 404 for
    an unknown id, 409 ``batch_not_cancellable`` when it is finalizing or finished.
    Used by ``POST /v1/batches/{id}/cancel`` and ``POST /admin/batches/{id}/cancel``."""
    status = await rt.store.cancel(batch_id)
    if status is None:
        raise ClientError(404, f"No batch found with id '{batch_id}'.", param="batch_id")
    if status not in ("cancelling", "cancelled"):
        raise ClientError(409, f"Cannot cancel a batch with status {status!r}.", code="batch_not_cancellable")
    rt.manager.wake()
    f = await rt.store.batch_fields(batch_id)
    if f is None:
        raise ClientError(404, f"No batch found with id '{batch_id}'.", param="batch_id")
    return f


async def cancel_batch(request: web.Request) -> web.Response:
    f = await _batch_or_404(request)  # the caller's own batches only
    return json_answer(batch_object(await cancel(request.app[BATCH], f["id"])))


# ---- the admin view (every caller's batches; gateway/ops/admin.py serves it) -----------

ADMIN_LIST_MAX = 1000


def admin_batch_object(f: dict[str, str]) -> dict[str, Any]:
    """The OpenAI batch object plus ``owner``: the name of the key that created it
    (``anonymous`` without keys; ``None`` for batches created before it was recorded,
    which, with keys configured, only the admin endpoints show)."""
    return {**batch_object(f), "owner": f.get("owner")}


def admin_list_query(request: web.Request) -> tuple[frozenset[str] | None, int, str | None]:
    """``status`` (repeatable or comma-separated), ``limit`` (1 to ``ADMIN_LIST_MAX``,
    default 20) and ``after`` of ``GET /admin/batches``; 400 on a bad value."""
    statuses: frozenset[str] | None = None
    raw = [x.strip() for v in request.query.getall("status", []) for x in v.split(",") if x.strip()]
    if raw:
        known = RUNNING | FINAL
        bad = sorted(set(raw) - known)
        if bad:
            raise ClientError(400, f"Invalid value for status: {', '.join(map(repr, bad))}; one of "
                                   f"{', '.join(sorted(known))}.", param="status")
        statuses = frozenset(raw)
    try:
        limit = int(request.query.get("limit", 20))
    except ValueError:
        raise ClientError(400, "`limit` must be an integer.", param="limit") from None
    if not 1 <= limit <= ADMIN_LIST_MAX:
        raise ClientError(400, f"`limit` must be between 1 and {ADMIN_LIST_MAX}.", param="limit")
    return statuses, limit, request.query.get("after") or None


async def admin_list(rt, request: web.Request) -> dict[str, Any]:
    statuses, limit, after = admin_list_query(request)
    try:
        fields, has_more = await rt.store.batch_page(after=after, limit=limit, statuses=statuses)
    except KeyError:
        raise ClientError(400, f"No batch found with id '{after}' (the `after` cursor).", param="after") from None
    page = [admin_batch_object(f) for f in fields]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": has_more}


async def admin_detail(rt, batch_id: str) -> dict[str, Any]:
    """One batch for the admin: :func:`admin_batch_object`, its ``progress`` (results
    recorded, lines in flight, lines enqueued) and the shared line ``queue`` with its
    consumers. 404 for an unknown id."""
    f = await rt.store.batch_fields(batch_id)
    if f is None:
        raise ClientError(404, f"No batch found with id '{batch_id}'.", param="batch_id")
    return {**admin_batch_object(f), "progress": await rt.store.progress(batch_id),
            "queue": await rt.store.queue_info()}


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_post("/v1/files", store_errors(create_file))
    r.add_get("/v1/files", store_errors(list_files))
    r.add_get("/v1/files/{file_id}", store_errors(get_file))
    r.add_delete("/v1/files/{file_id}", store_errors(delete_file))
    r.add_get("/v1/files/{file_id}/content", store_errors(file_content))
    r.add_post("/v1/batches", store_errors(create_batch))
    r.add_get("/v1/batches", store_errors(list_batches))
    r.add_get("/v1/batches/{batch_id}", store_errors(get_batch))
    r.add_post("/v1/batches/{batch_id}/cancel", store_errors(cancel_batch))
