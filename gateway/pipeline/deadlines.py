"""The deadlines of one attempt, in one typed object.

The transport arms the first-byte deadline (connect included: :attr:`Deadlines.first_byte_at`)
and the relay arms the idle and total ones; connects are bounded by the transport with
``connect_s``. Each deadline knows the failure its passing raises.
"""

from __future__ import annotations

from gateway.config import Timeouts
from gateway.errors import FirstByteTimeout, IdleTimeout, TotalTimeout, UpstreamError


class Deadlines:
    """The deadlines of one attempt on ``backend``, from the backend's
    :class:`~gateway.config.Timeouts` (seconds, ``None`` disables one) and the loop
    time the attempt started: ``first_byte_at`` (connect, head and first body bytes:
    ``ttft_s``, capped by ``total_s``) and ``total_at``; ``idle_s`` is checked by the
    relay between chunks. The ``*_error`` methods give the failure each one raises."""

    __slots__ = ("backend", "first_byte_at", "timeouts", "total_at")

    def __init__(self, backend: str, timeouts: Timeouts, start: float) -> None:
        self.backend = backend
        self.timeouts = timeouts
        self.total_at = start + timeouts.total_s if timeouts.total_s else None
        first = start + timeouts.ttft_s if timeouts.ttft_s else None
        if self.total_at is not None and (first is None or self.total_at < first):
            first = self.total_at
        self.first_byte_at = first

    def first_byte_error(self) -> UpstreamError:
        """What passing ``first_byte_at`` means: the total timeout when it was the
        nearer one, else the first-byte (TTFT) timeout."""
        if self.total_at is not None and self.first_byte_at == self.total_at:
            return self.total_error()
        return FirstByteTimeout(self.backend, f"backend {self.backend} sent no first byte within "
                                              f"{self.timeouts.ttft_s} s")

    def total_error(self) -> UpstreamError:
        return TotalTimeout(self.backend, f"backend {self.backend} exceeded the total timeout of "
                                          f"{self.timeouts.total_s} s")

    def idle_error(self) -> UpstreamError:
        return IdleTimeout(self.backend, f"backend {self.backend} stalled for more than "
                                         f"{self.timeouts.idle_s} s between chunks")
