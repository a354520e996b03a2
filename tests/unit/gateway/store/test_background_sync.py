"""The one background loop (gateway.store.background_sync.BackgroundSync): an outage
logged once and its end once, a bug logged and survived, wake, stop by flag and by a
cancel that a library call swallowed. Scripted rounds, no Redis."""

from __future__ import annotations

import asyncio
import logging

from gateway.store.background_sync import BackgroundSync

log = logging.getLogger("tests.background_sync")


class Scripted(BackgroundSync):
    """Each round takes the next step of ``script``: an exception to raise, or None."""

    def __init__(self, script: list[BaseException | None], interval_s: float = 0.0) -> None:
        super().__init__("scripted", interval_s=interval_s, round_timeout_s=None, logger=log)
        self.script = list(script)
        self.rounds = 0
        self.downs = 0
        self.ups = 0
        self.round_done = asyncio.Event()

    async def sync_once(self) -> None:
        self.rounds += 1
        self.round_done.set()
        step = self.script.pop(0) if self.script else None
        if not self.script:
            self.request_stop()
        if step is not None:
            raise step

    def down_message(self, e: BaseException) -> tuple:
        return ("down (%s)", type(e).__name__)

    def back_message(self) -> tuple:
        return ("back",)

    def on_down(self, e: BaseException) -> None:
        self.downs += 1

    def on_up(self) -> None:
        self.ups += 1


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == log.name]


async def test_an_outage_is_logged_once_and_its_end_once(caplog):
    caplog.set_level(logging.WARNING, logger=log.name)
    s = Scripted([OSError(), ConnectionError(), TimeoutError(), None, OSError(), None])
    s.delay = lambda elapsed_s: 0.0  # type: ignore[method-assign]
    await s.start_loop()
    assert s.rounds == 6 and s.downs == 4 and s.ups == 2
    assert _messages(caplog) == ["down (OSError)", "back", "down (OSError)", "back"]
    assert s.up and s.failures == 0 and s.last_ok is not None


async def test_a_bug_is_logged_with_its_traceback_and_the_loop_goes_on(caplog):
    caplog.set_level(logging.WARNING, logger=log.name)
    s = Scripted([ValueError("bug"), None])
    s.outage_errors = (OSError,)
    await s.start_loop()
    assert s.rounds == 2 and s.downs == 0 and s.ups == 1
    bug = [r for r in caplog.records if r.name == log.name and r.exc_info]
    assert len(bug) == 1 and bug[0].getMessage() == "scripted failed"


async def test_the_pace_after_a_success_and_after_a_failure():
    s = Scripted([], interval_s=0.05)
    assert s.delay(0.01) == 0.05 - 0.01 and s.delay(0.2) == 0.0
    s.failures = 1
    assert s.delay(0.01) == 0.1  # min(max(interval, 0.1), 1)
    s.interval_s = 30.0
    assert s.delay(0.01) == 1.0


async def test_wake_starts_the_next_round_and_request_stop_ends_the_wait():
    s = Scripted([None, None, None], interval_s=3600.0)
    task = s.start_loop()
    await s.round_done.wait()
    s.round_done.clear()
    s.wake()  # the loop waits an hour otherwise
    await s.round_done.wait()
    assert s.rounds == 2
    s.request_stop()  # no cancel: the flag ends the wait
    await task
    assert s.rounds == 2 and not task.cancelled()


class SwallowsCancel(BackgroundSync):
    """A round whose library call eats the cancel (as Python 3.11's wait_for can)."""

    def __init__(self) -> None:
        super().__init__("swallower", interval_s=0.0, round_timeout_s=None, logger=log)
        self.started = asyncio.Event()
        self.rounds_after_cancel = 0

    async def sync_once(self) -> None:
        self.started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.rounds_after_cancel += 1  # swallowed: the round returns normally


async def test_stop_loop_ends_a_loop_whose_cancel_was_swallowed():
    s = SwallowsCancel()
    s.stopping = asyncio.Event()  # never set below: only the cancel check can end the loop
    s.request_stop = lambda: None  # type: ignore[method-assign]
    task = s.start_loop()
    await s.started.wait()
    await s.stop_loop(wait_s=60.0)
    assert task.done() and task.cancelled() and s.rounds_after_cancel == 1
