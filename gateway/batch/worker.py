"""Queue consumers: drain batch lines through the gateway's routing at batch priority.

A :class:`Consumer` (one per process, ``concurrency`` lines at a time) reads entries
with ``XREADGROUP``, takes over entries a dead consumer left pending longer than
``visibility_timeout_s`` with ``XAUTOCLAIM``, and heartbeats the entries it holds
(``XCLAIM ... JUSTID`` resets their idle time) so that a long line is never taken from a
live consumer. A consumer told to stop takes no new line, gives the lines in flight
``drain_timeout_s`` to finish, then cancels the rest and hands their entries back, so that
another consumer takes them at once rather than after the visibility timeout. Why
streams, and how exactly-once output follows: :mod:`gateway.batch.job_store`.

Each line is sent by a *sender* (:mod:`gateway.batch.senders`). A line's result is
recorded with its ``usage`` (:func:`gateway.batch.output_lines.line_usage`), which the
batch object sums exactly once per line, as OpenAI's batch ``usage`` does.

Per line: its attempts and what is retried are
:func:`gateway.batch.line_attempts.run_with_retries`'s. A cancelled or expired batch's
lines are acknowledged and dropped before they are sent.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import socket
import time
import uuid

from gateway.batch.job_store import GROUP, BatchStore
from gateway.batch.line_attempts import run_with_retries
from gateway.batch.output_lines import line_usage
from gateway.config import Batch
from gateway.errors import reason
from gateway.pipeline.retry import RetryPolicy
from gateway.store.background_sync import raise_if_cancel_swallowed
from gateway.tenancy.keys import ANONYMOUS

log = logging.getLogger("gateway.batch")

_STATUS_TTL_S = 0.25
def consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Consumer:
    """Drains the batch queue with up to ``concurrency`` lines in flight."""

    def __init__(self, store: BatchStore, sender, cfg: Batch, *, concurrency: int, name: str | None = None,
                 rng: random.Random | None = None) -> None:
        self.store = store
        self.sender = sender
        self.cfg = cfg
        self.concurrency = max(concurrency, 1)
        self.name = name or consumer_name()
        self.rng = rng or random.Random()
        self.held: dict[str, asyncio.Task] = {}
        self.lines: dict[str, tuple[str, int]] = {}  # entry id -> (batch id, line index) being sent
        self._slot = asyncio.Event()
        self._status: dict[str, tuple[float, tuple[str | None, str | None, float | None]]] = {}
        self._owners: dict[str, str] = {}  # batch id -> its owner's key name (never changes)
        self.processed = 0
        self.reclaimed = 0
        self.handed_back = 0

    async def run(self, stop: asyncio.Event, *, hurry: asyncio.Event | None = None) -> None:
        """Consume until ``stop`` is set, then drain: take no new line, give the lines in
        flight up to ``drain_timeout_s`` to finish (none once ``hurry`` is set), cancel
        the rest and hand their entries back (:meth:`BatchStore.hand_back`) so that
        another consumer takes them at once. On an error or a cancel of this task the
        lines are cancelled and handed back without a drain."""
        await self.store.ensure_group()
        hb_stop = asyncio.Event()
        hb = asyncio.create_task(self._heartbeat(hb_stop))
        unstarted: list[str] = []  # entries read after stop was set
        try:
            await self._take_lines(stop, unstarted)
            await self._drain(hurry)
        finally:
            await self._release(hb, hb_stop, unstarted)

    async def _take_lines(self, stop: asyncio.Event, unstarted: list[str]) -> None:
        import redis.exceptions

        vis_ms = int(self.cfg.visibility_timeout_s * 1000)
        next_claim = 0.0
        errors = 0
        while not stop.is_set():
            raise_if_cancel_swallowed()
            free = self.concurrency - len(self.held)
            if free <= 0:
                self._slot.clear()
                await _wait_any(self._slot, stop, 1.0)
                continue
            try:
                entries: list[tuple[bytes, dict]] = []
                now = time.monotonic()
                if now >= next_claim:
                    next_claim = now + min(self.cfg.visibility_timeout_s / 2, 5.0)
                    res = await self.store.r.xautoclaim(self.store.queue, GROUP, self.name, vis_ms,
                                                        start_id="0-0", count=free)
                    claimed = [e for e in res[1] if e and e[1]]
                    self.reclaimed += len(claimed)
                    if claimed:
                        log.info("consumer %s reclaimed %d lines (handed back by a stopping consumer, or left "
                                 "by a dead one)", self.name, len(claimed))
                        next_claim = now  # there may be more
                    entries += claimed
                if len(entries) < free:
                    got = await self.store.r.xreadgroup(GROUP, self.name, {self.store.queue: ">"},
                                                        count=free - len(entries), block=500)
                    for _stream, items in got or []:
                        entries += [e for e in items if e and e[1]]
                errors = 0
            except (redis.exceptions.RedisError, OSError) as e:
                errors += 1
                log.warning("consumer %s: Redis error (%s); retrying", self.name, reason(e))
                await _wait_any(stop, None, min(0.2 * 2 ** min(errors, 5), 5.0))
                continue
            for entry_id, fields in entries:
                eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                if stop.is_set():  # read while stopping: not started, handed back with the rest
                    unstarted.append(eid)
                    continue
                if eid in self.held:
                    continue
                t = asyncio.create_task(self._line(eid, fields))
                self.held[eid] = t
                t.add_done_callback(functools.partial(self._done, eid))

    async def _drain(self, hurry: asyncio.Event | None) -> None:
        """Wait up to ``drain_timeout_s`` (or until ``hurry`` is set) for the lines in flight."""
        tasks = set(self.held.values())
        if not tasks or self.cfg.drain_timeout_s <= 0 or (hurry is not None and hurry.is_set()):
            return
        log.info("consumer %s: stopping; %d lines in flight get up to %.0f s to finish", self.name, len(tasks),
                 self.cfg.drain_timeout_s)
        waits: set[asyncio.Future] = set(tasks)
        hurried = asyncio.ensure_future(hurry.wait()) if hurry is not None else None
        if hurried is not None:
            waits.add(hurried)
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        try:
            while tasks and time.monotonic() < deadline:
                done, _ = await asyncio.wait(waits, timeout=deadline - time.monotonic(),
                                             return_when=asyncio.FIRST_COMPLETED)
                if hurried is not None and hurried in done:
                    return
                tasks -= done
                waits -= done
        finally:
            if hurried is not None:
                hurried.cancel()

    async def _release(self, hb: asyncio.Task, hb_stop: asyncio.Event, unstarted: list[str]) -> None:
        """Cancel the lines still running, stop the heartbeat, hand their entries back."""
        left = list(self.held) + unstarted
        tasks = list(self.held.values())
        deadline = time.monotonic() + 5.0
        while tasks and time.monotonic() < deadline:
            # repeated: a Redis call inside a line can swallow one cancel (raise_if_cancel_swallowed)
            for t in tasks:
                t.cancel()
            await asyncio.wait(tasks, timeout=0.2)
            tasks = [t for t in tasks if not t.done()]
        # The heartbeat finishes its round (an XCLAIM landing after the hand-back would
        # make the entries idle-fresh again); only a stuck one is cancelled.
        hb_stop.set()
        await asyncio.wait({hb}, timeout=2.0)
        hb.cancel()
        await asyncio.gather(hb, return_exceptions=True)
        if not left:
            return
        try:
            async with asyncio.timeout(5.0):
                n = await self.store.hand_back(self.name, left)
        except Exception as e:  # noqa: BLE001 - any store failure: the lines come back by their timeout
            log.warning("consumer %s: could not hand back %d unfinished lines (%s); other consumers take them "
                        "after visibility_timeout_s", self.name, len(left), e)
            return
        self.handed_back += n
        if n:
            log.info("consumer %s: handed back %d unfinished lines for other consumers", self.name, n)

    def _done(self, eid: str, _task: asyncio.Task) -> None:
        self.held.pop(eid, None)
        self.lines.pop(eid, None)
        self._slot.set()

    async def _heartbeat(self, stop: asyncio.Event) -> None:
        """Every third of the visibility timeout, until ``stop`` is set: reset the idle
        time of the entries held and renew the in-flight leases of the lines being sent."""
        import redis.exceptions

        every = self.cfg.visibility_timeout_s / 3
        while True:
            await _wait_any(stop, None, every)
            if stop.is_set():
                return
            ids = list(self.held)
            if not ids:
                continue
            try:
                await self.store.r.xclaim(self.store.queue, GROUP, self.name, 0, ids, justid=True)
                lines = list(self.lines.values())
                if lines:  # lines being sent stay "in flight" (a cancel waits for them) while we live
                    async with self.store.r.pipeline(transaction=False) as p:
                        for batch_id, index in lines:
                            p.zadd(self.store.key("fly", batch_id), {str(index): time.time()
                                                                     + self.cfg.visibility_timeout_s}, xx=True)
                        await p.execute()
            except (redis.exceptions.RedisError, OSError) as e:
                log.warning("consumer %s: heartbeat failed (%s)", self.name, reason(e))

    async def _batch_status(self, batch_id: str, fresh: bool = False) -> tuple[str | None, str | None, float | None]:
        now = time.monotonic()
        hit = self._status.get(batch_id)
        if hit is not None and not fresh and now - hit[0] < _STATUS_TTL_S:
            return hit[1]
        st = await self.store.status_of(batch_id)
        self._status[batch_id] = (now, st)
        return st

    async def _active(self, batch_id: str, fresh: bool = False) -> bool:
        status, closing, expires_at = await self._batch_status(batch_id, fresh)
        return (status in ("validating", "in_progress") and closing is None
                and (expires_at is None or time.time() < expires_at))

    async def _line(self, eid: str, fields: dict) -> None:
        f = {(k.decode() if isinstance(k, bytes) else k): v for k, v in fields.items()}
        try:
            batch_id = f["b"].decode()
            index = int(f["i"])
            custom_id = f["c"].decode()
            url = f["u"].decode()
            body = f["d"]
        except (KeyError, ValueError, AttributeError):
            log.warning("dropping malformed queue entry %s", eid)
            await self.store.ack(eid)
            return
        try:
            if not await self._active(batch_id) or await self.store.has_result(batch_id, index):
                await self._abandon(batch_id, index, eid)
                return
            self.lines[eid] = (batch_id, index)
            line = await self._run_line(batch_id, index, custom_id, url, body)
            if line is None:
                await self._abandon(batch_id, index, eid)
                return
            ok, data = line
            await self.store.record(batch_id, index, data, ok, eid, line_usage(data) if ok else None)
            self.processed += 1
        except asyncio.CancelledError:
            # stopping: nothing was recorded, and run() hands the entry back; stop
            # counting the line as in flight so that a cancel does not wait for it
            try:
                await asyncio.wait_for(self.store.r.zrem(self.store.key("fly", batch_id), str(index)), 1.0)
            except Exception:  # noqa: BLE001 - best effort while being cancelled
                pass
            raise
        except Exception:
            log.exception("consumer %s: line %s of %s failed unexpectedly; it stays pending", self.name, index,
                          batch_id)

    async def _abandon(self, batch_id: str, index: int, eid: str) -> None:
        await self.store.ack(eid)
        await self.store.r.zrem(self.store.key("fly", batch_id), str(index))

    async def _run_line(self, batch_id: str, index: int, custom_id: str, url: str,
                        body: bytes) -> tuple[bool, bytes] | None:
        """Attempts with backoff; returns (ok, output or error line), or ``None`` when the
        batch stopped (cancelled, expired) before the line finished."""
        cfg = self.cfg
        fly = self.store.key("fly", batch_id)
        lease_s = cfg.visibility_timeout_s  # renewed by the heartbeat while this consumer lives

        async def before_send() -> bool:
            if not await self._active(batch_id, fresh=True):  # a cancel stops the very next send
                return False
            await self.store.mark_in_flight(batch_id, index, lease_s)
            return True

        async def paused() -> None:
            await self.store.r.zrem(fly, str(index))

        policy = RetryPolicy(cfg.max_attempts, cfg.base_backoff_s, cfg.max_backoff_s, rng=self.rng)
        owner = self._owners.get(batch_id)
        if owner is None:
            owner = self._owners[batch_id] = await self.store.owner_of(batch_id) or ANONYMOUS
        return await run_with_retries(self.sender, url, body, custom_id, request_timeout_s=cfg.request_timeout_s,
                                      policy=policy, request_id=f"{batch_id}-{index}", before_send=before_send,
                                      paused=paused, key_name=owner)


async def _wait_any(ev: asyncio.Event, other: asyncio.Event | None, wait_s: float) -> None:
    waits = [asyncio.ensure_future(ev.wait())]
    if other is not None:
        waits.append(asyncio.ensure_future(other.wait()))
    try:
        await asyncio.wait(waits, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
