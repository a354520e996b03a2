"""Prometheus metrics of one gateway process (its own registry, so that several
gateways can live in one test process).

Names follow Prometheus conventions (base units: seconds, tokens) under the
``turbo_gateway_`` prefix. Per-backend gauges are read from the fleet at scrape time,
so the request path pays nothing for them; its own counters and histograms are
:mod:`gateway.ops.request_metrics`'.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from gateway.ops.request_metrics import Counter, Histogram
from routing.core import Fleet, PrefixIndex

# TTFT and end-to-end buckets span a cached short prompt (ms) to a long prefill under
# load (minutes); ITL buckets span 1 ms to 2 s gaps between chunks.
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2)
E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)


class _FleetCollector(Collector):
    def __init__(self, fleet: Fleet, store=None, index: PrefixIndex | None = None,
                 kv_stats: dict | None = None) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[GaugeMetricFamily]:
        in_flight = GaugeMetricFamily("turbo_gateway_backend_in_flight",
                                      "Requests dispatched to the backend and not yet settled", labels=["backend"])
        healthy = GaugeMetricFamily("turbo_gateway_backend_healthy",
                                    "1 when the backend's last health check passed", labels=["backend"])
        queued = GaugeMetricFamily("turbo_gateway_backend_queued_prefill_tokens",
                                   "Estimated uncached prompt tokens waiting for prefill", labels=["backend"])
        running = GaugeMetricFamily("turbo_gateway_backend_running_streams",
                                    "Streams past their first token", labels=["backend"])
        kv = GaugeMetricFamily("turbo_gateway_backend_kv_tokens", "Estimated KV cache tokens in use",
                               labels=["backend"])
        kv_cap = GaugeMetricFamily("turbo_gateway_backend_kv_capacity_tokens", "KV cache capacity in tokens",
                                   labels=["backend"])
        rate = GaugeMetricFamily("turbo_gateway_backend_prefill_tokens_per_second",
                                 "Learned prefill rate", labels=["backend"])
        itl = GaugeMetricFamily("turbo_gateway_backend_itl_seconds",
                                "Learned inter-token latency at the current number of running streams",
                                labels=["backend"])
        age = GaugeMetricFamily("turbo_gateway_backend_metrics_age_seconds",
                                "Age of the backend's last engine-metrics sample (absent: none yet); past "
                                "3 scrape intervals routing counts the backend as uncertain, not idle",
                                labels=["backend"])
        try:
            now: float | None = asyncio.get_running_loop().time()  # the clock of the engine samples
        except RuntimeError:  # rendered outside the loop
            now = None
        for b in self.fleet.backends.values():
            in_flight.add_metric([b.name], b.in_flight)
            healthy.add_metric([b.name], 1.0 if b.healthy else 0.0)
            load = b.load
            queued.add_metric([b.name], load.queued_prefill_tokens)
            running.add_metric([b.name], load.running)
            kv.add_metric([b.name], load.kv_tokens)
            kv_cap.add_metric([b.name], load.kv_capacity_tokens)
            rate.add_metric([b.name], load.prefill_tokens_per_s)
            itl.add_metric([b.name], load.itl_s())
            if load.engine is not None and now is not None:
                age.add_metric([b.name], max(now - load.engine.at, 0.0))
        yield from (in_flight, healthy, queued, running, kv, kv_cap, rate, itl, age)


class _StoreCollector(Collector):
    def __init__(self, store, index: PrefixIndex) -> None:
        self.store = store
        self.index = index

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        st = self.store.stats
        up = GaugeMetricFamily("turbo_gateway_state_store_up",
                               "1 when the state store is in sync (always 1 for the in-process store)",
                               labels=["store"])
        up.add_metric([self.store.kind], 1.0 if (st.up or self.store.kind == "memory") else 0.0)
        lag = GaugeMetricFamily("turbo_gateway_state_sync_lag_seconds",
                                "Seconds since the last successful sync with the shared store (0 in-process)")
        if self.store.kind == "memory":
            lag.add_metric([], 0.0)
        elif st.last_sync_at is not None:
            try:
                now = asyncio.get_running_loop().time()
            except RuntimeError:
                now = time.monotonic()
            lag.add_metric([], max(now - st.last_sync_at, 0.0))
        else:
            lag.add_metric([], float("inf"))
        calls = CounterMetricFamily("turbo_gateway_state_redis_calls", "Redis round trips by operation", labels=["op"])
        for op, n in st.calls.items():
            calls.add_metric([op], n)
        errors = CounterMetricFamily("turbo_gateway_state_redis_errors", "Failed Redis syncs by error",
                                     labels=["error"])
        for op, n in st.errors.items():
            errors.add_metric([op], n)
        replicas = GaugeMetricFamily("turbo_gateway_state_replicas",
                                     "Gateway replicas in the shared view (this one included)")
        replicas.add_metric([], st.replicas)
        blocks = GaugeMetricFamily("turbo_gateway_prefix_index_blocks", "Prefix blocks in the index, by origin",
                                   labels=["view"])
        blocks.add_metric(["total"], self.index.size)
        applied = CounterMetricFamily("turbo_gateway_state_remote_blocks",
                                      "Prefix blocks learned from other replicas")
        applied.add_metric([], st.remote_blocks_applied)
        yield from (up, lag, calls, errors, replicas, blocks, applied)


class _KVEventsCollector(Collector):
    """The engines' KV events and the token-exact prefix entries they keep, per
    backend with ``kv_events``, read at scrape time."""

    COUNTERS = (
        ("batches", "turbo_gateway_kv_events_batches", "KV-event messages received from the engine"),
        ("events", "turbo_gateway_kv_events", "KV events decoded (BlockStored, BlockRemoved, AllBlocksCleared)"),
        ("decode_errors", "turbo_gateway_kv_events_decode_errors",
         "KV-event payloads and events that could not be decoded (skipped)"),
        ("ignored", "turbo_gateway_kv_events_ignored",
         ("KV events decoded but not indexed: another medium, KV-cache group or block size, an unknown parent "
          "block, multimodal blocks")),
        ("gaps", "turbo_gateway_kv_events_gaps", "Gaps in the engine's sequence numbers"),
        ("restarts", "turbo_gateway_kv_events_restarts",
         "Engine restarts seen in the sequence numbers (precise entries dropped)"),
        ("clears", "turbo_gateway_kv_events_cleared", "AllBlocksCleared events (precise entries dropped)"),
    )

    def __init__(self, kv_stats: dict, index: PrefixIndex) -> None:
        self.kv_stats = kv_stats
        self.index = index

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        families = [(attr, CounterMetricFamily(name, doc, labels=["backend"])) for attr, name, doc in self.COUNTERS]
        replays = CounterMetricFamily("turbo_gateway_kv_events_replays", "Gaps in the engine's sequence numbers, by "
                                      "whether its replay filled them (failed: precise entries dropped)",
                                      labels=["backend", "outcome"])
        live = GaugeMetricFamily("turbo_gateway_kv_events_live", "1 while the backend's events decide its prefix "
                                 "lookups (0: approximate, e.g. after a gap replay could not fill)", labels=["backend"])
        blocks = GaugeMetricFamily("turbo_gateway_prefix_blocks", "Token-exact prefix blocks a backend holds, by "
                                   "evidence (precise: confirmed by the engine; speculative: dispatched, not yet "
                                   "confirmed)", labels=["backend", "evidence"])
        for name, st in list(self.kv_stats.items()):
            for attr, fam in families:
                fam.add_metric([name], getattr(st, attr))
            replays.add_metric([name, "filled"], st.replays)
            replays.add_metric([name, "failed"], st.replay_failures)
            e = self.index.engine(name)
            live.add_metric([name], 1.0 if e is not None and e.live else 0.0)
            precise, speculative = self.index.counts(name)
            blocks.add_metric([name, "precise"], precise)
            blocks.add_metric([name, "speculative"], speculative)
        yield from (fam for _, fam in families)
        yield from (replays, live, blocks)


class GatewayMetrics:
    """All metric families of the gateway. Label values are cached per
    (model, backend) by prometheus_client itself."""

    def __init__(self, fleet: Fleet, store=None, index: PrefixIndex | None = None,
                 kv_stats: dict | None = None) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self._children: dict[tuple, object] = {}
        self.key_label_mode = "hashed"  # auth.metrics_key_labels
        self._key_labels: dict[str, str] = {}
        self.build_info = Gauge("turbo_gateway_build_info", "Always 1; the labels say the version and routing policy",
                                ["version", "policy"], registry=r)
        self.requests = Counter("turbo_gateway_requests", "Requests answered, by final HTTP status",
                                ["model", "backend", "status"], registry=r)
        self.api_requests = Counter("turbo_gateway_api_requests", "Requests routed, by API (gateway/apis/) and "
                                    "final HTTP status", ["api", "status"], registry=r)
        self.ttft = Histogram("turbo_gateway_ttft_seconds",
                              "Time from request arrival to the first response byte sent to the client",
                              ["model", "api"], buckets=TTFT_BUCKETS_S, registry=r)
        self.itl = Histogram("turbo_gateway_itl_seconds",
                             "Gap between consecutive streamed chunks (inter-token latency)",
                             ["model", "api"], buckets=ITL_BUCKETS_S, registry=r)
        self.e2e = Histogram("turbo_gateway_e2e_seconds", "Request arrival to last byte sent",
                             ["model", "api"], buckets=E2E_BUCKETS_S, registry=r)
        self.prompt_tokens = Counter("turbo_gateway_prompt_tokens", "Prompt tokens reported by backends (usage)",
                                     ["model", "api"], registry=r)
        self.completion_tokens = Counter("turbo_gateway_completion_tokens",
                                         "Completion tokens reported by backends (usage), or streamed events when "
                                         "usage is absent",
                                         ["model", "api"], registry=r)
        self.cached_tokens = Counter("turbo_gateway_cached_prompt_tokens",
                                     "Prompt tokens the backends served from their prefix cache "
                                     "(usage.prompt_tokens_details.cached_tokens)",
                                     ["model", "api"], registry=r)
        self.predicted_cached_tokens = Counter(
            "turbo_gateway_predicted_cached_tokens",
            "Prompt tokens the gateway's prefix index predicted cached on the chosen backend "
            "(counted for responses that report cached_tokens, beside turbo_gateway_usage_prompt_tokens)",
            ["model"], registry=r)
        self.reported_prompt_tokens = Counter(
            "turbo_gateway_usage_prompt_tokens",
            "Prompt tokens of responses that report cached_tokens (denominator of both hit ratios)",
            ["model"], registry=r)
        self.key_tokens = Counter("turbo_gateway_key_tokens",
                                  "Tokens of settled requests per client key name and model (the usage ledger's "
                                  "counts in this process): kind prompt, cached_prompt (of the prompt tokens, those "
                                  "served from the prefix cache) or completion",
                                  ["key_name", "model", "kind"], registry=r)
        self.prefix_predicted_tokens = Counter(
            "turbo_gateway_prefix_predicted_tokens",
            "Prompt tokens the prefix index predicted cached on the chosen backend, by the evidence behind the "
            "prediction (precise, speculative, approximate); counted for responses that report cached_tokens",
            ["evidence"], registry=r)
        self.prefix_reported_tokens = Counter(
            "turbo_gateway_prefix_reported_cached_tokens",
            "usage.prompt_tokens_details.cached_tokens of the same responses, by the evidence behind the "
            "prediction: beside turbo_gateway_prefix_predicted_tokens, how right each kind of evidence is",
            ["evidence"], registry=r)
        self.disaggregated = Counter("turbo_gateway_disaggregated",
                                     "Requests planned for disaggregated prefill/decode, by outcome of the prefill leg "
                                     "(ok, or fallback: served by a decode or mixed backend that recomputed the "
                                     "prompt)",
                                     ["outcome"], registry=r)
        self.pool_requests = Counter("turbo_gateway_pool_requests", "Requests answered, by the serving backend's pool",
                                     ["pool", "status"], registry=r)
        self.pool_ttft = Histogram("turbo_gateway_pool_ttft_seconds", "TTFT by the serving backend's pool",
                                   ["pool"], buckets=TTFT_BUCKETS_S, registry=r)
        self.canary_fallbacks = Counter("turbo_gateway_canary_fallbacks",
                                        "Canary requests retried on the stable pool, by the canary's failure",
                                        ["reason"], registry=r)
        self.fallbacks = Counter("turbo_gateway_fallbacks",
                                 "Requests sent to a fallback model (routing.fallbacks), by the model that could not "
                                 "serve them, the fallback and the failure that triggered it",
                                 ["model", "fallback", "reason"], registry=r)
        self.retries = Counter("turbo_gateway_retries", "Retries, by the failure that caused them", ["reason"],
                               registry=r)
        self.upstream_errors = Counter("turbo_gateway_upstream_errors", "Failed upstream attempts",
                                       ["backend", "reason"], registry=r)
        self.stream_errors = Counter("turbo_gateway_stream_errors",
                                     "Streams that failed after bytes had reached the client",
                                     ["backend", "reason"], registry=r)
        self.stream_migrations = Counter("turbo_gateway_stream_migrations", "Streams continued on another backend "
                                         "after theirs failed mid-stream", ["model", "reason"], registry=r)
        self.client_disconnects = Counter("turbo_gateway_client_disconnects",
                                          "Requests whose client went away before the response ended",
                                          ["backend"], registry=r)
        self.decisions = Counter("turbo_gateway_routing_decisions", "Routing decisions by policy and reason",
                                 ["policy", "reason"], registry=r)
        r.register(_FleetCollector(fleet))
        if store is not None and index is not None:
            r.register(_StoreCollector(store, index))
        if kv_stats is not None and index is not None:
            r.register(_KVEventsCollector(kv_stats, index))

    def key_label(self, name: str) -> str:
        """The ``key_name`` label of key ``name`` (``auth.metrics_key_labels``), cached."""
        label = self._key_labels.get(name)
        if label is None:
            label = self._key_labels[name] = key_label(self.key_label_mode, name)
        return label

    def set_key_label_mode(self, mode: str) -> None:
        if mode != self.key_label_mode:
            self.key_label_mode = mode
            self._key_labels.clear()

    def child(self, metric, *labels: str):
        """``metric.labels(*labels)``, cached: the request path asks for the same few
        label sets over and over, and prometheus_client's lookup validates each time."""
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def exposition(self, accept: str = "") -> tuple[bytes, str]:
        """Every metric, in the format a scraper's ``Accept`` header asks for:
        OpenMetrics (``application/openmetrics-text``, the format that carries the
        TTFT and end-to-end histograms' exemplars) or, by default, Prometheus text
        0.0.4 (prometheus_client's negotiation). Returns the body and its
        ``Content-Type``."""
        encode, content_type = choose_encoder(accept)
        return encode(self.registry), content_type


class TokenizerCollector(Collector):
    """The models' own tokenizers (``models[].tokenizer``), read from the decision
    core at scrape time: requests tokenized exactly or not, the exact prompt tokens,
    and the prefix cache of rendered segments."""

    def __init__(self, core) -> None:
        self.core = core

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        core = self.core
        done = CounterMetricFamily(
            "turbo_gateway_tokenizations", "Requests of a model with a tokenizer, by result: exact (token ids as the "
            "engine computes them) or unsupported (images, a per-request template...: estimated instead)",
            labels=["model", "result"])
        tokens = CounterMetricFamily("turbo_gateway_tokenized_prompt_tokens",
                                     "Prompt tokens counted by the models' own tokenizers", labels=["model"])
        hits = CounterMetricFamily("turbo_gateway_tokenizer_cache_hits",
                                   "Rendered prompt segments found in the tokenizer's prefix cache", labels=["model"])
        misses = CounterMetricFamily("turbo_gateway_tokenizer_cache_misses",
                                     "Rendered prompt segments encoded (not in the prefix cache)", labels=["model"])
        held = GaugeMetricFamily("turbo_gateway_tokenizer_cache_tokens",
                                 "Token ids held by the tokenizer's prefix cache", labels=["model"])
        for model, st in core.tokenize_stats.items():
            done.add_metric([model, "exact"], st.exact)
            done.add_metric([model, "unsupported"], st.unsupported)
            tokens.add_metric([model], st.prompt_tokens)
            tok = core.tokenizers.get(model)
            cache = tok.cache if tok is not None else None
            if cache is not None:
                hits.add_metric([model], cache.hits)
                misses.add_metric([model], cache.misses)
                held.add_metric([model], cache.tokens)
        yield from (done, tokens, hits, misses, held)


def key_label(mode: str, name: str) -> str:
    """A key's ``key_name`` label on ``/metrics`` under ``auth.metrics_key_labels``
    ``mode``: ``hashed`` (12 hex digits of the name's SHA-256), ``name`` or ``none``."""
    if mode == "name":
        return name
    if mode == "none":
        return "-"
    return hashlib.sha256(name.encode()).hexdigest()[:12]


class HardeningCollector(Collector):
    """Metrics of keys, limits, admission, breakers, draining and reloads, read from
    the live state at scrape time (key *names* only, never keys)."""

    def __init__(self, state) -> None:
        self.state = state

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        st = self.state
        limited = CounterMetricFamily("turbo_gateway_rate_limited", "Requests refused by a per-key limit",
                                      labels=["key_name", "limit"])
        label = st.metrics.key_label
        rejected: dict[tuple[str, str], float] = {}
        for (name, limit), n in st.limiter.rejected.items():
            k = (label(name), limit)
            rejected[k] = rejected.get(k, 0) + n
        for (name, limit), n in rejected.items():
            limited.add_metric([name, limit], n)
        adm = CounterMetricFamily("turbo_gateway_admission_rejected", "Requests refused by admission control",
                                  labels=["reason"])
        for reason, n in st.admission.rejected.items():
            adm.add_metric([reason], n)
        depth = GaugeMetricFamily("turbo_gateway_admission_queue_depth", "Requests waiting for room in the fleet")
        depth.add_metric([], st.admission.waiting)
        served = GaugeMetricFamily("turbo_gateway_admission_key_service_tokens",
                                   "A key's fair-share counter: weighted tokens served (admission.fairness: tokens)",
                                   labels=["key_name"])
        c = st.admission.counters
        service: dict[str, float] = {}
        for name in sorted(c.known.keys() | c.pending.keys() | c.publishing.keys() | c.lift.keys()):
            service[label(name)] = service.get(label(name), 0.0) + c.value(name)
        for name, v in service.items():
            served.add_metric([name], v)
        opened = CounterMetricFamily("turbo_gateway_backend_breaker_opened", "Times the circuit breaker opened",
                                     labels=["backend"])
        bopen = GaugeMetricFamily("turbo_gateway_backend_breaker_open",
                                  "1 while the circuit breaker is open or half-open", labels=["backend"])
        draining = GaugeMetricFamily("turbo_gateway_backend_draining", "1 while the backend is drained by an operator",
                                     labels=["backend"])
        for b in st.fleet.backends.values():
            opened.add_metric([b.name], b.breaker.opened_total)
            bopen.add_metric([b.name], 0.0 if b.breaker.state == "closed" else 1.0)
            draining.add_metric([b.name], 1.0 if b.draining else 0.0)
        reloads = CounterMetricFamily("turbo_gateway_config_reloads", "Config reloads, by outcome", labels=["outcome"])
        for outcome, n in st.reloads.items():
            reloads.add_metric([outcome], n)
        yield from (limited, adm, depth, served, opened, bopen, draining, reloads)
        if st.limiter_sync is not None:
            up = GaugeMetricFamily("turbo_gateway_limits_store_up", "1 when per-key limits are shared through Redis")
            up.add_metric([], 1.0 if st.limiter_sync.up else 0.0)
            yield up
        led = st.usage
        dropped = CounterMetricFamily("turbo_gateway_usage_dropped_requests",
                                      "Settled requests the usage ledger did not record: its buffer of unflushed "
                                      "(key, model, hour) entries was full (usage.max_buffered_buckets)")
        dropped.add_metric([], led.dropped_requests)
        buffered = GaugeMetricFamily("turbo_gateway_usage_buffered_buckets",
                                     "Usage ledger (key, model, hour) entries waiting for a flush to Redis")
        buffered.add_metric([], led.buffered())
        yield from (dropped, buffered)
        if st.usage_sync is not None:
            up = GaugeMetricFamily("turbo_gateway_usage_store_up",
                                   "1 when the usage ledger's last flush to Redis succeeded")
            up.add_metric([], 1.0 if st.usage_sync.up else 0.0)
            yield up
