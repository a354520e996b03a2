"""Everything one running gateway holds, declared once and built one way.

:func:`build_state` makes a :class:`GatewayState` from a config at startup;
:func:`configure` applies a config to it, at startup and on every reload, in one
synchronous step (no request sees half of it): the decision core's fleet and policy,
retries, keys and limits, admission, breakers, and, once the event loop runs and
:func:`connect` has made them, the backends' clients, health checks, scraping and
KV-event subscriptions.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from gateway.apis.registry import BY_NAME
from gateway.apis.support import ApiSupport
from gateway.config import Backend, GatewayConfig, KVEvents
from gateway.engine_signals.health_checks import HealthChecker
from gateway.engine_signals.kv_event_subscriber import KVEventSubscribers
from gateway.engine_signals.metrics_scraper import MetricsScraper
from gateway.ops.metrics import GatewayMetrics, HardeningCollector, TokenizerCollector
from gateway.ops.session_metrics import SessionCollector
from gateway.pipeline.keepalive import KeepAlives
from gateway.pipeline.retry import RetryPolicy, policy_from_config
from gateway.store.responses import ResponseStore
from gateway.store.routing_state import InProcessStore, RedisStore
from gateway.store.sessions import SessionSync
from gateway.tenancy.admission import AdmissionControl
from gateway.tenancy.keys import KeyRing
from gateway.tenancy.limits import Limiter, LimiterSync
from gateway.tenancy.usage_ledger import UsageLedger, UsageSync
from gateway.upstream.client import BackendClient
from gateway.upstream.lora_loader import AdapterLoader
from routing.core import BackendSpec, DecisionCore, Fleet, ModelTokenizer, load_tokenizer

if TYPE_CHECKING:
    from gateway.ops.tracing import Tracer

log = logging.getLogger("gateway.runtime")

STATE: web.AppKey[GatewayState] = web.AppKey("state")
# the app's own middleware: the lean protocol does for completions what they do
OWN_MIDDLEWARES = web.AppKey("own_middlewares", tuple)


@dataclass(eq=False)
class GatewayState:
    """A running gateway: its config, decision core, clients and request-path helpers."""

    cfg: GatewayConfig
    core: DecisionCore
    store: InProcessStore | RedisStore  # where the routing state lives (gateway.store.routing_state)
    metrics: GatewayMetrics
    limiter: Limiter
    admission: AdmissionControl
    retry: RetryPolicy = field(init=False)
    keyring: KeyRing = field(init=False)
    admin_digest: bytes | None = field(init=False)
    clients: dict[str, BackendClient] = field(default_factory=dict)  # by backend name, made by connect()
    # gateway.pipeline.settlement's cache, by (model, backend, API)
    served_metrics: dict[tuple[str, str | None, str], Any] = field(default_factory=dict)
    health: HealthChecker | None = None
    scraper: MetricsScraper | None = None
    limiter_sync: LimiterSync | None = None
    usage: UsageLedger = field(default_factory=UsageLedger)  # the usage ledger's counts (gateway.tenancy.usage_ledger)
    usage_sync: UsageSync | None = None  # flushes them to Redis when state.url is set
    session_sync: SessionSync | None = None  # shares the sessions' homes when state.url is set (gateway.store.sessions)
    kv_events: KVEventSubscribers | None = None  # the engines' KV-event subscribers, made by connect()
    adapters: AdapterLoader = field(default_factory=AdapterLoader)  # LoRA adapters loaded on demand
    batch_gate: Any = None  # gateway.batch.batch_gate.BatchGate when batch is enabled
    tracer: Tracer | None = None  # OpenTelemetry traces, with tracing.enabled (started by the app)
    responses: ResponseStore = field(init=False)  # the Responses API's stored responses (gateway.store.responses)
    # the background responses this process runs, by (owner, response id) (gateway.pipeline.background)
    background: dict[tuple[str, str], asyncio.Task[None]] = field(default_factory=dict)
    api_support: ApiSupport = field(default_factory=ApiSupport)  # which backend serves which API (gateway.apis.support)
    config_path: str | None = None  # the file to reload, when started from one
    config_digest: bytes | None = None  # SHA-256 of that file as last read
    reloads: dict[str, int] = field(default_factory=lambda: {"ok": 0, "rejected": 0})
    reload_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    urls: dict[str, str] = field(default_factory=dict)  # backend URLs given at startup (simulated demo backends)
    kv_sources: dict[str, KVEvents] = field(default_factory=dict)  # simulated backends' KV events, read at startup
    sessions: list[aiohttp.ClientSession] = field(default_factory=list)  # the clients' aiohttp sessions, to close
    tasks: list[asyncio.Task] = field(default_factory=list)  # background tasks, cancelled at shutdown
    created: int = field(default_factory=lambda: int(time.time()))
    loop: asyncio.AbstractEventLoop = field(init=False)  # the loop serving requests, set by connect()
    keepalives: KeepAlives = field(init=False)  # streams waiting for a first event, set by connect()

    @property
    def fleet(self) -> Fleet:
        return self.core.fleet

    @property
    def router(self):
        return self.core.router


def backend_specs(cfg: GatewayConfig) -> list[BackendSpec]:
    """The config's backends as the decision core takes them."""
    roles = {p.name: p.role for p in cfg.pools}
    adapters = tuple((m, s.lora.base) for m, s in cfg.models.items() if s.lora is not None)
    return [BackendSpec(b.name, frozenset(b.static_models), b.pool, b.weight, roles[b.pool],
                        b.hints.prefill_tokens_per_s, b.hints.decode_tokens_per_s, b.hints.kv_capacity_tokens,
                        b.kv_events.block_size if b.kv_events else None,
                        (b.kv_events.base_model or next(iter(b.static_models), "")) if b.kv_events else "",
                        discover=b.discover, lora_load_s=b.hints.lora_load_s,
                        loadable=adapters if b.lora.dynamic else ()) for b in cfg.backends]


def canary_splits(cfg: GatewayConfig) -> dict[str, tuple[str, str, float]]:
    """``routing.canaries`` as the decision core takes them."""
    return {c.model: (c.stable_pool, c.canary_pool, c.canary_weight) for c in cfg.routing.canaries}


def model_tokenizers(cfg: GatewayConfig) -> dict[str, ModelTokenizer]:
    """The models' own tokenizers (``models[].tokenizer``), by model name. Loaded
    once per unchanged set of files: validating the config already loaded them.
    Raises ``routing.core.TokenizerError`` when a file changed into a bad one since.
    A tokenizer without a chat template is logged: its chat requests are estimated."""
    out = {}
    for name, m in cfg.models.items():
        if m.tokenizer is None:
            continue
        out[name] = tok = load_tokenizer(m.tokenizer, m.chat_template, m.prefix_cache_tokens)
        if tok.template is None:
            log.warning("model %s: its tokenizer %s has no chat template (no tokenizer_config.json "
                        "`chat_template` or chat_template.jinja beside it, no `models.%s.chat_template`): its "
                        "chat requests are estimated, not tokenized, and route on approximate prefix evidence",
                        name, m.tokenizer, name)
    return out


def build_state(cfg: GatewayConfig, config_path: str | None = None, version: str = "unknown") -> GatewayState:
    """A new gateway's state for ``cfg`` (no client yet: :func:`connect` makes them
    inside the running loop). Raises ``ValueError`` on duplicate backend names."""
    r = cfg.routing
    core = DecisionCore([], r.policy, block_tokens=r.block_tokens, prefix_ttl_s=r.prefix_ttl_s,
                        prefix_index_max_blocks=r.prefix_index_max_blocks, speculative_s=r.speculative_s)
    store = state_store(cfg, core)
    metrics = GatewayMetrics(core.fleet, store, core.index, core.kv_stats)
    metrics.build_info.labels(version, r.policy).set(1)
    state = GatewayState(cfg, core, store, metrics, Limiter(), AdmissionControl(cfg.admission, core.fleet),
                         config_path=config_path)
    configure(state, cfg)
    st, rs = cfg.state, cfg.responses
    state.responses = ResponseStore(st.url, st.namespace, ttl_s=rs.ttl_s, max_in_process=rs.max_in_process,
                                    max_record_bytes=rs.max_record_bytes, timeout_s=st.timeout_s, cluster=st.cluster)
    metrics.registry.register(HardeningCollector(state))
    metrics.registry.register(TokenizerCollector(core))
    metrics.registry.register(SessionCollector(core))
    return state


def state_store(cfg: GatewayConfig, core: DecisionCore) -> InProcessStore | RedisStore:
    """Where ``core``'s view lives (``state``): shared through Redis when ``state.url``
    is set (the store is attached to the core, not started), else this process alone
    (the core then gets no store and its request path makes no call for it)."""
    st = cfg.state
    if not st.url:
        return InProcessStore()
    store = RedisStore(core.fleet, core.index, st.url, namespace=st.namespace, staleness_s=st.staleness_s,
                       lease_s=st.lease_s, timeout_s=st.timeout_s, prefix_stream_maxlen=st.prefix_stream_maxlen,
                       cluster=st.cluster)
    core.attach_store(store)
    return store


def configure(state: GatewayState, cfg: GatewayConfig) -> list[BackendClient]:
    """Apply ``cfg`` to ``state`` in one synchronous step: backends kept by name keep
    their live state, removed ones leave routing and finish what they carry. Returns
    the clients replaced or removed (their pools take no new request; close their
    sessions once their requests are done). The simulated backends' KV events read at
    startup (``state.kv_sources``) are wired into ``cfg`` first. Raises ``ValueError``
    on duplicate backend names."""
    cfg = cfg.with_kv_events(state.kv_sources)
    core = state.core
    core.apply(backend_specs(cfg), cfg.routing.policy, canary_splits(cfg), model_tokenizers(cfg))
    core.index.speculative_s = cfg.routing.speculative_s
    core.router.sessions.configure(cfg.sessions.ttl_s, cfg.sessions.max_sessions, share=bool(cfg.state.url))
    b = cfg.breaker
    for backend in core.fleet.backends.values():
        backend.breaker.configure(b.failure_threshold, b.open_s, b.success_threshold)
    state.retry = policy_from_config(cfg.retries)
    state.api_support.configure(((b.name, b.apis) for b in cfg.backends), BY_NAME)
    state.keyring = KeyRing(cfg.auth, cfg.limits)
    state.metrics.set_key_label_mode(cfg.auth.metrics_key_labels)
    state.limiter.configure(cfg.auth.keys)
    state.usage.configure(cfg.usage.retention_days, cfg.usage.max_buffered_buckets)
    state.admin_digest = cfg.admin.digest()
    state.admission.configure(cfg.admission, core.fleet)
    retired = _connect(state, cfg) if state.clients else []
    if state.health is not None:
        _configure_health(state.health, state, cfg)
    if state.kv_events is not None:
        state.kv_events.configure(cfg)
    if state.scraper is not None:
        state.scraper.interval_s = cfg.routing.scrape_interval_s or state.scraper.interval_s
        for backend in core.fleet.backends.values():
            backend.load.metrics_max_age_s = 3 * state.scraper.interval_s
    state.cfg = cfg
    return retired


def _session(cfg: GatewayConfig, b: Backend) -> aiohttp.ClientSession:
    """The aiohttp session of ``b``'s health checks and metric scraping."""
    t = cfg.timeouts_for(b)
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=t.connect_s),
        skip_auto_headers=("User-Agent", "Accept-Encoding"), auto_decompress=False)


def _connect(state: GatewayState, cfg: GatewayConfig) -> list[BackendClient]:
    """Make a client for every backend of ``cfg``, keeping each one whose URL,
    timeouts and key are unchanged; returns the others, retired."""
    clients: dict[str, BackendClient] = {}
    retired: list[BackendClient] = []
    for b in cfg.backends:
        backend = state.core.fleet.backends[b.name]
        url = state.urls.get(b.name) or b.url or ""
        t = cfg.timeouts_for(b)
        auth = f"Bearer {os.environ[b.api_key_env]}" if b.api_key_env else None
        prev = state.clients.get(b.name)
        if prev is not None and prev.base_url == url and prev.timeouts == t and prev.auth_header == auth:
            prev.state = backend
            prev.return_token_ids = b.return_token_ids
            clients[b.name] = prev
            continue
        session = _session(cfg, b)
        state.sessions.append(session)
        client = clients[b.name] = BackendClient(backend, url, session, t, auth)
        client.return_token_ids = b.return_token_ids
        if prev is not None:
            retired.append(prev)
    retired += [c for name, c in state.clients.items() if name not in clients]
    for c in retired:
        c.pool.retire()
    state.clients.clear()
    state.clients.update(clients)
    return retired


def _configure_health(h: HealthChecker, state: GatewayState, cfg: GatewayConfig) -> None:
    h.cfg = cfg.health
    h.clients = list(state.clients.values())
    h.paths = {b.name: b.health_path or cfg.health.path for b in cfg.backends}


def connect(state: GatewayState, urls: dict[str, str]) -> None:
    """Inside the running loop: the backends' clients (``urls`` overrides backends'
    base URLs by name), their health checker, when configured the scraper, and the
    subscriptions to the engines' KV events (started at once)."""
    state.loop = asyncio.get_running_loop()
    state.keepalives = KeepAlives(state.loop)
    state.urls = dict(urls)
    cfg = state.cfg
    _connect(state, cfg)
    state.health = HealthChecker(cfg.health, state.clients.values(), {}, on_recovered=state.core.backend_restarted,
                                 core=state.core)
    _configure_health(state.health, state, cfg)
    if cfg.routing.scrape_interval_s > 0:
        state.scraper = MetricsScraper(state.core, state.clients, cfg.routing.scrape_interval_s)
    state.kv_events = KVEventSubscribers(state.core)
    state.kv_events.configure(cfg)


def limiter_sync(state: GatewayState) -> LimiterSync | None:
    """The Redis sync of the per-key limits and the admission queue's service counters
    when ``state.url`` is set (not started)."""
    st = state.cfg.state
    if not st.url:
        return None
    return LimiterSync(state.limiter, st.url, namespace=st.namespace, interval_s=st.staleness_s / 2,
                       lease_s=st.lease_s, timeout_s=st.timeout_s, cluster=st.cluster,
                       counters=state.admission.counters)


def usage_sync(state: GatewayState) -> UsageSync | None:
    """The Redis flush of the usage ledger when ``state.url`` is set (not started)."""
    st = state.cfg.state
    if not st.url:
        return None
    return UsageSync(state.usage, st.url, namespace=st.namespace, interval_s=state.cfg.usage.flush_interval_s,
                     timeout_s=st.timeout_s, cluster=st.cluster)


def session_sync(state: GatewayState) -> SessionSync | None:
    """The Redis sync of the sessions' homes when ``state.url`` is set and sessions are
    on (not started)."""
    st = state.cfg.state
    if not st.url or not state.cfg.sessions.enabled:
        return None
    return SessionSync(state.core.router.sessions, st.url, namespace=st.namespace, interval_s=st.staleness_s / 2,
                       timeout_s=st.timeout_s, cluster=st.cluster, stream_maxlen=st.prefix_stream_maxlen)
