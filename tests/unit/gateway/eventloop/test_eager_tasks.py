"""gateway/eventloop/eager_tasks.py: a task whose first step runs inside the caller. Checked on the
stdlib loop and on uvloop (the gateway's loop), since the task bookkeeping it relies
on (``asyncio.current_task``, cancellation, ``asyncio.timeout``, contextvars) is
per loop implementation."""

from __future__ import annotations

import asyncio
import contextvars

import pytest
import uvloop

from gateway.eventloop import eager_tasks

LOOPS = [pytest.param(asyncio.new_event_loop, id="asyncio"), pytest.param(uvloop.new_event_loop, id="uvloop")]
VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="caller")


def _run(new_loop, coro):
    loop = new_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def _start(loop: asyncio.AbstractEventLoop, coro) -> asyncio.Task:
    task, run_first_step = eager_tasks.create(loop, coro)
    run_first_step()
    return task


def _in_callback(loop: asyncio.AbstractEventLoop, fn):
    """Run ``fn`` from a plain loop callback (as a protocol's ``data_received`` is) and
    return what it returned."""
    fut = loop.create_future()
    loop.call_soon(lambda: fut.set_result(fn()))
    return fut


@pytest.mark.parametrize("new_loop", LOOPS)
def test_first_step_runs_in_the_caller_as_the_task(new_loop) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        seen: list = []
        gate = loop.create_future()

        async def work() -> str:
            seen.append(("first", asyncio.current_task()))
            await gate
            seen.append(("second", asyncio.current_task()))
            return "done"

        def start():
            task, run_first_step = eager_tasks.create(loop, work())
            assert seen == []  # nothing ran yet: the caller holds the task first
            run_first_step()
            assert seen == [("first", task)]  # ran now, as the task
            return task

        task = await _in_callback(loop, start)
        gate.set_result(None)
        assert await task == "done"
        assert seen == [("first", task), ("second", task)]

    _run(new_loop, main())


@pytest.mark.parametrize("new_loop", LOOPS)
def test_outcome_of_a_first_step_that_finishes_is_the_tasks(new_loop) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()

        async def returns() -> int:
            return 7

        async def raises() -> None:
            raise ValueError("bad request")

        assert await (await _in_callback(loop, lambda: _start(loop, returns()))) == 7
        with pytest.raises(ValueError, match="bad request"):
            await (await _in_callback(loop, lambda: _start(loop, raises())))

    _run(new_loop, main())


@pytest.mark.parametrize("new_loop", LOOPS)
def test_cancel_before_the_tasks_first_turn_reaches_the_coroutine(new_loop) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        events: list[str] = []

        async def work() -> None:
            try:
                await loop.create_future()  # never resolved
            except asyncio.CancelledError:
                events.append("cancelled inside")
                raise
            finally:
                events.append("cleanup")

        def start():
            task = _start(loop, work())
            task.cancel()  # the client left in the same loop turn
            return task

        task = await _in_callback(loop, start)
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()
        assert events == ["cancelled inside", "cleanup"]

    _run(new_loop, main())


@pytest.mark.parametrize("new_loop", LOOPS)
def test_timeout_entered_in_the_first_step_fires(new_loop) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()

        async def work() -> str:
            try:
                async with asyncio.timeout(0.01):  # needs a current task
                    await loop.create_future()
            except TimeoutError:
                return "timed out"
            return "not reached"

        assert await (await _in_callback(loop, lambda: _start(loop, work()))) == "timed out"

    _run(new_loop, main())


@pytest.mark.parametrize("new_loop", LOOPS)
def test_inside_a_running_task_it_starts_on_the_next_turn(new_loop) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        ran: list[str] = []

        async def work() -> None:
            ran.append("ran")

        task, run_first_step = eager_tasks.create(loop, work())
        run_first_step()  # we are a task: no nesting, the task starts as any task does
        assert ran == []
        await task
        assert ran == ["ran"]

    _run(new_loop, main())


@pytest.mark.parametrize("new_loop", LOOPS)
def test_the_coroutine_runs_in_its_own_context(new_loop) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        gate = loop.create_future()

        async def work() -> str:
            VAR.set("task")
            await gate
            return VAR.get()

        def start():
            return _start(loop, work()), VAR.get()

        task, caller_sees = await _in_callback(loop, start)
        assert caller_sees == "caller"
        gate.set_result(None)
        assert await task == "task"

    _run(new_loop, main())


@pytest.mark.parametrize("new_loop", LOOPS)
def test_cancel_after_the_awaited_future_completed_is_still_delivered(new_loop) -> None:
    """The task waits on the first step's future; it completes, and the task is
    cancelled before it resumed: the coroutine gets the CancelledError at its await,
    as with any task."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        gate = loop.create_future()
        events: list[str] = []

        async def work() -> None:
            try:
                await gate
                events.append("resumed normally")
            except asyncio.CancelledError:
                events.append("cancelled at the await")
                raise

        task = await _in_callback(loop, lambda: _start(loop, work()))
        await asyncio.sleep(0)  # the task's scheduled step ran: it waits on `gate`
        gate.set_result(None)
        task.cancel()  # same turn: the task has not resumed yet
        with pytest.raises(asyncio.CancelledError):
            await task
        assert events == ["cancelled at the await"]

    _run(new_loop, main())
