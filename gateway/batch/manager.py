"""The batch life cycle, run by every gateway with ``batch.enabled`` (it owns ``files_dir``).

``validating`` -> parse the input file, count its lines, record a per-line error for
each malformed one (a thousand per Redis call), ``in_progress``, then enqueue the valid lines (``XADD``, 500 per
transaction together with the ``enqueued`` cursor, so a gateway that dies mid-way is
resumed by the next tick from the cursor) -> consumers record results -> the last
result moves the batch to ``finalizing`` (in the record script) -> the output and error
files are written from the results hash -> ``completed``.

``cancelling`` (the cancel endpoint): consumers stop starting its lines; once no line is
in flight (leases in the ``fly`` zset renewed by the consumers' heartbeat, so a dead
consumer's line stops counting after ``visibility_timeout_s``) the
batch is frozen and ends ``cancelled`` with the results it has. Past ``expires_at`` an
unfinished batch is frozen and ends ``expired``: finished lines in the output file, the
others in the error file with code ``batch_expired``. Freezing (the ``closing`` field)
makes the record script drop late results, so the files are final when written.

Output and error files expire ``batch.output_file_expires_s`` after they were written
(or the batch's ``output_expires_after``); every tick deletes files past their
``expires_at`` (:meth:`~gateway.batch.job_store.BatchStore.expire_files`).

Each step takes a short per-batch lock, so several gateway replicas sharing Redis and
``files_dir`` can all run the manager.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import orjson

from gateway.batch.job_store import ENDPOINTS, FINAL, BatchStore
from gateway.batch.output_lines import output_line
from gateway.errors import reason
from gateway.store.background_sync import BackgroundSync, raise_if_cancel_swallowed

log = logging.getLogger("gateway.batch")

ENQUEUE_CHUNK = 500
LOCK_TTL_S = 60.0


def parse_input(raw: bytes, endpoint: str | None) -> tuple[list[tuple[int, str, str, bytes]],
                                                          list[tuple[int, str | None, str]]]:
    """Split an input file into valid lines ``(index, custom_id, url, body)`` and malformed
    ones ``(index, custom_id or None, message)``. Blank lines are skipped; ``index``
    counts the others from 0; messages name the 1-based line number."""
    valid: list[tuple[int, str, str, bytes]] = []
    bad: list[tuple[int, str | None, str]] = []
    seen: dict[str, int] = {}
    index = 0
    for lineno, line in enumerate(raw.split(b"\n"), 1):
        if not line.strip():
            continue
        i = index
        index += 1
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            bad.append((i, None, f"Line {lineno}: not valid JSON ({e})."))
            continue
        if not isinstance(obj, dict):
            bad.append((i, None, f"Line {lineno}: must be a JSON object."))
            continue
        cid = obj.get("custom_id")
        if not isinstance(cid, str) or not cid:
            bad.append((i, None, f"Line {lineno}: `custom_id` must be a non-empty string."))
            continue
        if cid in seen:
            bad.append((i, cid, f"Line {lineno}: duplicate `custom_id` {cid!r} (first on line {seen[cid]})."))
            continue
        seen[cid] = lineno
        if obj.get("method", "POST") != "POST":
            bad.append((i, cid, f"Line {lineno}: `method` must be \"POST\"."))
            continue
        url = obj.get("url")
        if endpoint is not None and url != endpoint:
            bad.append((i, cid, f"Line {lineno}: `url` must be {endpoint!r}, the batch's endpoint."))
            continue
        if url not in ENDPOINTS:
            bad.append((i, cid, f"Line {lineno}: `url` must be one of {', '.join(ENDPOINTS)}."))
            continue
        body = obj.get("body")
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            bad.append((i, cid, f"Line {lineno}: `body` must be an object with a `model`."))
            continue
        body.pop("stream", None)
        body.pop("stream_options", None)
        valid.append((i, cid, url, orjson.dumps(body)))
    return valid, bad


def custom_ids(raw: bytes) -> dict[int, str | None]:
    """Line index -> custom_id (``None`` when unreadable), indexed as :func:`parse_input`."""
    out: dict[int, str | None] = {}
    index = 0
    for line in raw.split(b"\n"):
        if not line.strip():
            continue
        try:
            obj = orjson.loads(line)
            cid = obj.get("custom_id") if isinstance(obj, dict) else None
        except orjson.JSONDecodeError:
            cid = None
        out[index] = cid if isinstance(cid, str) else None
        index += 1
    return out


def _error(code: str, message: str) -> dict[str, Any]:
    return {"code": code, "message": message}


class BatchManager(BackgroundSync):
    """Moves batches through their statuses (see the module docstring): a tick at once
    when woken (:meth:`wake`: a new or cancelled batch), else every ``tick_s``, backing
    off while Redis fails (twice as long per failed tick, at most 5 s), until
    :meth:`request_stop` or a cancel."""

    def __init__(self, store: BatchStore, *, tick_s: float = 0.2, output_expires_s: int | None = None) -> None:
        import redis.exceptions

        super().__init__("batch-manager", interval_s=tick_s, round_timeout_s=None, logger=log)
        self.outage_errors = (redis.exceptions.RedisError, OSError)
        self.store = store
        self.owner = uuid.uuid4().hex
        self._busy: set[str] = set()
        self.store_error: str | None = None  # why the last tick could not reach Redis (None: it could)
        self.output_expires_s = output_expires_s  # batch.output_file_expires_s
        self._next_expiry = 0.0
        self._indexed = False  # the per-owner keys cover every record (BatchStore.ensure_indexes)

    async def sync_once(self) -> None:
        await self.tick()

    def down_message(self, e: BaseException) -> tuple[Any, ...]:
        return ("batch manager: Redis error (%s); retrying with backoff", reason(e))

    def back_message(self) -> tuple[Any, ...]:
        return ("batch manager: Redis is back",)

    def unexpected(self, e: Exception) -> None:
        log.exception("batch manager tick failed")  # noqa: LOG004 - called in the loop's except block

    def delay(self, elapsed_s: float) -> float:
        return min(self.interval_s * 2 ** min(self.failures, 5), 5.0)

    def on_down(self, e: BaseException) -> None:
        self.store_error = reason(e)

    def on_up(self) -> None:
        self.store_error = None

    async def tick(self) -> None:
        if not self._indexed:
            self._indexed = await self.store.ensure_indexes()
        now = time.monotonic()
        if now >= self._next_expiry:  # files past their expires_at, a hundred per second at most
            self._next_expiry = now + 1.0
            n = await self.store.expire_files(time.time())
            if n:
                log.info("batch: %d expired files deleted", n)
        for bid in await self.store.active_ids():
            if self.stopping.is_set():
                return
            raise_if_cancel_swallowed()
            if bid in self._busy:
                continue
            self._busy.add(bid)
            try:
                await self.step(bid)
            finally:
                self._busy.discard(bid)

    async def step(self, bid: str) -> None:
        f = await self.store.batch_fields(bid)
        if f is None:
            await self.store.deactivate(bid, None)
            return
        status, closing = f["status"], f.get("closing")
        if status in FINAL:
            await self.store.deactivate(bid, f.get("owner"))
            return
        now = time.time()
        expires_at = float(f["expires_at"])
        if closing is None and status in ("validating", "in_progress") and now >= expires_at:
            closing = await self.store.close_batch(bid, "expired") or None
        if closing is None and status == "cancelling" and await self.store.in_flight(bid) == 0:
            closing = await self.store.close_batch(bid, "cancelled") or None
        if closing is not None:
            await self._locked(bid, self._finalize(bid, f, closing))
        elif status == "finalizing":
            await self._locked(bid, self._finalize(bid, f, "completed"))
        elif status == "validating" or (status == "in_progress"
                                         and int(f.get("enqueued") or 0) < int(f.get("to_enqueue") or 0)):
            await self._locked(bid, self._enqueue(bid, f))

    async def _locked(self, bid: str, coro) -> None:
        if not await self.store.lock(bid, self.owner, LOCK_TTL_S):
            coro.close()
            return
        try:
            await coro
        finally:
            await self.store.unlock(bid, self.owner)

    async def _read_input(self, f: dict[str, str]) -> bytes | None:
        try:
            return await asyncio.to_thread(self.store.path(f["input_file_id"]).read_bytes)
        except OSError:
            return None

    async def _enqueue(self, bid: str, f: dict[str, str]) -> None:
        raw = await self._read_input(f)
        if raw is None:
            await self.store.finish(bid, "failed", None, None, _errors("file_not_found", "The input file is gone.",
                                                                      "input_file_id"))
            return
        valid, bad = await asyncio.to_thread(parse_input, raw, f["endpoint"])
        total = len(valid) + len(bad)
        if total == 0:
            await self.store.finish(bid, "failed", None, None, _errors("empty_file", "The input file has no requests.",
                                                                      "input_file_id"))
            return
        if f["status"] == "validating":
            await self.store.r.hset(self.store.key("b", bid), "to_enqueue", len(valid))
            if not await self.store.start(bid, total):
                return
        await self.store.record_invalid(bid, [(index, output_line(cid, None, None, None,
                                                                  _error("invalid_request", message)))
                                              for index, cid, message in bad])
        start = int(f.get("enqueued") or 0)
        key = self.store.key("b", bid)
        for lo in range(start, len(valid), ENQUEUE_CHUNK):
            status, closing, _ = await self.store.status_of(bid)
            if closing is not None or status not in ("in_progress", "finalizing"):
                return
            chunk = valid[lo:lo + ENQUEUE_CHUNK]
            async with self.store.r.pipeline(transaction=True) as p:
                for index, cid, _url, body in chunk:
                    p.xadd(self.store.queue, {"b": bid, "i": index, "c": cid, "u": f["endpoint"], "d": body})
                p.hset(key, "enqueued", lo + len(chunk))
                await p.execute()
        log.info("batch %s: %d lines enqueued, %d malformed", bid, len(valid), len(bad))

    async def _finalize(self, bid: str, f: dict[str, str], final: str) -> None:
        results = await self.store.results(bid)
        out: list[bytes] = []
        err: list[bytes] = []
        for index in sorted(results):
            v = results[index]
            (out if v[:1] == b"o" else err).append(v[1:] + b"\n")
        if final == "expired":
            total = int(f.get("total") or 0)
            raw = await self._read_input(f) or b""
            ids = custom_ids(raw)
            missing = [i for i in range(total or len(ids)) if i not in results]
            for i in missing:
                err.append(output_line(ids.get(i), None, None, None, _error(
                    "batch_expired", "This request could not be executed before the completion window expired."))
                    + b"\n")
        hexid = bid.removeprefix("batch_")
        owner = f.get("owner")  # the batch's files are its owner's
        expires_s = int(f["output_expires_s"]) if f.get("output_expires_s") else self.output_expires_s
        out_id = await self._write(f"file-{hexid}out", f"{bid}_output.jsonl", out, owner, expires_s) if out else None
        err_id = await self._write(f"file-{hexid}err", f"{bid}_error.jsonl", err, owner, expires_s) if err else None
        await self.store.finish(bid, final, out_id, err_id)
        await self.store.r.delete(self.store.key("res", bid))
        log.info("batch %s %s: %d output lines, %d error lines", bid, final, len(out), len(err))

    async def _write(self, file_id: str, filename: str, lines: list[bytes], owner: str | None,
                     expires_s: int | None) -> str:
        """Write an output or error file: its owner's (counted in, never refused by,
        the owner's quota), expiring ``expires_s`` after it was written (``None``:
        kept)."""
        size = await asyncio.to_thread(self.store.write_file_bytes, file_id, lines)
        now = int(time.time())
        if await self.store.get_file(file_id) is None:  # a finalize run again after a crash: counted once
            await self.store.add_file({"id": file_id, "object": "file", "bytes": size, "created_at": now,
                                       "expires_at": None if expires_s is None else now + expires_s,
                                       "filename": filename, "purpose": "batch_output", "status": "processed",
                                       "status_details": None}, owner)
        return file_id


def _errors(code: str, message: str, param: str | None = None, line: int | None = None) -> dict[str, Any]:
    return {"object": "list", "data": [{"code": code, "message": message, "param": param, "line": line}]}
