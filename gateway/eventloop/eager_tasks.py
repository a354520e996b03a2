"""Tasks whose first step runs at once, inside the caller, instead of on the next turn
of the event loop.

Why: a request that arrives in an I/O callback would otherwise wait, as a freshly
scheduled task, until every other callback of that loop iteration has run; with
hundreds of streams relayed on one core those iterations are long, and that wait is
added TTFT. Run eagerly, a request's first step (auth, parsing, routing, writing the
request to the backend) happens in the callback that read it, and the task is needed
only from its first real wait on.

This is what Python 3.12's ``asyncio.eager_task_factory`` does; it is done here by
hand because the gateway supports Python 3.11, and because the caller must hold the
task before its first step runs (the step may finish the request and start the next
one on the same connection, which replaces the caller's handle).

Shape: :func:`create` returns ``(task, run_first_step)``; the caller stores the task,
then calls ``run_first_step()`` once. The coroutine runs with the task as
``asyncio.current_task()`` (so ``asyncio.timeout`` works) and in the task's own
``contextvars`` context. An exception or return in the first step becomes the task's
outcome at its first scheduled step, exactly as for a task that ran it there; a cancel
that arrives before that step reaches the coroutine where it waits.

Cost: the task still takes the step the loop scheduled for it when it was made (it
hands the loop what the coroutine waits on), one step more than a plain task, which
is why the data plane starts only streamed requests this way.
"""

from __future__ import annotations

import asyncio
import contextvars
import types
from collections.abc import Callable, Coroutine
from typing import Any

try:  # C-accelerated in CPython 3.11-3.13: the bookkeeping behind asyncio.current_task()
    from asyncio.tasks import _enter_task, _leave_task
except ImportError:  # pragma: no cover - another interpreter: run the first step as a normal task does
    _enter_task = _leave_task = None  # type: ignore[assignment]  # None: not available here


class _Outcome:
    """How the eager first step ended: returned ``value`` or raised ``error``."""

    __slots__ = ("value", "error")

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error


_NOT_RUN = object()


@types.coroutine
def _rest(coro: Coroutine, box: list[Any]):
    """What the task runs: the rest of ``coro`` after its eager first step.

    A generator (stepped by the task's C fast path) primed past its first ``yield``
    before the task sees it, so that a cancel arriving before the task's first turn
    lands in ``try`` here and is handed to ``coro``; from then on it delegates to
    ``coro`` with ``yield from``, so the task waits on exactly the futures ``coro``
    awaits, without a Python call per step."""
    cancel: BaseException | None = None
    try:
        yield  # primed: the task's first step resumes (or throws) here
    except BaseException as e:  # noqa: BLE001 - cancelled before its first turn: handed to coro
        cancel = e
    first = box[0]
    if first is _NOT_RUN:  # the first step did not run eagerly: an ordinary task
        if cancel is not None:
            coro.close()
            raise cancel
        return (yield from coro)
    if type(first) is _Outcome:  # the first step finished the coroutine
        if first.error is not None:
            raise first.error
        return first.value
    if cancel is None:  # wait for what the first step waits on; the coroutine reads its outcome
        try:
            yield first  # as the coroutine yielded it (a future still marked blocking, or None)
        except BaseException as e:  # noqa: BLE001 - handed on below
            # the future's own outcome reaches the coroutine through its await; anything
            # else thrown here (a cancel while the future was already done) is handed on
            if first is None or not first.done() or (not first.cancelled() and first.exception() is not e):
                cancel = e
    if cancel is not None:
        return (yield from _throw(coro, cancel))
    return (yield from coro)


@types.coroutine
def _throw(coro: Coroutine, exc: BaseException):
    """Throw ``exc`` into the suspended ``coro``, then drive it to its end."""
    try:
        y = coro.throw(exc)
    except StopIteration as e:
        return e.value
    while True:
        try:
            v = yield y
        except BaseException as e:  # noqa: BLE001 - thrown into coro
            try:
                y = coro.throw(e)
            except StopIteration as s:
                return s.value
        else:
            try:
                y = coro.send(v)
            except StopIteration as s:
                return s.value


def create(loop: asyncio.AbstractEventLoop, coro: Coroutine) -> tuple[asyncio.Task, Callable[[], None]]:
    """A task for ``coro`` and the function that runs its first step now.

    Call ``run_first_step()`` at once, from a plain callback (no task running): from
    inside another task it does nothing and the task starts on the next loop turn as
    usual. Never raises: the first step's exception is the task's.
    """
    box: list[Any] = [_NOT_RUN]
    rest = _rest(coro, box)
    next(rest)  # prime it (see _rest)
    ctx = contextvars.copy_context()
    task = loop.create_task(rest, context=ctx)  # its first step is scheduled: it collects the outcome

    def run_first_step() -> None:
        if _enter_task is None or task.done() or asyncio.current_task(loop) is not None:
            return
        _enter_task(loop, task)
        try:
            box[0] = ctx.run(coro.send, None)
        except StopIteration as e:
            box[0] = _Outcome(e.value)
        except BaseException as e:  # noqa: BLE001 - the task raises it in its first step
            box[0] = _Outcome(error=e)
        finally:
            _leave_task(loop, task)

    return task, run_first_step
