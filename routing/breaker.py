"""Passive outlier detection: a circuit breaker per backend.

States (times are monotonic seconds, the caller's clock):

- ``closed``: requests flow; ``failure_threshold`` consecutive failed attempts open it.
- ``open``: the backend takes no new requests until ``open_until``.
- ``half_open``: after ``open_until``, one probe request at a time goes through; a
  failure re-opens the breaker, ``success_threshold`` successes close it.

Outcomes are reported through :class:`~routing.fleet.Reservation` (``outcome``), and a
probe that ends with no verdict (the client left) frees its probe slot on release.
No I/O, no clock of its own: every method takes ``now``.
"""

from __future__ import annotations

from dataclasses import dataclass

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"
_BUSY_PROBE_WAIT_S = 1.0


@dataclass(slots=True)
class CircuitBreaker:
    failure_threshold: int = 5  # 0 disables the breaker
    open_s: float = 10.0
    success_threshold: int = 1
    state: str = CLOSED
    failures: int = 0
    successes: int = 0
    open_until: float = 0.0
    probing: int = 0
    opened_total: int = 0

    def ready_at(self, now: float) -> float:
        """When the breaker lets a new request through: ``<= now`` when it does now."""
        if self.state == CLOSED:
            return 0.0
        if self.state == OPEN:
            return self.open_until
        return 0.0 if self.probing == 0 else now + _BUSY_PROBE_WAIT_S

    def dispatched(self, now: float) -> bool:
        """A request was sent to the backend; returns ``True`` when it is a probe."""
        if self.state == OPEN and now >= self.open_until:
            self.state, self.successes = HALF_OPEN, 0
        if self.state == HALF_OPEN:
            self.probing += 1
            return True
        return False

    def success(self, probe: bool) -> None:
        if probe:
            self.probing = max(self.probing - 1, 0)
        if self.state == CLOSED:
            self.failures = 0
        elif self.state == HALF_OPEN:
            self.successes += 1
            if self.successes >= self.success_threshold:
                self.state, self.failures, self.successes = CLOSED, 0, 0

    def failure(self, now: float, probe: bool) -> None:
        if probe:
            self.probing = max(self.probing - 1, 0)
        if self.failure_threshold <= 0:
            return
        if self.state == HALF_OPEN:
            self._open(now)
        elif self.state == CLOSED:
            self.failures += 1
            if self.failures >= self.failure_threshold:
                self._open(now)
        # OPEN: a request dispatched before the breaker opened failed too; nothing to add

    def abandon(self, probe: bool) -> None:
        """A request ended with no verdict on the backend (the client went away)."""
        if probe:
            self.probing = max(self.probing - 1, 0)

    def _open(self, now: float) -> None:
        self.state, self.open_until, self.successes = OPEN, now + self.open_s, 0
        self.opened_total += 1

    def configure(self, failure_threshold: int, open_s: float, success_threshold: int) -> None:
        """New settings (config reload); the current state is kept."""
        self.failure_threshold, self.open_s, self.success_threshold = failure_threshold, open_s, success_threshold
        if failure_threshold <= 0 and self.state != CLOSED:
            self.state, self.failures, self.successes = CLOSED, 0, 0
