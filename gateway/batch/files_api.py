"""The OpenAI Files API: ``POST /v1/files`` (multipart: ``file``, ``purpose``),
``GET /v1/files``, ``GET /v1/files/{id}``, ``GET /v1/files/{id}/content``,
``DELETE /v1/files/{id}``; each caller sees only its own files (see
:mod:`gateway.batch.api`)."""

from __future__ import annotations

import os
import time
from typing import Any

from aiohttp import BodyPartReader, web

from gateway.batch.api_common import (
    PURPOSES,
    caller_scope,
    expires_after,
    json_answer,
    quota_exceeded,
    store_of,
    visible,
)
from gateway.batch.batch_runtime import BATCH
from gateway.batch.job_store import (
    QuotaExceeded,
    file_object,
    new_id,
)
from gateway.errors import ClientError

# ---- files ---------------------------------------------------------------------


async def create_file(request: web.Request) -> web.Response:
    """Upload a file, within the caller's quota (``batch.max_files_per_key``,
    ``max_bytes_per_key``: 429 ``quota_exceeded``), expiring per its ``expires_after``
    or, for purpose ``batch``, ``batch.batch_file_expires_s`` after the upload."""
    store = store_of(request)
    cfg = request.app[BATCH].cfg
    owner = caller_scope(request)[0]
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
        expires_s = expires_after(anchor, seconds, "expires_after")
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
    return json_answer(obj)


async def _file_or_404(request: web.Request) -> dict[str, Any]:
    """The file object, if the caller may see it; 404 otherwise (unknown or another
    caller's: the same answer)."""
    fid = request.match_info["file_id"]
    rec = await store_of(request).get_file(fid)
    if rec is None or not visible(rec.get("owner"), caller_scope(request)[1]):
        raise ClientError(404, f"No such File object: {fid}", param="id")
    return file_object(rec)


async def list_files(request: web.Request) -> web.Response:
    """The caller's files (every file without keys), newest first (``order=asc``:
    oldest), read from the caller's own index a page at a time."""
    scope = caller_scope(request)[1]
    try:
        limit = int(request.query.get("limit", 10000))
    except ValueError:
        raise ClientError(400, "`limit` must be an integer.", param="limit") from None
    if not 1 <= limit <= 10000:
        raise ClientError(400, "`limit` must be between 1 and 10000.", param="limit")
    recs, has_more = await store_of(request).file_page(
        owner=scope, after=request.query.get("after") or None, limit=limit,
        ascending=request.query.get("order") == "asc", purpose=request.query.get("purpose") or None)
    page = [file_object(x) for x in recs]
    return json_answer({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                  "last_id": page[-1]["id"] if page else None, "has_more": has_more})


async def get_file(request: web.Request) -> web.Response:
    return json_answer(await _file_or_404(request))


async def file_content(request: web.Request) -> web.StreamResponse:
    obj = await _file_or_404(request)
    path = store_of(request).path(obj["id"])
    if not path.exists():
        raise ClientError(404, f"The content of file {obj['id']} is gone.", param="id")
    return web.FileResponse(path, headers={"Content-Type": "application/octet-stream"})


async def delete_file(request: web.Request) -> web.Response:
    obj = await _file_or_404(request)
    await store_of(request).delete_file(obj["id"])
    return json_answer({"id": obj["id"], "object": "file", "deleted": True})
