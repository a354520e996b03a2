"""What other sources report of a backend's load, beside this process's own accounting.

- :class:`RemoteLoad`: the backend's load and learned speeds as the *other* gateway
  replicas hold them, summed over replicas (written by the shared-state sync).
- :class:`EngineSample`: one scrape of the engine's own metrics (written by the
  metrics scraper), which corrects the estimate's drift.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RemoteLoad:
    """The same backend's load as the *other* gateway replicas hold it (summed over
    replicas, from the shared store), with their learned speeds."""

    queued: float = 0.0
    queued_prefill_tokens: float = 0.0
    running: float = 0.0
    decode_tokens_remaining: float = 0.0
    kv_tokens: float = 0.0
    # (prefill tokens/s, TTFT overhead s, ITL base s, ITL per stream s, samples) per replica
    speeds: list[tuple[float, float, float, float, int]] = field(default_factory=list)


@dataclass(slots=True)
class EngineSample:
    """One scrape of a backend's own metrics at monotonic time ``at`` (seconds)."""

    at: float
    waiting: float
    running: float
    kv_usage: float | None  # fraction in [0, 1]
