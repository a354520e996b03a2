"""The metrics of sessions (:mod:`routing.sessions`), read from the decision core at
scrape time: the sessions held and the learned horizon they are kept for, the turns
placed by kind, the moves by reason, and the prompt tokens of sessions' turns with the
engines' reported cached tokens (their hit ratio)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class SessionCollector(Collector):
    """``turbo_gateway_sessions_active``, ``turbo_gateway_session_expiry_seconds``,
    ``turbo_gateway_session_placements_total``, ``turbo_gateway_session_moves_total``,
    ``turbo_gateway_session_prompt_tokens_total`` and
    ``turbo_gateway_session_cached_prompt_tokens_total`` of ``core`` (a
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
        moves = CounterMetricFamily(
            "turbo_gateway_session_moves", "Turns of a session that left its home, by reason: unavailable (the "
            "home could not take it), no_hit (the home was counted as holding none of its context), cheaper "
            "(another backend's estimate was sooner despite the home's hit)", labels=["reason"])
        for reason, n in table.moves.items():
            moves.add_metric([reason], n)
        prompt = CounterMetricFamily(
            "turbo_gateway_session_prompt_tokens", "Prompt tokens of sessions' turns whose engine reported "
            "cached tokens, by placement (the denominator of the session hit ratio)", labels=["placement"])
        cached = CounterMetricFamily(
            "turbo_gateway_session_cached_prompt_tokens", "Of those, the cached tokens the engine reported "
            "(usage.prompt_tokens_details.cached_tokens), by placement", labels=["placement"])
        for kind, (p, c) in table.hit_tokens.items():
            prompt.add_metric([kind], p)
            cached.add_metric([kind], c)
        yield from (active, expiry, placed, moves, prompt, cached)
