"""Config reload without dropping in-flight requests (SIGHUP, a change of the config
file, or ``POST /admin/reload``).

The new file is loaded and validated first; any error (YAML, a field, a change that
needs a restart) is logged as one line and the running config stays. A valid config
is applied **in place**, in one synchronous step (no request can see half of it):

- it goes through :func:`gateway.runtime.configure`, the code that built the running
  state at startup: a backend kept by name keeps its live state (in-flight count,
  learned speeds, health, breaker, draining), new ones start fresh, removed ones leave
  routing and the prefix index at once and finish what they carry;
- a backend whose URL, timeouts or key changed gets a new connection pool; the old
  pool is closed once its requests are done (at most ``timeouts.total_s`` later);
- a backend whose ``kv_events`` changed is subscribed anew (its precise prefix entries
  are forgotten: the new address may be another engine); one whose ``kv_events`` went
  away is unsubscribed and its lookups are approximate again;
- the routing policy, retries, timeouts, health checks, breaker settings, body limit,
  client keys and their limits, admission settings and the admin key take effect for
  the next request; requests in flight finish under the settings they started with.

Needs a restart (rejected by a reload): ``listen``, ``state``, ``tracing``,
``routing.block_tokens`` / ``prefix_ttl_s`` / ``prefix_index_max_blocks`` (the prefix
index's shape) and adding or changing a ``simulate`` backend.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path

from aiohttp import web

from gateway.config import ConfigError, GatewayConfig, load_config
from gateway.runtime import STATE, GatewayState, configure, model_tokenizers
from gateway.upstream.client import BackendClient
from routing.core import TokenizerError

log = logging.getLogger("gateway.ops.config_reload")


class ReloadRejected(Exception):
    """The new config is invalid or needs a restart; the running one stays."""


def _restart_only(old: GatewayConfig, new: GatewayConfig, urls: dict[str, str]) -> str | None:
    if new.listen != old.listen:
        return "`listen` changed"
    if new.state != old.state:
        return "`state` changed"
    if new.tracing != old.tracing:
        return "`tracing` changed"
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


def apply_config(app: web.Application, new: GatewayConfig) -> list[BackendClient]:
    """Swap ``new`` in (synchronously, through :func:`gateway.runtime.configure`, as at
    startup). Returns the retired clients, whose sessions close once their requests
    are done. Raises :class:`ReloadRejected`."""
    state = app[STATE]
    why = _restart_only(state.cfg, new, state.urls)
    if why:
        raise ReloadRejected(f"{why}; that needs a restart")
    try:
        model_tokenizers(new)  # loaded when the config was validated, unless a file changed since
    except TokenizerError as e:
        raise ReloadRejected(str(e)) from None
    retired = configure(state, new)
    app._client_max_size = new.limits.max_body_bytes  # read by aiohttp for each new request
    return retired


async def _close_when_idle(retired: list[BackendClient], state: GatewayState, wait_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    idle_since = None
    sessions = [c.session for c in retired]
    while loop.time() < deadline:
        busy = any(c.pool.busy for c in retired) or \
            any(not s.closed and s.connector is not None and s.connector._acquired for s in sessions)
        if not busy:
            if idle_since is not None:
                break
            idle_since = loop.time()
        else:
            idle_since = None
        await asyncio.sleep(0.5)
    for c in retired:  # their pools were retired: busy connections close when their requests end
        if c.session in state.sessions:
            state.sessions.remove(c.session)
        await c.session.close()


async def reload_from_file(app: web.Application, reason: str) -> tuple[bool, str]:
    """Load the config file again and apply it. Returns ``(applied, message)``; never
    raises for a bad file (one log line, the running config stays)."""
    state = app[STATE]
    path = state.config_path
    if path is None:
        return False, "this gateway was not started from a config file"
    async with state.reload_lock:
        try:
            data = Path(path).read_bytes()  # noqa: ASYNC240 - a small local file, under the reload lock
        except OSError as e:
            state.reloads["rejected"] += 1
            msg = (f"config reload ({reason}) rejected: cannot read {path}: {e.strerror or e}; "
                   "keeping the running config")
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
        log.info("config reloaded (%s) from %s: %d backends", reason, path, len(new.backends))
        if retired:
            total = new.timeouts.total_s or 3600.0
            state.tasks.append(asyncio.create_task(_close_when_idle(retired, state, total)))
        return True, "reloaded"


async def watch_config(app: web.Application) -> None:
    """Reload when the config file's content changes (polled every
    ``lifecycle.watch_config_s``; Kubernetes ConfigMap updates arrive as a symlink
    swap, which polling sees)."""
    state = app[STATE]
    while True:
        interval = state.cfg.lifecycle.watch_config_s
        await asyncio.sleep(interval if interval > 0 else 5.0)
        if interval <= 0 or state.config_path is None:
            continue
        try:
            digest = hashlib.sha256(Path(state.config_path).read_bytes()).digest()  # noqa: ASYNC240 - small, local
        except OSError:
            continue
        if digest != state.config_digest:
            await reload_from_file(app, "config file changed")
