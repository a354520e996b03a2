"""Active health checks: one background task probing every backend periodically."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

import aiohttp

from gateway.config import HealthChecks

log = logging.getLogger("gateway.health")


class HealthChecker:
    """Probes ``GET {base_url}{path}``; updates ``BackendState.healthy`` and
    ``checked``. A backend is marked up again after ``healthy_threshold`` consecutive
    successful probes, and down after ``unhealthy_threshold`` consecutive
    failed probes. ``on_recovered(backend_state)`` is called when a backend that was
    down is marked up again (it may have restarted with an empty KV cache)."""

    def __init__(self, cfg: HealthChecks, clients: Iterable, paths: dict[str, str],
                 on_recovered: Callable | None = None) -> None:
        self.cfg = cfg
        self.on_recovered = on_recovered
        self.clients = list(clients)
        self.paths = paths
        self.failures: dict[str, int] = {}
        self.successes: dict[str, int] = {}
        self.checked: set[str] = set()

    async def probe(self, client) -> bool:
        try:
            async with client.session.get(client.base_url + self.paths[client.state.name],
                                          timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s)) as r:
                await r.read()
                return 200 <= r.status < 300
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def check_all(self) -> None:
        """One round over every backend, concurrently."""
        results = await asyncio.gather(*(self.probe(c) for c in self.clients))
        for c, ok in zip(self.clients, results):
            name = c.state.name
            self.checked.add(name)
            if ok:
                self.failures[name] = 0
                n_ok = self.successes[name] = self.successes.get(name, 0) + 1
                if not c.state.healthy and n_ok >= self.cfg.healthy_threshold:
                    log.warning("backend %s passed %d health checks; it is healthy again", name, n_ok)
                    c.state.healthy = True
                    if self.on_recovered is not None:
                        self.on_recovered(c.state)
            else:
                self.successes[name] = 0
                n = self.failures[name] = self.failures.get(name, 0) + 1
                if n >= self.cfg.unhealthy_threshold and c.state.healthy:
                    log.warning("backend %s failed %d health checks; marking it down", name, n)
                    c.state.healthy = False

    def ready(self) -> bool:
        """At least one backend passed its last check."""
        return any(c.state.healthy and c.state.name in self.checked and self.failures.get(c.state.name, 0) == 0
                   for c in self.clients)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            await self.check_all()
