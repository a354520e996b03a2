"""The one retry executor: a request's attempts under the retry policy.

:class:`Retrier` counts one request's attempts on a backend and says, after each
failure, whether and after how long the next one starts, under the
:class:`~routing.retry.RetryPolicy` (pure: which failures retry, the full-jitter
backoff, the attempts cap, the budget, ``Retry-After``; the retryable set is
:data:`routing.retry.RETRYABLE_STATUSES`, documented there). Every loop that retries a
backend uses it: the director's attempts (:func:`gateway.pipeline.attempt.with_retries`),
the prefill leg (:mod:`gateway.pipeline.prefill`) and the batch consumers' lines
(:func:`gateway.batch.line_attempts.run_with_retries`); the offline replay models the same
policy with the same defaults. Failures are classified once, as
:class:`~gateway.errors.UpstreamError` subclasses with ``retryable``, or by status with
:func:`~routing.retry.retryable_status`.
"""

from __future__ import annotations

import asyncio
import email.utils
import random
import time
from typing import Any

from routing.core import RETRYABLE_STATUSES, RetryPolicy, retryable_status

__all__ = ["RETRYABLE_STATUSES", "Retrier", "RetryPolicy", "parse_retry_after", "policy_from_config",
           "retryable_status"]


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


def policy_from_config(retries: Any, rng: random.Random | None = None) -> RetryPolicy:
    """The policy of the ``retries`` section of the config (:class:`gateway.config.Retries`)."""
    return RetryPolicy(retries.max_attempts, retries.base_backoff_s, retries.max_backoff_s, retries.budget_s,
                       retries.max_retry_after_s, rng)


class Retrier:
    """One request's attempts under ``policy``, its first one started at loop time
    ``started_at`` (the budget counts from there). :meth:`started` counts an attempt;
    after it failed, :meth:`after_failure` gives the backoff before the next one (or
    ``None``: fail now) and :meth:`backoff` sleeps it."""

    __slots__ = ("attempts", "policy", "started_at")

    def __init__(self, policy: RetryPolicy, started_at: float) -> None:
        self.policy = policy
        self.started_at = started_at
        self.attempts = 0

    def started(self) -> None:
        self.attempts += 1

    def after_failure(self, retryable: bool, now: float) -> float | None:
        """The sleep before the next attempt after the last one failed at ``now``
        (``retryable``: its failure may be tried again), or ``None`` when the request
        must fail now."""
        return self.policy.after_failure(retryable, self.attempts, self.started_at, now)

    def may_wait(self, wait_s: float, now: float, breaker_open: bool = False) -> bool:
        """Whether the request may wait ``wait_s`` for a backend that none can take now
        (``breaker_open``: that backend is behind an open circuit breaker)."""
        return self.policy.may_wait(wait_s, self.attempts, self.started_at, now, breaker_open=breaker_open)

    def within_budget(self, now: float) -> bool:
        return self.policy.within_budget(self.started_at, now)

    @staticmethod
    async def backoff(delay: float) -> None:
        await asyncio.sleep(delay)
