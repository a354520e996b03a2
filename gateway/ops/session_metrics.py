"""The metrics of sessions (:mod:`routing.sessions`), read from the decision core at
scrape time: the sessions held and the learned horizon they are kept for, and the
turns placed by kind."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class SessionCollector(Collector):
    """``turbo_gateway_sessions_active``, ``turbo_gateway_session_expiry_seconds`` and
    ``turbo_gateway_session_placements_total`` of ``core`` (a
    :class:`routing.core.DecisionCore`)."""

    def __init__(self, core) -> None:
        self.core = core

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        table = self.core.router.sessions
        active = GaugeMetricFamily("turbo_gateway_sessions_active",
                                   "Sessions this replica holds a home for (seen within the learned expiry)")
        active.add_metric([], len(table))
        expiry = GaugeMetricFamily(
            "turbo_gateway_session_expiry_seconds", "How long a waiting session is kept: learned from the gaps "
            "between sessions' turns, at most sessions.ttl_s")
        expiry.add_metric([], table.expiry_s)
        placed = CounterMetricFamily(
            "turbo_gateway_session_placements", "Turns of a session routed, by placement: home (the backend "
            "holding its KV cache), moved (elsewhere: cheaper, or the home could not serve it) or new",
            labels=["placement"])
        for kind, n in table.placements.items():
            placed.add_metric([kind], n)
        yield from (active, expiry, placed)
