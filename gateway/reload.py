"""Config reload without dropping in-flight requests (SIGHUP, a change of the config
file, or ``POST /admin/reload``).

The new file is loaded and validated first; any error (YAML, a field, a change that
needs a restart) is logged as one line and the running config stays. A valid config
is applied **in place**, in one synchronous step (no request can see half of it):

- the :class:`~routing.fleet.Fleet` keeps its identity; a backend kept by name keeps
  its live state (in-flight count, learned speeds, health, breaker, draining), new ones
  start fresh, removed ones leave routing at once and finish what they carry;
- a backend whose URL, timeouts or key changed gets a new connection pool; the old
  pool is closed once its requests are done (at most ``timeouts.total_s`` later);
- the routing policy, retries, timeouts, health checks, breaker settings, body limit,
  client keys and their limits, admission settings and the admin key take effect for
  the next request; requests in flight finish under the settings they started with.

Needs a restart (rejected by a reload): ``listen``, ``state``,
``routing.block_tokens`` / ``prefix_ttl_s`` / ``prefix_index_max_blocks`` (the prefix
index's shape) and adding or changing a ``simulate`` backend.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from pathlib import Path

import aiohttp
from aiohttp import web

from gateway.admission import AdmissionControl
from gateway.auth import KeyRing
from gateway.config import Backend, ConfigError, GatewayConfig, load_config
from routing import BackendSpec, make_policy
from routing.fleet import BackendState

log = logging.getLogger("gateway.reload")


class ReloadRejected(Exception):
    """The new config is invalid or needs a restart; the running one stays."""


def init_hardening(state, cfg: GatewayConfig) -> None:
    """Attach the keys, limits, admission control and breaker settings to a new
    :class:`~gateway.app.GatewayState`."""
    from gateway.limits import Limiter

    state.keyring = KeyRing(cfg.auth)
    state.admin_digest = cfg.admin.digest()
    state.limiter = Limiter()
    state.limiter.configure(cfg.auth.keys)
    state.limiter_sync = None
    state.admission = AdmissionControl(cfg.admission, state.fleet)
    state.config_path = None
    state.config_digest = None
    state.reloads = {"ok": 0, "rejected": 0}
    state.reload_lock = asyncio.Lock()
    state.urls = {}
    state.sessions_list = None
    state.tasks_list = None
    _configure_breakers(state.fleet.backends.values(), cfg)


def _configure_breakers(backends, cfg: GatewayConfig) -> None:
    b = cfg.breaker
    for st in backends:
        st.breaker.configure(b.failure_threshold, b.open_s, b.success_threshold)


def make_session(cfg: GatewayConfig, b: Backend) -> aiohttp.ClientSession:
    t = cfg.timeouts_for(b)
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=t.connect_s),
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
        auto_decompress=False,
    )


def _restart_only(old: GatewayConfig, new: GatewayConfig, urls: dict[str, str]) -> str | None:
    if new.listen != old.listen:
        return "`listen` changed"
    if new.state != old.state:
        return "`state` changed"
    for f in ("block_tokens", "prefix_ttl_s", "prefix_index_max_blocks"):
        if getattr(new.routing, f) != getattr(old.routing, f):
            return f"`routing.{f}` changed"
    before = {b.name: b for b in old.backends}
    for b in new.backends:
        if b.simulate is not None:
            prev = before.get(b.name)
            if prev is None or prev.simulate != b.simulate or b.name not in urls:
                return f"simulated backend {b.name!r} was added or changed"
    return None


def apply_config(app: web.Application, new: GatewayConfig) -> list[aiohttp.ClientSession]:
    """Swap ``new`` in (synchronously). Returns the connection pools to close once
    their requests are done. Raises :class:`ReloadRejected`."""
    from gateway.app import STATE
    from gateway.health import HealthChecker
    from gateway.proxy import BackendClient

    state = app[STATE]
    old: GatewayConfig = state.cfg
    why = _restart_only(old, new, state.urls)
    if why:
        raise ReloadRejected(f"{why}; that needs a restart")
    roles = {p.name: p.role for p in new.pools}
    fleet = state.fleet
    old_backends = {b.name: b for b in old.backends}
    states: dict[str, BackendState] = {}
    clients = {}
    retired: list[aiohttp.ClientSession] = []
    new_sessions: list[aiohttp.ClientSession] = []
    for b in new.backends:
        spec = BackendSpec(b.name, frozenset(b.models), b.pool, b.weight, roles[b.pool], b.hints.prefill_tokens_per_s,
                           b.hints.decode_tokens_per_s, b.hints.kv_capacity_tokens)
        st = fleet.backends.get(b.name)
        if st is None:
            st = BackendState(spec)
        else:
            st.spec = spec
        states[b.name] = st
        url = state.urls.get(b.name) or b.url or ""
        t = new.timeouts_for(b)
        auth = f"Bearer {os.environ[b.api_key_env]}" if b.api_key_env else None
        prev = state.clients.get(b.name)
        if prev is not None and prev.base_url == url and prev.timeouts == t and prev.auth_header == auth:
            prev.state = st
            clients[b.name] = prev
        else:
            session = make_session(new, b)
            new_sessions.append(session)
            clients[b.name] = BackendClient(st, url, session, t, auth)
            if prev is not None:
                retired.append(prev.session)
                prev.pool.retire()
    for name, c in state.clients.items():
        if name not in clients:
            retired.append(c.session)
            c.pool.retire()
    # ---- the swap: nothing below awaits ----
    fleet.backends.clear()
    fleet.backends.update(states)
    fleet.by_model.clear()
    for st in states.values():
        for model in sorted(st.spec.models):
            fleet.by_model.setdefault(model, []).append(st)
    router = state.router
    if new.routing.policy != old.routing.policy or set(states) != set(old_backends):
        router.policy = make_policy(new.routing.policy)
    from gateway.app import canary_splits  # a late import: app imports this module
    router.set_canaries(canary_splits(new))
    for st in states.values():
        router.index.set_capacity(st.name, router.capacity_blocks(st))
    state.clients.clear()
    state.clients.update(clients)
    if state.sessions_list is not None:
        state.sessions_list.extend(new_sessions)
    state.cfg = new
    if state.proxy is not None:
        state.proxy.cfg = new
    if state.health is not None:
        h: HealthChecker = state.health
        h.cfg = new.health
        h.clients = list(clients.values())
        h.paths = {b.name: b.health_path or new.health.path for b in new.backends}
    if state.scraper is not None:
        state.scraper.interval_s = new.routing.scrape_interval_s or state.scraper.interval_s
        for st in states.values():
            st.load.metrics_max_age_s = 3 * state.scraper.interval_s
    _configure_breakers(states.values(), new)
    state.keyring = KeyRing(new.auth)
    state.limiter.configure(new.auth.keys)
    state.admin_digest = new.admin.digest()
    state.admission.configure(new.admission, fleet)
    app._client_max_size = new.limits.max_body_bytes  # read by aiohttp for each new request
    return retired


async def _close_when_idle(sessions: list[aiohttp.ClientSession], state, wait_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    idle_since = None
    while loop.time() < deadline:
        busy = any(not s.closed and s.connector is not None and s.connector._acquired for s in sessions)  # noqa: SLF001
        if not busy:
            if idle_since is not None:
                break
            idle_since = loop.time()
        else:
            idle_since = None
        await asyncio.sleep(0.5)
    for s in sessions:
        if state.sessions_list is not None and s in state.sessions_list:
            state.sessions_list.remove(s)
        await s.close()


async def reload_from_file(app: web.Application, reason: str) -> tuple[bool, str]:
    """Load the config file again and apply it. Returns ``(applied, message)``; never
    raises for a bad file (one log line, the running config stays)."""
    from gateway.app import STATE

    state = app[STATE]
    path = state.config_path
    if path is None:
        return False, "this gateway was not started from a config file"
    async with state.reload_lock:
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            state.reloads["rejected"] += 1
            msg = f"config reload ({reason}) rejected: cannot read {path}: {e.strerror or e}; keeping the running config"
            log.error(msg)
            return False, msg
        state.config_digest = hashlib.sha256(data).digest()
        try:
            new = load_config(path)
            retired = apply_config(app, new)
        except (ConfigError, ReloadRejected) as e:
            state.reloads["rejected"] += 1
            msg = f"config reload ({reason}) rejected: {e}; keeping the running config"
            log.error(msg)
            return False, msg
        state.reloads["ok"] += 1
        log.warning("config reloaded (%s) from %s: %d backends", reason, path, len(new.backends))
        if retired:
            total = new.timeouts.total_s or 3600.0
            task = asyncio.create_task(_close_when_idle(retired, state, total))
            if state.tasks_list is not None:
                state.tasks_list.append(task)
        return True, "reloaded"


async def watch_config(app: web.Application) -> None:
    """Reload when the config file's content changes (polled every
    ``lifecycle.watch_config_s``; Kubernetes ConfigMap updates arrive as a symlink
    swap, which polling sees)."""
    from gateway.app import STATE

    state = app[STATE]
    while True:
        interval = state.cfg.lifecycle.watch_config_s
        await asyncio.sleep(interval if interval > 0 else 5.0)
        if interval <= 0 or state.config_path is None:
            continue
        try:
            digest = hashlib.sha256(Path(state.config_path).read_bytes()).digest()
        except OSError:
            continue
        if digest != state.config_digest:
            await reload_from_file(app, "config file changed")
