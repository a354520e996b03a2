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
only a key named ``anonymous`` (if any) and the admin see it. See :func:`visible`.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import redis.exceptions
from aiohttp import BodyPartReader, web

from gateway.batch.batch_runtime import BATCH
from gateway.batch.job_store import (
    ENDPOINTS,
    FINAL,
    MAX_WINDOW_S,
    RUNNING,
    BatchStore,
    QuotaExceeded,
    batch_object,
    file_object,
    new_id,
    parse_window,
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


def _expires_after(anchor: str | None, seconds: Any, param: str) -> int | None:
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


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


STORE_RETRY_S = 5.0  # the wait suggested to a client while the batch store is unreachable


def store_unavailable(e: Exception) -> ClientError:
    """The answer while the batch store (Redis) cannot be reached: 503
    ``batch_store_unavailable`` with a retry-after, as ``/v1/usage`` answers its own
    store's outage; nothing was recorded."""
    return ClientError(503, f"The batch store (Redis) is unreachable ({type(e).__name__}); nothing was recorded, "
                       "retry later.", code="batch_store_unavailable", headers=retry_later_headers(STORE_RETRY_S))


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _store_errors(handler: Handler) -> Handler:
    """``handler`` answering 503 (:func:`store_unavailable`) when Redis fails."""
    @functools.wraps(handler)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except redis.exceptions.RedisError as e:
            raise store_unavailable(e) from None

    return wrapped


def _store(request: web.Request) -> BatchStore:
    return request.app[BATCH].store


def _caller(request: web.Request) -> tuple[str, str | None]:
    """(the caller's name, recorded as the ``owner`` of what it creates; its scope:
    ``None`` when it sees every record, i.e. no client keys are configured, else its key
    name). The auth middleware has set the caller on every ``/v1/`` request; should it
    be missing, the caller is authenticated here (never assumed anonymous)."""
    caller = request.get(CALLER)
    if caller is None:
        caller = request.app[STATE].keyring.authenticate(request.headers)
    return caller.name, (None if caller.key is None else caller.name)


def visible(owner: str | None, scope: str | None) -> bool:
    """Whether a caller with ``scope`` (see :func:`_caller`) may see a record created by
    ``owner``. Without keys (``scope`` ``None``) everything is visible; with keys, only
    the caller's own records: an owner-less record (made before owners were kept) is
    then visible to no caller, only to the admin endpoints."""
    return scope is None or (owner is not None and owner == scope)


# ---- files ---------------------------------------------------------------------


async def create_file(request: web.Request) -> web.Response:
    """Upload a file, within the caller's quota (``batch.max_files_per_key``,
    ``max_bytes_per_key``: 429 ``quota_exceeded``), expiring per its ``expires_after``
    or, for purpose ``batch``, ``batch.batch_file_expires_s`` after the upload."""
    store = _store(request)
    cfg = request.app[BATCH].cfg
    owner = _caller(request)[0]
    limit = cfg.max_file_bytes
    if not request.content_type.startswith("multipart/"):
        raise ClientError(400, "Upload the file as multipart/form-data with fields `file` and `purpose`.")
    used_files, used_bytes = await store.quota_used(owner)
    if cfg.max_files_per_key is not None and used_files >= cfg.max_files_per_key:
        raise quota_exceeded("files", cfg.max_files_per_key)
    room = None if cfg.max_bytes_per_key is None else cfg.max_bytes_per_key - used_bytes
    reader = await request.multipart()
    purpose: str | None = None
    anchor: str | None = None
    seconds: str | None = None
    file_id = new_id("file-")
    filename = None
    size = 0
    store.files_dir.mkdir(parents=True, exist_ok=True)
    tmp = store.files_dir / f".{file_id}.upload"
    try:
        while (part := await reader.next()) is not None:
            assert isinstance(part, BodyPartReader)  # a form's fields, not a nested multipart
            if part.name == "purpose":
                purpose = (await part.text()).strip()
            elif part.name == "expires_after[anchor]":
                anchor = (await part.text()).strip()
            elif part.name == "expires_after[seconds]":
                seconds = (await part.text()).strip()
            elif part.name == "file":
                filename = part.filename or "upload.jsonl"
                with open(tmp, "wb") as out:  # noqa: ASYNC230 - local 1 MiB writes; the upload is awaited
                    while chunk := await part.read_chunk(1 << 20):
                        size += len(chunk)
                        if size > limit:
                            raise ClientError(413, f"File is larger than the limit of {limit} bytes.",
                                              param="file", code="file_too_large")
                        if room is not None and size > room:
                            raise quota_exceeded("bytes", cfg.max_bytes_per_key)
                        out.write(chunk)
        if filename is None:
            raise ClientError(400, "Missing required parameter: 'file'.", param="file")
        if purpose is None:
            raise ClientError(400, "Missing required parameter: 'purpose'.", param="purpose")
        if purpose not in PURPOSES:
            raise ClientError(400, f"Invalid value for purpose: {purpose!r}.", param="purpose")
        expires_s = _expires_after(anchor, seconds, "expires_after")
        if expires_s is None and purpose == "batch":
            expires_s = cfg.batch_file_expires_s
        now = int(time.time())
        obj = {"id": file_id, "object": "file", "bytes": size, "created_at": now,
               "expires_at": None if expires_s is None else now + expires_s,
               "filename": filename, "purpose": purpose, "status": "processed", "status_details": None}
        os.replace(tmp, store.path(file_id))
        try:
            await store.add_file(obj, owner, max_files=cfg.max_files_per_key, max_bytes=cfg.max_bytes_per_key)
        except BaseException as e:  # no record, no file: an upload exists whole or not at all
            store.path(file_id).unlink(missing_ok=True)
            if isinstance(e, QuotaExceeded):  # another upload of the key took the room meanwhile
                raise quota_exceeded(e.what, cfg.max_files_per_key if e.what == "files"
                                     else cfg.max_bytes_per_key) from None
            raise
    finally:
        if tmp.exists():
            tmp.unlink()
    return _json(obj)


async def _file_or_404(request: web.Request) -> dict[str, Any]:
    """The file object, if the caller may see it; 404 otherwise (unknown or another
    caller's: the same answer)."""
    fid = request.match_info["file_id"]
    rec = await _store(request).get_file(fid)
    if rec is None or not visible(rec.get("owner"), _caller(request)[1]):
        raise ClientError(404, f"No such File object: {fid}", param="id")
    return file_object(rec)


async def list_files(request: web.Request) -> web.Response:
    """The caller's files (every file without keys), newest first (``order=asc``:
    oldest), read from the caller's own index a page at a time."""
    scope = _caller(request)[1]
    try:
        limit = int(request.query.get("limit", 10000))
    except ValueError:
        raise ClientError(400, "`limit` must be an integer.", param="limit") from None
    if not 1 <= limit <= 10000:
        raise ClientError(400, "`limit` must be between 1 and 10000.", param="limit")
    recs, has_more = await _store(request).file_page(
        owner=scope, after=request.query.get("after") or None, limit=limit,
        ascending=request.query.get("order") == "asc", purpose=request.query.get("purpose") or None)
    page = [file_object(x) for x in recs]
    return _json({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                  "last_id": page[-1]["id"] if page else None, "has_more": has_more})


async def get_file(request: web.Request) -> web.Response:
    return _json(await _file_or_404(request))


async def file_content(request: web.Request) -> web.StreamResponse:
    obj = await _file_or_404(request)
    path = _store(request).path(obj["id"])
    if not path.exists():
        raise ClientError(404, f"The content of file {obj['id']} is gone.", param="id")
    return web.FileResponse(path, headers={"Content-Type": "application/octet-stream"})


async def delete_file(request: web.Request) -> web.Response:
    obj = await _file_or_404(request)
    await _store(request).delete_file(obj["id"])
    return _json({"id": obj["id"], "object": "file", "deleted": True})


# ---- batches -------------------------------------------------------------------


async def create_batch(request: web.Request) -> web.Response:
    store = _store(request)
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
    output_expires_s = (_expires_after(oea.get("anchor"), oea.get("seconds"), "output_expires_after")
                        if oea is not None else None)
    owner, scope = _caller(request)
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
    return _json(batch_object(created))


async def _batch_or_404(request: web.Request) -> dict[str, str]:
    """The batch's fields, if the caller may see it; 404 otherwise (unknown or another
    caller's: the same answer)."""
    bid = request.match_info["batch_id"]
    f = await _store(request).batch_fields(bid)
    if f is None or not visible(f.get("owner"), _caller(request)[1]):
        raise ClientError(404, f"No batch found with id '{bid}'.", param="batch_id")
    return f


async def get_batch(request: web.Request) -> web.Response:
    return _json(batch_object(await _batch_or_404(request)))


async def list_batches(request: web.Request) -> web.Response:
    """The caller's batches, newest first (every batch without keys). An ``after`` the
    caller cannot see (unknown, or another caller's) starts the page at the newest."""
    store = _store(request)
    scope = _caller(request)[1]
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
    return _json({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
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
    return _json(batch_object(await cancel(request.app[BATCH], f["id"])))


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
    r.add_post("/v1/files", _store_errors(create_file))
    r.add_get("/v1/files", _store_errors(list_files))
    r.add_get("/v1/files/{file_id}", _store_errors(get_file))
    r.add_delete("/v1/files/{file_id}", _store_errors(delete_file))
    r.add_get("/v1/files/{file_id}/content", _store_errors(file_content))
    r.add_post("/v1/batches", _store_errors(create_batch))
    r.add_get("/v1/batches", _store_errors(list_batches))
    r.add_get("/v1/batches/{batch_id}", _store_errors(get_batch))
    r.add_post("/v1/batches/{batch_id}/cancel", _store_errors(cancel_batch))
