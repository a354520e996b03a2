"""The request path's labelled counters and histograms: :class:`RequestMetric`, exposed
exactly as ``prometheus_client``'s own but updated at a fraction of their cost
(:func:`Counter` and :func:`Histogram` make them). :mod:`gateway.ops.metrics` declares
the gateway's metrics with them.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import cast

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar, Sample


class _CounterChild:
    __slots__ = ("value", "created")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        """Add ``amount`` (>= 0; raises ``ValueError`` otherwise, as prometheus_client does)."""
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount


class _HistogramChild:
    __slots__ = ("bounds", "counts", "sum", "created", "exemplars")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0
        self.created = time.time()
        self.exemplars: dict[int, Exemplar] | None = None  # per bucket index, once one was given

    def observe(self, value: float) -> None:
        """Count ``value`` (seconds) in the first bucket whose upper bound is >= it."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def exemplar(self, value: float, labels: dict[str, str]) -> None:
        """Make ``value`` (seconds, observed already), with ``labels`` (e.g.
        ``{"trace_id": ...}``, at most 128 characters in all, as OpenMetrics allows),
        the exemplar of the bucket it fell in: the latest one per bucket is exposed
        in the OpenMetrics format."""
        if self.exemplars is None:
            self.exemplars = {}
        self.exemplars[bisect_left(self.bounds, value)] = Exemplar(labels, value, time.time())


class RequestMetric(Collector):
    """A labelled counter or histogram of the request path, exposed exactly as
    ``prometheus_client.Counter`` / ``Histogram`` are (``NAME_total`` and ``NAME_created``;
    ``NAME_bucket``, ``NAME_count``, ``NAME_sum`` and ``NAME_created``), but kept as plain
    floats updated by the event-loop thread, which is also the only one that renders them.

    Why not prometheus_client's own: its ``inc`` takes a lock and three Python calls, and
    its ``observe`` walks the bucket list in Python, and the request path makes a dozen
    updates per request. ``labels(*values)`` returns the child (``inc(amount)``, or
    ``observe(seconds)`` and ``exemplar(seconds, labels)``); raises ``ValueError`` on a
    wrong number of label values.
    """

    def __init__(self, kind: str, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry, buckets: Sequence[float] = ()) -> None:
        self.kind, self.name, self.documentation = kind, name, documentation
        self.labelnames = tuple(labelnames)
        self.bounds = tuple(float(b) for b in buckets if b != math.inf)
        self._children: dict[tuple[str, ...], _CounterChild | _HistogramChild] = {}
        registry.register(self)

    def labels(self, *values: str) -> _CounterChild | _HistogramChild:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected {len(self.labelnames)} label values, got {len(values)}")
        values = tuple(str(v) for v in values)
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = _CounterChild() if self.kind == "counter" else _HistogramChild(self.bounds)
        return child

    def describe(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        yield self._family()

    def _family(self) -> CounterMetricFamily | HistogramMetricFamily:
        if self.kind == "counter":
            return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        fam = self._family()
        for values, child in list(self._children.items()):
            if isinstance(child, _CounterChild):
                cast(CounterMetricFamily, fam).add_metric(values, child.value, created=child.created)
                continue
            cumulative, buckets = 0, []
            exemplars = child.exemplars or {}
            for i, (bound, n) in enumerate(zip((*self.bounds, math.inf), child.counts)):
                cumulative += n
                ex = exemplars.get(i)
                buckets.append((_le(bound), cumulative) if ex is None else (_le(bound), cumulative, ex))
            cast(HistogramMetricFamily, fam).add_metric(values, buckets, child.sum)
            fam.samples.append(Sample(self.name + "_created", dict(zip(self.labelnames, values)), child.created))
        yield fam


def _le(bound: float) -> str:
    """A bucket bound as prometheus_client writes it (``0.005``, ``1.0``, ``+Inf``)."""
    return "+Inf" if bound == math.inf else repr(float(bound))


def Counter(name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry) -> RequestMetric:
    """A labelled request-path counter registered in ``registry`` (see :class:`RequestMetric`)."""
    return RequestMetric("counter", name, documentation, labelnames, registry)


def Histogram(name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float],
              registry: CollectorRegistry) -> RequestMetric:
    """A labelled request-path histogram with upper bounds ``buckets`` (seconds; +Inf is
    added) registered in ``registry`` (see :class:`RequestMetric`)."""
    return RequestMetric("histogram", name, documentation, labelnames, registry, buckets)
