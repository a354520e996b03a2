"""Writes that are not latency-critical, sent together once per loop turn.

Why: a ``send`` on loopback that wakes a receiver asleep in ``epoll_wait`` costs the
sender several times what one that finds it awake does. A gateway answering whole
responses one task step at a time spaces its sends far enough apart for a fast
client or backend to fall asleep between two; sent back to back at the end of the
turn, the receiver wakes once for several (the measurements: docs/results/cpu_profile.md,
"Fourth pass").

What goes through here: whole responses (``LeanDownstream.respond``), the close that
may follow them, and the request of a non-streamed completion to its backend. What
does not: anything of a stream before its first token (the TTFT), and the relay (whose
writes already go out back to back in :class:`gateway.upstream.relay_turns.RelayTurns`).

Order: a transport's queued writes and its queued close go out in the order queued;
``flush()`` sends everything queued at once (before a connection changes hands).
Shape: ``Sends.of(loop)`` then ``.send(transport, data)``, ``.close(transport)``,
``.flush()``; bytes, nothing returned, no error raised (a transport closed meanwhile
drops its queued bytes, as a write to it would have).
"""

from __future__ import annotations

import asyncio
from typing import Any

_PER_LOOP: dict[tuple[type, int], Any] = {}


class PerLoop:
    """One instance per event loop and subclass, made on first use by :meth:`of`
    (``RelayTurns``, :class:`Sends`). Keyed by ``id(loop)`` and checked by identity,
    so that a new loop reusing a dead one's id gets its own."""

    __slots__ = ("loop",)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> Any:
        key = (cls, id(loop))
        obj = _PER_LOOP.get(key)
        if obj is None or obj.loop is not loop:
            obj = _PER_LOOP[key] = cls(loop)
        return obj


class Sends(PerLoop):
    """The queued sends of one event loop (:meth:`of`)."""

    __slots__ = ("queue", "scheduled")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.queue: list[tuple[asyncio.WriteTransport, bytes | None]] = []
        self.scheduled = False

    def send(self, transport: asyncio.WriteTransport, data: bytes) -> None:
        """Queue ``data`` for ``transport``; it goes out at the end of this loop turn."""
        self.queue.append((transport, data))
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_soon(self.flush)

    def close(self, transport: asyncio.WriteTransport) -> None:
        """Close ``transport`` after its queued writes (at once when nothing is queued)."""
        if self.queue:
            self.queue.append((transport, None))
        else:
            transport.close()

    def flush(self) -> None:
        """Send everything queued, in order."""
        self.scheduled = False
        items, self.queue = self.queue, []
        for t, data in items:
            if data is None:
                t.close()
            elif not t.is_closing():
                t.write(data)
