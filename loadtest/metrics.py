"""Per-request records and the serving metrics computed from them.

Definitions follow vLLM's serving benchmark (``vllm bench serve``,
``vllm/benchmarks/serve.py: calculate_metrics``, formerly
``benchmarks/benchmark_serving.py``), so numbers are comparable with it:

* **TTFT**: request sent -> first chunk carrying generated text (a role-only chunk
  does not count).
* **ITL** (inter-token latency): the gaps between consecutive text chunks, pooled over
  all requests (a chunk carrying several tokens is one gap, as in vLLM).
* **E2E latency** (vLLM's ``e2el``): request sent -> last text chunk (for a
  non-streamed request: -> response body read).
* **TPOT** = (e2e - TTFT) / (output tokens - 1), per request with more than one
  output token; for goodput a request with <= 1 output token counts as TPOT 0.
* Output tokens: ``usage.completion_tokens`` when the server reports it, else the
  number of text chunks. Input tokens: ``usage.prompt_tokens``, else the workload's
  expected length.
* Statistics: mean, median, std, and percentiles with linear interpolation (numpy's
  default, which vLLM uses), in milliseconds.
* Throughput: completed requests, output tokens, and input+output tokens divided by
  the benchmark duration (first send -> last completion). **Goodput**: requests meeting
  every given SLO (``ttft_ms``, ``tpot_ms``, ``e2el_ms``) per second of that duration
  (vLLM's ``--goodput ttft:500 tpot:50``; DistServe, OSDI'24).
* **Prefix-cache hit ratio**: sum of ``usage.prompt_tokens_details.cached_tokens`` /
  sum of ``usage.prompt_tokens`` over completed requests that report both.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
SLO_KEYS = {"ttft": "ttft", "ttft_ms": "ttft", "tpot": "tpot", "tpot_ms": "tpot", "e2el": "e2el",
            "e2el_ms": "e2el", "e2e": "e2el", "e2e_ms": "e2el"}


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request. Times in seconds: ``scheduled_s`` and
    ``start_s`` are offsets from the run start (planned and actual send), ``ttft_s``
    and ``e2e_s`` are measured from the actual send; ``itl_s`` lists the gaps between
    consecutive text chunks. Token counts come from ``usage`` when reported (else
    ``None``); ``chunks`` counts text chunks. ``error`` is the error kind (``None``
    when the request completed), ``status`` the HTTP status."""

    index: int
    target: str = ""
    group: str = ""
    session: int = 0
    turn: int = 0
    scheduled_s: float | None = None
    start_s: float = 0.0
    input_tokens_expected: int = 0
    max_tokens: int = 0
    status: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    chunks: int = 0
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    backend: str | None = None
    route: str | None = None
    error: str | None = None
    error_detail: str | None = None
    output_text: str | None = None  # kept only while a conversation needs it; not saved
    response_id: str | None = None  # a Responses answer's id, kept while a chained conversation needs it; not saved

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def n_output(self) -> int:
        """Output tokens as vLLM counts them: usage, else text chunks."""
        return self.output_tokens if self.output_tokens is not None else self.chunks

    @property
    def n_input(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else self.input_tokens_expected

    @property
    def tpot_s(self) -> float | None:
        """(e2e - TTFT) / (output tokens - 1); ``None`` with <= 1 output token."""
        if self.ttft_s is None or self.e2e_s is None or self.n_output <= 1:
            return None
        return (self.e2e_s - self.ttft_s) / (self.n_output - 1)

    @property
    def end_s(self) -> float | None:
        return None if self.e2e_s is None else self.start_s + self.e2e_s

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("output_text")
        d["tpot_s"] = self.tpot_s
        return d


def percentile(xs: list[float], p: float) -> float:
    """The ``p``-th percentile (0..100) with linear interpolation between the two
    nearest ranks (numpy.percentile's default); NaN for an empty list."""
    if not xs:
        return math.nan
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def jain_index(xs: list[float]) -> float:
    """Jain's fairness index of the allocations ``xs``: ``(sum x)^2 / (n * sum x^2)``,
    1 when all are equal, ``1/n`` when one gets everything (Jain, Chiu and Hawe, "A
    Quantitative Measure of Fairness and Discrimination for Resource Allocation in
    Shared Computer Systems", DEC-TR-301, 1984); NaN for an empty or all-zero list."""
    sq = sum(x * x for x in xs)
    if not xs or sq == 0:
        return math.nan
    return sum(xs) ** 2 / (len(xs) * sq)


def parse_slo(text: str | None) -> dict[str, float]:
    """``"ttft_ms=500,tpot_ms=50"`` (also ``ttft:500 tpot:50``, vLLM's form) ->
    ``{"ttft": 500.0, "tpot": 50.0}`` in milliseconds. Raises ValueError."""
    out: dict[str, float] = {}
    if not text:
        return out
    for item in text.replace(",", " ").split():
        k, sep, v = item.replace(":", "=").partition("=")
        if not sep or k not in SLO_KEYS:
            raise ValueError(f"bad SLO {item!r}: use ttft_ms=..., tpot_ms=..., e2el_ms=... (milliseconds)")
        try:
            ms = float(v)
        except ValueError:
            raise ValueError(f"bad SLO value in {item!r}") from None
        if ms <= 0:
            raise ValueError(f"SLO {item!r} must be > 0")
        out[SLO_KEYS[k]] = ms
    return out


def meets_slo(r: RequestRecord, slo_ms: dict[str, float]) -> bool:
    """Whether a completed request meets every SLO (vLLM: TPOT counts as 0 when the
    request has <= 1 output token)."""
    if not r.ok:
        return False
    values = {"ttft": r.ttft_s if r.ttft_s is not None else r.e2e_s, "tpot": r.tpot_s or 0.0, "e2el": r.e2e_s}
    return all((x := values[k]) is not None and x * 1000.0 <= v for k, v in slo_ms.items())


def _stats(prefix: str, xs_s: list[float], percentiles: Iterable[float]) -> dict[str, float]:
    ms = [x * 1000.0 for x in xs_s]
    out = {f"mean_{prefix}_ms": statistics.fmean(ms) if ms else math.nan,
           f"median_{prefix}_ms": statistics.median(ms) if ms else math.nan,
           f"std_{prefix}_ms": statistics.pstdev(ms) if ms else math.nan}
    for p in percentiles:
        out[f"p{p:g}_{prefix}_ms"] = percentile(ms, p)
    return out


def duration_s(records: list[RequestRecord]) -> float:
    """First send -> last completion (or last send when nothing completed), seconds."""
    if not records:
        return 0.0
    start = min(r.start_s for r in records)
    ends = [r.end_s for r in records if r.end_s is not None] or [r.start_s for r in records]
    return max(ends) - start


def summarize(records: list[RequestRecord], *, duration: float | None = None, slo_ms: dict[str, float] | None = None,
              percentiles: Iterable[float] = DEFAULT_PERCENTILES) -> dict[str, Any]:
    """vLLM-style summary of ``records`` (see the module docstring). ``duration``
    defaults to :func:`duration_s`. Keys: ``completed``, ``failed``, ``errors`` (count
    by kind), ``duration_s``, ``total_input_tokens``, ``total_output_tokens``,
    ``request_throughput`` (req/s), ``output_throughput`` and ``total_token_throughput``
    (tok/s), ``goodput`` (req/s, when SLOs are given) and ``slo_attainment`` (share of
    all requests), ``{mean,median,std,pNN}_{ttft,tpot,itl,e2el}_ms``,
    ``prefix_cache_hit_ratio`` (``None`` when nothing reported cached tokens)."""
    percentiles = tuple(percentiles)
    dur = duration_s(records) if duration is None else duration
    done = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    tpot = [t for r in done if (t := r.tpot_s) is not None]
    itl = [g for r in done for g in r.itl_s]
    e2el = [r.e2e_s for r in done if r.e2e_s is not None]
    total_in = sum(r.n_input for r in done)
    total_out = sum(r.n_output for r in done)
    rate = (lambda x: x / dur) if dur > 0 else (lambda x: math.nan)
    out: dict[str, Any] = {
        "requests": len(records), "completed": len(done), "failed": len(records) - len(done),
        "errors": dict(Counter(r.error for r in records if not r.ok)),
        "duration_s": dur, "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": rate(len(done)), "output_throughput": rate(total_out),
        "total_token_throughput": rate(total_in + total_out),
    }
    if slo_ms:
        good = sum(1 for r in done if meets_slo(r, slo_ms))
        out["slo_ms"] = dict(slo_ms)
        out["goodput"] = rate(good)
        out["slo_attainment"] = good / len(records) if records else math.nan
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        out.update(_stats(name, xs, percentiles))
    reporting = [r for r in done if r.cached_tokens is not None and r.prompt_tokens]
    prompt = sum(r.prompt_tokens or 0 for r in reporting)
    out["prefix_cache_hit_ratio"] = sum(r.cached_tokens or 0 for r in reporting) / prompt if prompt else None
    out["cache_reporting_requests"] = len(reporting)
    backends = Counter(r.backend for r in done if r.backend)
    if backends:
        out["requests_by_backend"] = dict(sorted(backends.items()))
    return out


def summarize_groups(records: list[RequestRecord], **kw: Any) -> dict[str, dict[str, Any]]:
    """:func:`summarize` per workload group (only when there are several groups);
    throughputs use the whole run's duration."""
    groups = sorted({r.group for r in records})
    if len(groups) < 2:
        return {}
    dur = kw.pop("duration", None)
    dur = duration_s(records) if dur is None else dur
    return {g: summarize([r for r in records if r.group == g], duration=dur, **kw) for g in groups}


# metric key, label, unit: what the text summary and the compare table show
HEADLINE = [
    ("completed", "completed", ""), ("failed", "failed", ""),
    ("request_throughput", "request throughput", "req/s"), ("output_throughput", "output throughput", "tok/s"),
    ("total_token_throughput", "total token throughput", "tok/s"), ("goodput", "goodput", "req/s"),
    ("mean_ttft_ms", "mean TTFT", "ms"), ("median_ttft_ms", "median TTFT", "ms"), ("p90_ttft_ms", "p90 TTFT", "ms"),
    ("p99_ttft_ms", "p99 TTFT", "ms"), ("mean_tpot_ms", "mean TPOT", "ms"), ("median_tpot_ms", "median TPOT", "ms"),
    ("p99_tpot_ms", "p99 TPOT", "ms"), ("mean_itl_ms", "mean ITL", "ms"), ("median_itl_ms", "median ITL", "ms"),
    ("p99_itl_ms", "p99 ITL", "ms"), ("mean_e2el_ms", "mean E2E", "ms"), ("median_e2el_ms", "median E2E", "ms"),
    ("p99_e2el_ms", "p99 E2E", "ms"), ("prefix_cache_hit_ratio", "prefix cache hit ratio", ""),
]


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)
