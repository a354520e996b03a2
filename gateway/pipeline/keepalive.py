"""Keep-alive comments for streams whose first event is long in coming (``streaming``).

At its arrival plus ``keepalive_after_s``, if no event reached the client yet, a
request's 200 head and a ``: keep-alive`` SSE comment go out, then another comment
every ``keepalive_every_s`` until its first event (:meth:`KeepAlives.discard`). Attempts
go on behind the comments as before (retries, fallbacks); only a final failure can no
longer be a status, and ends the stream with an error event. Comments are not events:
no TTFT, ITL or token is counted.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from gateway.pipeline.downstream import ClientGone, Downstream
from gateway.pipeline.headers import Routed, keepalive_headers


class Waiting(Routed, Protocol):
    """A request that may get comments (a :class:`~gateway.pipeline.context.RequestContext`)."""

    @property
    def down(self) -> Downstream: ...

    @property
    def arrival(self) -> float: ...


class KeepAlives:
    """The streamed requests of one event loop whose keep-alive comments may fall due.

    One timer ticks, a quarter of the shortest interval apart (at most a second), while
    any request waits: a request costs a dict entry, not a timer of its own."""

    __slots__ = ("loop", "tick_s", "timer", "waiting")
    COMMENT = b": keep-alive\n\n"

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.waiting: dict[int, list[Any]] = {}  # id(w): [w, due loop time, every_s, comment task or None]
        self.tick_s = 1.0
        self.timer: asyncio.TimerHandle | None = None

    def add(self, w: Waiting, after_s: float, every_s: float) -> None:
        """``w``'s first comment falls due ``after_s`` seconds after its arrival."""
        self.waiting[id(w)] = [w, w.arrival + after_s, every_s, None]
        if self.timer is None:
            tick = min(after_s, every_s) / 4
            self.tick_s = min(self.tick_s, tick)
            self.timer = self.loop.call_later(self.tick_s, self._tick)

    def discard(self, w: Waiting) -> asyncio.Task[None] | None:
        """No more comments for ``w``; returns the comment being written to it, if
        any (its first event must go out after it)."""
        entry = self.waiting.pop(id(w), None)
        return entry[3] if entry is not None else None

    def _tick(self) -> None:
        now = self.loop.time()
        for key, entry in list(self.waiting.items()):
            w, due, every_s, task = entry
            if due > now:
                continue
            entry[1] = now + every_s
            down = w.down
            if down.may_wait:  # aiohttp: its writes are awaited, one at a time
                if task is None or task.done():
                    entry[3] = self.loop.create_task(down.start_stream(keepalive_headers(w), self.COMMENT))
            else:
                try:
                    down.start_stream_now(keepalive_headers(w), self.COMMENT)
                except ClientGone:
                    del self.waiting[key]  # the request's own path sees the client go
        self.timer = self.loop.call_later(self.tick_s, self._tick) if self.waiting else None


def close_comment(task: asyncio.Task[None]) -> None:
    """A keep-alive comment still in flight when its request ended: cancelled, or its
    outcome retrieved (a comment the client never read is no error)."""
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()
