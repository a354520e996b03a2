"""The request path's counters and histograms (gateway.ops.request_metrics.RequestMetric) render
exactly as prometheus_client's own Counter and Histogram do."""

import re

import prometheus_client as pc
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gateway.ops import metrics as gm


def _norm(text: bytes) -> str:
    return re.sub(r"_created(\{[^}]*\})? \S+", r"_created\1 T", text.decode())


def test_same_exposition_as_prometheus_client():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    c1 = pc.Counter("t_requests", "Requests", ["model", "status"], registry=theirs)
    c2 = gm.Counter("t_requests", "Requests", ["model", "status"], registry=ours)
    h1 = pc.Histogram("t_ttft_seconds", "TTFT", ["model"], buckets=gm.TTFT_BUCKETS_S, registry=theirs)
    h2 = gm.Histogram("t_ttft_seconds", "TTFT", ["model"], buckets=gm.TTFT_BUCKETS_S, registry=ours)
    pc.Counter("t_unused", "never incremented", ["x"], registry=theirs)
    gm.Counter("t_unused", "never incremented", ["x"], registry=ours)
    # on a bound, between bounds, below the first, above the last
    for v in (0.0, 0.005, 0.0051, 1, 1.5, 120, 121, 1e9):
        h1.labels("m").observe(v)
        h2.labels("m").observe(v)
    h1.labels("other").observe(0.2)
    h2.labels("other").observe(0.2)
    for labels, n in ((("m", "200"), 3), (("m", "502"), 1), (("n", "200"), 2.5)):
        c1.labels(*labels).inc(n)
        c2.labels(*labels).inc(n)
    assert _norm(generate_latest(ours)) == _norm(generate_latest(theirs))
    assert 't_ttft_seconds_bucket{le="+Inf",model="m"} 8.0' in generate_latest(ours).decode()


def test_label_count_and_negative_increment_are_errors():
    c = gm.Counter("t_c", "c", ["a", "b"], registry=CollectorRegistry())
    with pytest.raises(ValueError):
        c.labels("only-one")
    with pytest.raises(ValueError):
        c.labels("x", "y").inc(-1)
