"""The retry policy: which failed attempts are tried again, when, and for how long.

One :class:`RetryPolicy` serves every retry loop of the gateway: the director's
attempts, the prefill leg of a disaggregated request and the batch consumers' lines.
Backoff is exponential with full jitter (AWS Architecture Blog, "Exponential Backoff
And Jitter", 2015): retry ``n`` (1-based) sleeps ``uniform(0, min(max_backoff_s,
base_backoff_s * 2**(n-1)))`` seconds. Attempts are capped (``max_attempts``, the first
included) and no retry starts later than ``budget_s`` after the first attempt.
"""

from __future__ import annotations

import email.utils
import random
import time

from gateway.errors import UpstreamError


def parse_retry_after(value: str | None) -> float | None:
    """``Retry-After`` as seconds (delta-seconds or an HTTP date), or ``None``."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - time.time(), 0.0)


class RetryPolicy:
    """Retry decisions for attempts (seconds throughout).

    ``max_attempts``: attempts in all; ``base_backoff_s`` / ``max_backoff_s``: the
    full-jitter backoff; ``budget_s``: no retry starts later than this after the first
    attempt (``None``: no bound); ``max_retry_after_s``: the longest ``Retry-After`` a
    request waits for when no other backend can take it.
    """

    __slots__ = ("max_attempts", "base_backoff_s", "max_backoff_s", "budget_s", "max_retry_after_s", "rng")

    def __init__(self, max_attempts: int, base_backoff_s: float, max_backoff_s: float, budget_s: float | None = None,
                 max_retry_after_s: float = 0.0, rng: random.Random | None = None) -> None:
        self.max_attempts = max_attempts
        self.base_backoff_s = base_backoff_s
        self.max_backoff_s = max_backoff_s
        self.budget_s = budget_s
        self.max_retry_after_s = max_retry_after_s
        self.rng = rng or random.Random()

    @classmethod
    def from_config(cls, retries, rng: random.Random | None = None) -> RetryPolicy:
        """From the ``retries`` section of the config (:class:`gateway.config.Retries`)."""
        return cls(retries.max_attempts, retries.base_backoff_s, retries.max_backoff_s, retries.budget_s,
                   retries.max_retry_after_s, rng)

    def backoff_s(self, retry: int) -> float:
        """The sleep before retry number ``retry`` (1-based), full jitter."""
        return self.rng.uniform(0.0, min(self.max_backoff_s, self.base_backoff_s * (2 ** (retry - 1))))

    def within_budget(self, started_at: float, at: float) -> bool:
        """Whether an attempt starting at ``at`` is within the budget of a request
        whose first attempt began at ``started_at``."""
        return self.budget_s is None or at - started_at <= self.budget_s

    def after_failure(self, err: UpstreamError, attempts: int, started_at: float, now: float) -> float | None:
        """The sleep before the next attempt after ``err`` failed attempt number
        ``attempts`` (the first attempt began at ``started_at``), or ``None`` when the
        request must fail now: ``err`` is not retryable, the attempts are spent or the
        retry would start past the budget."""
        if not err.retryable or attempts >= self.max_attempts:
            return None
        delay = self.backoff_s(attempts)
        return delay if self.within_budget(started_at, now + delay) else None

    def may_wait(self, wait_s: float, attempts: int, started_at: float, now: float, *,
                 breaker_open: bool = False) -> bool:
        """Whether a request that no backend can take now may wait ``wait_s`` for one.

        A backend that asked for the wait (``Retry-After``) or cools down after a
        refused connection is waited for up to ``max_retry_after_s``. A backend behind
        an open circuit breaker (``breaker_open``) is presumed down: the request waits
        for its probe only when it is as near as one backoff (``max_backoff_s``), and
        otherwise is answered at once (503 with the probe's time as ``Retry-After``)
        instead of holding every client of a dead fleet until the budget runs out."""
        bound = min(self.max_backoff_s, self.max_retry_after_s) if breaker_open else self.max_retry_after_s
        return attempts < self.max_attempts and wait_s <= bound and self.within_budget(started_at, now + wait_s)
