"""Turns for the reads of relayed streams (see :class:`RelayTurns`): the upstream
connections (:mod:`gateway.upstream.connection`) queue their reads here when the loop
is busy, and each turn relays a share of them.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Protocol

from gateway.eventloop.batched_writes import PerLoop

TURN_S = 0.001  # longest run of relayed reads between two polls of the loop (see RelayTurns)
INLINE_PER_MS = 2  # relayed reads handled in their own callback per millisecond of loop time, before turns


class TurnTaker(Protocol):
    """A connection with reads waiting for their turn
    (:class:`gateway.upstream.connection.Connection`)."""

    def run_pending(self) -> None:
        """Parse and relay the reads that waited for this connection's turn."""


class RelayTurns(PerLoop):
    """The reads of relayed streams, parsed and relayed in turns of at most
    :data:`TURN_S` seconds, between which the loop polls again.

    Why: an engine's decode step emits one event per running sequence at once, so
    with hundreds of streams the gateway reads hundreds of events in one loop
    iteration. Relayed inside their read callbacks, they would make that iteration
    long, and a new request, or the head of one, arriving meanwhile would wait for
    all of them: added TTFT. So, past :data:`INLINE_PER_MS` relayed reads in a
    millisecond of the loop's clock, a read callback of a relayed stream only queues
    the bytes; requests, heads and first tokens are still handled in their read
    callbacks; and the queued reads are relayed in FIFO turns. (A preemptive router
    gets the same effect from its threads.) Under that rate, with few streams, reads
    are relayed in their callbacks: a turn costs one more loop iteration per read.
    The measurements behind both numbers are in docs/results/cpu_profile.md
    ("Fourth pass").

    Per connection the order of bytes is kept (a connection's reads are relayed in
    one turn, before any later read of it, and before its close is handled). The
    relay's writes to clients happen inside the turn, back to back, and count
    against its time."""

    __slots__ = ("conns", "scheduled", "inline_at", "inline_left")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.conns: deque[TurnTaker] = deque()
        self.scheduled = False
        self.inline_at = -1.0  # the loop time (ms resolution on uvloop) the allowance below is for
        self.inline_left = 0

    def add(self, conn: TurnTaker) -> None:
        self.conns.append(conn)
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_soon(self.run)

    def run(self) -> None:
        self.scheduled = False
        conns = self.conns
        end = time.perf_counter() + TURN_S
        try:
            while conns:
                conns.popleft().run_pending()
                if time.perf_counter() >= end:
                    break
        finally:
            if conns and not self.scheduled:
                self.scheduled = True
                self.loop.call_soon(self.run)  # after the loop polled again
