"""Tasks whose first step runs at once, inside the caller, instead of on the next turn
of the event loop.

Why: a request that arrives in an I/O callback would otherwise wait, as a freshly
scheduled task, until every other callback of that loop iteration has run. At 256
streams relayed on one core those iterations carry a few hundred reads each, and that
wait was 1-3 ms at the median and 5-15 ms at p99 of the gateway's added TTFT
(``python -m loadtest.peers --rig native``, scenario (c)). Run eagerly, a request's
first step (auth, parsing, routing, writing the request to the backend) happens in the
callback that read it, and the task is needed only from its first real wait on.

This is what Python 3.12's ``asyncio.eager_task_factory`` does; it is done here by
hand because the gateway supports Python 3.11, and because the caller must hold the
task before its first step runs (the step may finish the request and start the next
one on the same connection, which replaces the caller's handle).

Shape: :func:`create` returns ``(task, run_first_step)``; the caller stores the task,
then calls ``run_first_step()`` once. The coroutine runs with the task as
``asyncio.current_task()`` (so ``asyncio.timeout`` works) and in the task's own
``contextvars`` context. An exception or return in the first step becomes the task's
outcome at its first scheduled step, exactly as for a task that ran it there.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Coroutine
from typing import Any

try:  # C-accelerated in CPython 3.11-3.13: the bookkeeping behind asyncio.current_task()
    from asyncio.tasks import _enter_task, _leave_task
except ImportError:  # pragma: no cover - another interpreter: run the first step as a normal task does
    _enter_task = _leave_task = None  # type: ignore[assignment]

_NOT_RUN = object()


class _Resumed(Coroutine):
    """The coroutine the task drives: its first ``send`` hands the task what the inner
    coroutine's eager first step produced (the future it waits on, its return value
    or its exception); every later ``send``/``throw`` goes straight to the inner
    coroutine, so the task waits on exactly the futures the coroutine awaits."""

    __slots__ = ("coro", "first", "error")

    def __init__(self, coro: Coroutine) -> None:
        self.coro = coro
        self.first: Any = _NOT_RUN  # what the first step yielded
        self.error: BaseException | None = None  # how the first step ended, if it did

    def send(self, value: Any) -> Any:
        first = self.first
        if first is _NOT_RUN:  # run_first_step() was not called (or could not run): run it now
            return self.coro.send(value)
        self.first = _NOT_RUN
        if self.error is not None:
            err, self.error = self.error, None
            raise err
        return first

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:  # type: ignore[override]
        self.first = _NOT_RUN
        if self.error is not None:  # the coroutine had already ended: its own outcome stands
            err, self.error = self.error, None
            raise err
        return self.coro.throw(typ, val, tb) if val is not None or tb is not None else self.coro.throw(typ)

    def close(self) -> None:
        self.coro.close()

    def __await__(self):  # pragma: no cover - the task drives it through send/throw
        return self.coro.__await__()


def create(loop: asyncio.AbstractEventLoop, coro: Coroutine) -> tuple[asyncio.Task, Callable[[], None]]:
    """A task for ``coro`` and the function that runs its first step now.

    Call ``run_first_step()`` at once, from a plain callback (no task running): from
    inside another task it does nothing and the task starts on the next loop turn as
    usual. Never raises: the first step's exception is the task's.
    """
    wrapper = _Resumed(coro)
    ctx = contextvars.copy_context()
    task = loop.create_task(wrapper, context=ctx)  # its first step is scheduled: it collects the outcome

    def run_first_step() -> None:
        if _enter_task is None or task.done() or asyncio.current_task(loop) is not None:
            return
        _enter_task(loop, task)
        try:
            wrapper.first = ctx.run(coro.send, None)
        except BaseException as e:  # StopIteration included: the task raises it again in its first step
            wrapper.first, wrapper.error = None, e
        finally:
            _leave_task(loop, task)

    return task, run_first_step
