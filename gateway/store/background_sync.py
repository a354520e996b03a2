"""One background loop for every store that syncs with Redis, and the batch loops.

The routing state (:mod:`gateway.store.routing_state`), the per-key limits
(:class:`gateway.tenancy.limits.LimiterSync`), the usage ledger
(:class:`gateway.tenancy.usage_ledger.UsageSync`) and the batch manager and consumers
(:mod:`gateway.batch`) each run a round again and again in the background. What they
share lives here, once: :class:`BackgroundSync` owns the loop, its pace, the bound on
a round, the log lines of an outage and of the recovery (one each, however long the
outage), the ``up`` flag the metrics read, cancellation and stop. A subclass supplies
its round (:meth:`BackgroundSync.sync_once`) and, when it needs them, what an outage
or a recovery does to its own state.

Why a loop checks :func:`raise_if_cancel_swallowed` at every turn: see that function.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any


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


def _wake_up(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class BackgroundSync:
    """Runs :meth:`sync_once` every ``interval_s`` seconds until stopped or cancelled.

    - A round is bounded by ``round_timeout_s`` (``None``: unbounded); it uses
      ``asyncio.timeout``, not ``asyncio.wait_for``, whose Python 3.11 version can
      swallow a cancel and keep the loop alive at shutdown.
    - A round that raises one of :attr:`outage_errors` (by default any exception, the
      timeout included) is an outage: :meth:`down_message` is logged at the first failed
      round only, ``up`` turns false, :meth:`on_down` runs at every failed round, and the
      next round comes after :meth:`delay`. Any other exception goes to
      :meth:`unexpected` (logged with its traceback).
    - A round that succeeds sets ``up`` and ``last_ok``, logs :meth:`back_message` when
      it ends an outage, and runs :meth:`on_up`.
    - The pace (:meth:`delay`): the next round starts ``interval_s`` after the last one
      started; after a failed round, ``min(max(interval_s, 0.1), 1)`` seconds after it
      ended. :meth:`wake` starts the next round at once.
    - :meth:`start_loop` runs :meth:`run` as a task named ``name``; :meth:`request_stop`
      makes it return at its next step (even when a Redis call swallowed a cancel);
      :meth:`stop_loop` does that, cancels and waits a bounded time.

    Never raises from :meth:`run` but ``CancelledError``.
    """

    outage_errors: tuple[type[BaseException], ...] = (Exception,)

    def __init__(self, name: str, *, interval_s: float, round_timeout_s: float | None,
                 logger: logging.Logger) -> None:
        self.name = name
        self.interval_s = interval_s
        self.round_timeout_s = round_timeout_s
        self.logger = logger
        self.up = False
        self.failures = 0  # consecutive rounds failed by an outage
        self.last_ok: float | None = None  # event-loop time of the last successful round
        self.stopping = asyncio.Event()
        self._waiter: asyncio.Future | None = None
        self._task: asyncio.Task | None = None

    # ---- what a subclass supplies ----------------------------------------------------

    async def sync_once(self) -> None:
        """One round; raises on a failure."""
        raise NotImplementedError

    def down_message(self, e: BaseException) -> tuple[Any, ...]:
        """The warning (format and arguments) logged when an outage starts."""
        return ("%s: shared store unreachable (%s)", self.name, type(e).__name__)

    def back_message(self) -> tuple[Any, ...] | None:
        """The warning logged when an outage ends (``None``: nothing)."""
        return None

    def on_down(self, e: BaseException) -> None:
        """After every round that failed with an outage error."""

    def on_up(self) -> None:
        """After every successful round."""

    def unexpected(self, e: Exception) -> None:
        """A round raised an exception that is not an outage (a bug)."""
        self.logger.exception("%s failed", self.name)  # noqa: LOG004 - called in the loop's except block

    def delay(self, elapsed_s: float) -> float:
        """Seconds to wait before the next round; the last one took ``elapsed_s``."""
        if self.failures:
            return min(max(self.interval_s, 0.1), 1.0)
        return max(self.interval_s - elapsed_s, 0.0)

    # ---- the loop ----------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.stopping.is_set():
            raise_if_cancel_swallowed()
            started = loop.time()
            try:
                async with asyncio.timeout(self.round_timeout_s):
                    await self.sync_once()
            except asyncio.CancelledError:
                raise
            except self.outage_errors as e:
                raise_if_cancel_swallowed()
                self._failed(e)
            except Exception as e:  # noqa: BLE001 - a bug in a round must not end the loop
                raise_if_cancel_swallowed()
                self.unexpected(e)
            else:
                raise_if_cancel_swallowed()
                self._succeeded(loop.time())
            if self.stopping.is_set():
                break
            await self._pause(loop, self.delay(loop.time() - started))

    def _failed(self, e: BaseException) -> None:
        self.failures += 1
        if self.failures == 1:
            self.logger.warning(*self.down_message(e))
        self.up = False
        self.on_down(e)

    def _succeeded(self, now: float) -> None:
        if self.failures:
            msg = self.back_message()
            if msg is not None:
                self.logger.warning(*msg)
        self.failures = 0
        self.up = True
        self.last_ok = now
        self.on_up()

    async def _pause(self, loop: asyncio.AbstractEventLoop, delay: float) -> None:
        # asyncio.sleep's own mechanism (a future and a timer), plus wake() to end it early
        fut = self._waiter = loop.create_future()
        timer = loop.call_later(max(delay, 0.0), _wake_up, fut)
        try:
            await fut
        finally:
            timer.cancel()
            self._waiter = None

    # ---- lifecycle ---------------------------------------------------------------------

    def wake(self) -> None:
        """Start the next round now (a wake during a round is not kept)."""
        if self._waiter is not None:
            _wake_up(self._waiter)

    def start_loop(self) -> asyncio.Task:
        """Run the loop as a task named :attr:`name` (returned)."""
        self._task = asyncio.create_task(self.run(), name=self.name)
        return self._task

    def request_stop(self) -> None:
        """Make :meth:`run` return at its next step, without a cancel."""
        self.stopping.set()
        self.wake()

    async def stop_loop(self, wait_s: float) -> None:
        """Stop the loop: :meth:`request_stop`, cancel it and wait at most ``wait_s``
        seconds, so a shutdown never hangs on a task that missed its cancel."""
        task, self._task = self._task, None
        self.request_stop()
        if task is None:
            return
        task.cancel()
        await asyncio.wait({task}, timeout=wait_s)
        if not task.done():
            self.logger.warning("a Redis sync loop did not stop within %.1f s of its cancel; leaving it", wait_s)
