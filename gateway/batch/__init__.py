"""Batch work: the OpenAI Files and Batches API, a Redis Streams queue, and consumers
that drain it through the gateway's routing at a lower priority.

| module | holds |
|---|---|
| :mod:`~gateway.batch.job_store` | Redis keys and scripts (why Streams, how exactly-once output), files on disk |
| :mod:`~gateway.batch.api` | ``/v1/files`` and ``/v1/batches`` handlers |
| :mod:`~gateway.batch.batch_runtime` | what the app holds for batch work, and its key |
| :mod:`~gateway.batch.manager` | the life cycle: validate + enqueue, finalize, expire, cancel |
| :mod:`~gateway.batch.batch_gate` | the batch priority class (interactive TTFT SLO, maximum share) |
| :mod:`~gateway.batch.worker` | consumers (``XREADGROUP``/``XAUTOCLAIM``), retries |
| :mod:`~gateway.batch.senders` | how a consumer sends a line: over HTTP, or in process |
| :mod:`~gateway.batch.output_lines` | the lines of output and error files, and their ``usage`` |
| :mod:`~gateway.batch.cli` | ``python -m gateway.batch`` (consumers) and ``... run`` (local mode) |

:func:`setup_batch` is the only thing the app calls.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from gateway.errors import reason
from gateway.runtime import STATE
from gateway.store.background_sync import BackgroundSync

log = logging.getLogger("gateway.batch")


def setup_batch(app: web.Application, cfg) -> None:
    """Add the Files/Batches routes, the batch gate (completion requests marked
    ``x-turbo-priority: batch`` pass it: :func:`gateway.pipeline.director.handle`)
    and the manager (plus ``batch.workers`` in-process consumers) to ``app`` when
    ``batch.enabled``."""
    b = cfg.batch
    if not b.enabled:
        return
    from gateway.batch.api import add_routes
    from gateway.batch.batch_gate import BatchGate, GateCollector
    from gateway.batch.batch_runtime import BATCH, BatchRuntime
    from gateway.batch.job_store import BatchStore
    from gateway.batch.manager import BatchManager

    state = app[STATE]
    store = BatchStore.from_url(b.redis_url or cfg.state.url, cfg.state.namespace, b.files_dir)
    gate = BatchGate(state, b)
    state.metrics.registry.register(GateCollector(gate))
    rt = BatchRuntime(b, store, BatchManager(store, output_expires_s=b.output_file_expires_s), gate)
    app[BATCH] = rt
    state.batch_gate = gate
    add_routes(app)
    app.cleanup_ctx.append(_lifecycle)


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    from gateway.batch.batch_runtime import BATCH
    from gateway.batch.senders import LocalSender
    from gateway.batch.worker import Consumer

    rt = app[BATCH]
    tasks = rt.tasks
    try:
        await rt.store.ensure_group()
    except Exception as e:  # noqa: BLE001 - Redis down at start: the manager and consumers retry
        log.warning("batch: cannot reach Redis at start (%s); retrying in the background", reason(e))
    loops: list[BackgroundSync] = [rt.manager]
    if rt.cfg.workers == 0:
        log.warning("batch: batch.workers is 0, so this gateway drains no batch line itself: batches stay "
                    "in_progress until a `python -m gateway.batch` consumer drains the queue")
    if rt.cfg.workers > 0:
        sender = LocalSender(app[STATE], rt.gate, rt.cfg.request_timeout_s)
        rt.consumer = Consumer(rt.store, sender, rt.cfg, concurrency=rt.cfg.workers)
        loops.append(ConsumerLoop(rt.consumer))
    tasks.extend(loop.start_loop() for loop in loops)
    try:
        yield
    finally:
        # Stop flags first: the consumer then drains on its own (its lines in flight get
        # batch.drain_timeout_s, the rest is handed back to other consumers). Then cancel,
        # after a bound that covers the drain and the hand-back: a cancel alone can be
        # swallowed by a Redis call (gateway.store.background_sync.raise_if_cancel_swallowed),
        # and a loop that missed it would keep this gather, and so the gateway's shutdown,
        # waiting forever.
        for loop in loops:
            loop.request_stop()
        try:
            consumers = [t for t in tasks if t.get_name() == "batch-consumer"]
            if consumers:
                await asyncio.wait(consumers, timeout=rt.cfg.drain_timeout_s + 15.0)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await rt.store.close()


class ConsumerLoop(BackgroundSync):
    """Runs a :class:`~gateway.batch.worker.Consumer` until :meth:`request_stop` (its
    ``stop`` event: it then drains), restarting it a second after it fails."""

    outage_errors = ()  # a consumer retries Redis itself: what ends it is logged every time

    def __init__(self, consumer) -> None:
        super().__init__("batch-consumer", interval_s=1.0, round_timeout_s=None, logger=log)
        self.consumer = consumer

    async def sync_once(self) -> None:
        await self.consumer.run(self.stopping)

    def unexpected(self, e: Exception) -> None:
        log.warning("batch consumer stopped (%s); restarting", reason(e))

    def delay(self, elapsed_s: float) -> float:
        return self.interval_s
