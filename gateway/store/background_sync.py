"""The background loops of the stores that sync with Redis: run a round, stop.

The routing state (:mod:`gateway.store.routing_state`), the per-key limits
(:class:`gateway.tenancy.limits.LimiterSync`) and the usage ledger
(:class:`gateway.tenancy.usage_ledger.UsageSync`) run their rounds with
:func:`sync_forever` and stop with :func:`stop_sync`; every loop that calls Redis
checks :func:`raise_if_cancel_swallowed`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("gateway.store.background_sync")


async def stop_sync(task: asyncio.Task | None, client: Any, key: str, timeout_s: float) -> None:
    """Stop a background sync loop (:func:`sync_forever`) and its Redis client: cancel
    ``task``, delete this replica's ``key`` (best effort), close ``client``. Each step
    waits at most ``max(timeout_s, 1)`` seconds, so a shutdown never hangs on Redis or
    on a task that missed its cancel; never raises but ``CancelledError`` (of the caller)."""
    bound = max(timeout_s, 1.0)
    if task is not None:
        task.cancel()
        await asyncio.wait({task}, timeout=bound)
        if not task.done():
            log.warning("a Redis sync loop did not stop within %.1f s of its cancel; leaving it", bound)
    if client is None:
        return
    for step in (lambda: client.delete(key), client.aclose):
        try:
            async with asyncio.timeout(bound):
                await step()
        except Exception:  # noqa: BLE001, S110 - best effort on shutdown
            pass


def raise_if_cancel_swallowed() -> None:
    """Raise ``CancelledError`` when the current task was cancelled but the cancel never
    reached it. Background loops that call Redis check this once per round.

    Why a cancel can get lost: redis-py (the clients :func:`gateway.store.redis_client.redis_client`
    makes, which set ``socket_timeout``) sends every command through ``asyncio.wait_for``, and
    Python 3.11's ``wait_for`` *returns the result* instead of raising when the caller
    is cancelled just as the wrapped send completes (cpython bpo-42130, gh-86296; 3.12 rebuilt
    ``wait_for`` on ``asyncio.timeout``). The task then carries an unanswered cancel
    request (``Task.cancelling()`` stays above 0) and a ``while True`` loop around the
    command runs on, so whoever awaits the cancelled task at shutdown waits forever.
    Call this outside any ``asyncio.timeout`` block (a timeout that is expiring also
    counts as a cancel request until it is handled)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError("cancelled (the cancel was swallowed by a library call)")


async def sync_forever(sync_once: Callable[[], Awaitable[None]], *, interval_s: float, timeout_s: float,
                       on_error: Callable[[Exception], None], on_ok: Callable[[], None]) -> None:
    """Run ``sync_once`` every ``interval_s`` seconds until cancelled, each call bounded
    by ``timeout_s``. A failure (any exception, the timeout included) goes to
    ``on_error`` and the next try comes after ``min(max(interval_s, 0.1), 1)`` s; a
    success goes to ``on_ok``. Never raises but ``CancelledError``, and stops on a
    cancel that a Redis call swallowed (:func:`raise_if_cancel_swallowed`). Uses
    ``asyncio.timeout``, not ``asyncio.wait_for``, whose Python 3.11 version can swallow
    a cancel and keep the loop alive at shutdown."""
    loop = asyncio.get_running_loop()
    while True:
        raise_if_cancel_swallowed()
        started = loop.time()
        try:
            async with asyncio.timeout(timeout_s):
                await sync_once()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any Redis failure degrades, never crashes
            raise_if_cancel_swallowed()
            on_error(e)
            await asyncio.sleep(min(max(interval_s, 0.1), 1.0))
            continue
        raise_if_cancel_swallowed()
        on_ok()
        await asyncio.sleep(max(interval_s - (loop.time() - started), 0.0))
