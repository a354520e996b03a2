"""The retry policy: which failed attempts are tried again, when, and for how long.

One :class:`RetryPolicy` (pure: no clock, no sleep) serves every loop that retries a
backend: the gateway's attempts (:class:`gateway.pipeline.retry.Retrier`, the one retry
executor: the director's attempts, the prefill leg of a disaggregated request, the
batch consumers' lines) and the offline replay's model of them
(:mod:`loadtest.replay`), from the same defaults (:data:`DEFAULT_MAX_ATTEMPTS`,
:data:`DEFAULT_BASE_BACKOFF_S`, :data:`DEFAULT_MAX_BACKOFF_S`, the ``retries`` section of
the config).

Backoff is exponential with full jitter (AWS Architecture Blog, "Exponential Backoff
And Jitter", 2015): retry ``n`` (1-based) sleeps ``uniform(0, min(max_backoff_s,
base_backoff_s * 2**(n-1)))`` seconds. Attempts are capped (``max_attempts``, the first
included) and no retry starts later than ``budget_s`` after the first attempt.

**What is retryable** (one set, for every loop): a failure to connect, a timeout, a
connection the backend broke before the answer began, and an answer with a status in
:data:`RETRYABLE_STATUSES`: 429 (the backend is busy now), 502, 503 and 504 (the fleet
in front of or behind it failed). Any other status is final: a caller's 4xx would be
refused by every backend alike, and a backend's 500 is its answer to this request
(OpenAI's SDKs likewise retry 408, 409 and 5xx on their own: the gateway's answers say
``x-should-retry`` so that they do not multiply the gateway's retries). Once a byte
reached the client, nothing is retried.
"""

from __future__ import annotations

import random

RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})
DEFAULT_MAX_ATTEMPTS = 3
DEFAULT_BASE_BACKOFF_S = 0.05
DEFAULT_MAX_BACKOFF_S = 2.0
DEFAULT_FAILED_BACKEND_COOLDOWN_S = 1.0


def retryable_status(status: int | None) -> bool:
    """Whether an attempt answered with ``status`` (``None``: no answer at all, a
    connection error or a timeout) may be tried again."""
    return status is None or status in RETRYABLE_STATUSES


class RetryPolicy:
    """Retry decisions for attempts (seconds throughout).

    ``max_attempts``: attempts in all; ``base_backoff_s`` / ``max_backoff_s``: the
    full-jitter backoff; ``budget_s``: no retry starts later than this after the first
    attempt (``None``: no bound); ``max_retry_after_s``: the longest ``Retry-After`` a
    request waits for when no other backend can take it.
    """

    __slots__ = ("max_attempts", "base_backoff_s", "max_backoff_s", "budget_s", "max_retry_after_s", "rng")

    def __init__(self, max_attempts: int = DEFAULT_MAX_ATTEMPTS, base_backoff_s: float = DEFAULT_BASE_BACKOFF_S,
                 max_backoff_s: float = DEFAULT_MAX_BACKOFF_S, budget_s: float | None = None,
                 max_retry_after_s: float = 0.0, rng: random.Random | None = None) -> None:
        self.max_attempts = max_attempts
        self.base_backoff_s = base_backoff_s
        self.max_backoff_s = max_backoff_s
        self.budget_s = budget_s
        self.max_retry_after_s = max_retry_after_s
        self.rng = rng or random.Random()

    def backoff_s(self, retry: int) -> float:
        """The sleep before retry number ``retry`` (1-based), full jitter."""
        return self.rng.uniform(0.0, min(self.max_backoff_s, self.base_backoff_s * (2 ** (retry - 1))))

    def within_budget(self, started_at: float, at: float) -> bool:
        """Whether an attempt starting at ``at`` is within the budget of a request
        whose first attempt began at ``started_at``."""
        return self.budget_s is None or at - started_at <= self.budget_s

    def after_failure(self, retryable: bool, attempts: int, started_at: float, now: float) -> float | None:
        """The sleep before the next attempt after attempt number ``attempts`` failed
        (``retryable``: its failure may be tried again; the first attempt began at
        ``started_at``), or ``None`` when the request must fail now: the failure is
        final, the attempts are spent or the retry would start past the budget."""
        if not retryable or attempts >= self.max_attempts:
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
