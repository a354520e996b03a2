"""Active health checks: one background task probing every backend periodically.

The same round reads ``GET {base_url}/v1/models`` of every backend configured with
``models: auto`` and hands what it lists to the decision core
(:meth:`routing.core.DecisionCore.set_served_models`). The shapes read
(:func:`parse_models_list`): the OpenAI list ``{"data": [{"id": ...}, ...]}`` that vLLM,
SGLang and llama.cpp's ``llama-server`` all serve; vLLM and SGLang add ``max_model_len``
(tokens) and, for a LoRA adapter, ``parent`` (its base model). llama.cpp reports only
the training context (``meta.n_ctx_train``), not the served one, so its models carry no
``max_model_len``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

import aiohttp

from gateway.config import HealthChecks
from gateway.errors import reason
from routing.core import DecisionCore, ServedModel

log = logging.getLogger("gateway.engine_signals.health_checks")


def parse_models_list(body: object) -> list[ServedModel]:
    """The models of a backend's ``GET /v1/models`` JSON ``body`` (see the module
    docstring for the shapes). Entries without a string ``id`` are skipped; a
    ``max_model_len`` that is not a positive integer is ignored. Raises ``ValueError``
    when ``body`` is not an object with a ``data`` list."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise ValueError("not an OpenAI model list (no `data` array)")
    out: list[ServedModel] = []
    seen: set[str] = set()
    for m in data:
        if not isinstance(m, dict) or not isinstance(m.get("id"), str) or not m["id"] or m["id"] in seen:
            continue
        seen.add(m["id"])
        parent = m.get("parent")
        n = m.get("max_model_len")
        out.append(ServedModel(m["id"], parent if isinstance(parent, str) and parent != m["id"] else None,
                               n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None))
    return out


class HealthChecker:
    """Probes ``GET {base_url}{path}``; updates ``BackendState.healthy`` and
    ``checked``. A backend is marked up again after ``healthy_threshold`` consecutive
    successful probes, and down after ``unhealthy_threshold`` consecutive
    failed probes. ``on_recovered(backend_state)`` is called when a backend that was
    down is marked up again (it may have restarted with an empty KV cache). Backends
    whose spec has ``reads_models`` set also have their ``/v1/models`` read each round
    that their probe passed; what it lists goes to ``core``. A failed read keeps the
    models last read."""

    def __init__(self, cfg: HealthChecks, clients: Iterable, paths: dict[str, str],
                 on_recovered: Callable | None = None, core: DecisionCore | None = None) -> None:
        self.cfg = cfg
        self.on_recovered = on_recovered
        self.core = core
        self.discovery_ok: dict[str, bool] = {}
        self.unservable: set[str] = set()  # on-demand adapters logged as served by no backend
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
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def discover(self, client) -> None:
        """Read ``client``'s ``/v1/models`` into the decision core."""
        name = client.state.name
        try:
            async with client.session.get(client.base_url + "/v1/models",
                                          timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s)) as r:
                if r.status != 200:
                    raise ValueError(f"HTTP {r.status}")
                models = parse_models_list(await r.json(content_type=None))
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
            if self.discovery_ok.get(name, True):
                log.warning("cannot read the models of backend %s (%s); keeping the last ones read", name, reason(e))
            self.discovery_ok[name] = False
            return
        self.discovery_ok[name] = True
        if self.core is not None and self.core.set_served_models(client.state, models):
            st = client.state
            loadable = {m for m in st.models() if st.needs_load(m)}
            log.info("backend %s now serves %s%s", name, ", ".join(sorted(st.models() - loadable)) or "nothing",
                     f" (and may load on demand: {', '.join(sorted(loadable))})" if loadable else "")

    async def discover_all(self) -> None:
        """Read the models of every backend configured with ``models: auto`` or
        on-demand LoRA adapters."""
        await asyncio.gather(*(self.discover(c) for c in self.clients if c.state.spec.reads_models))
        self.note_unservable_adapters()

    def note_unservable_adapters(self) -> None:
        """Log once each LoRA adapter that backends may load on demand but none can
        serve: none of them lists its base model (a misspelt ``models.<a>.lora.base``
        otherwise shows only as a 404 ``model_not_found``). Judged once every backend
        that reads its models has been read."""
        readers = [c for c in self.clients if c.state.spec.reads_models]
        if self.core is None or not all(self.discovery_ok.get(c.state.name) for c in readers):
            return
        served = set(self.core.fleet.models())
        for c in readers:
            for adapter, base in c.state.spec.loadable:
                if adapter not in served and adapter not in self.unservable:
                    self.unservable.add(adapter)
                    log.warning("LoRA adapter %s is served by no backend: no backend that may load it lists its "
                                "base model %s (see models.%s.lora.base)", adapter, base, adapter)

    async def check_all(self) -> None:
        """One round over every backend, concurrently; then the models of those that
        passed and discover theirs."""
        results = await asyncio.gather(*(self.probe(c) for c in self.clients))
        await asyncio.gather(*(self.discover(c) for c, ok in zip(self.clients, results)
                               if ok and c.state.spec.reads_models))
        self.note_unservable_adapters()
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

    def passing(self, name: str) -> bool:
        """Whether backend ``name`` passed its last check (and is routed to)."""
        b = next((c.state for c in self.clients if c.state.name == name), None)
        return b is not None and b.healthy and name in self.checked and self.failures.get(name, 0) == 0

    def ready(self) -> bool:
        """At least one backend passed its last check."""
        return any(self.passing(c.state.name) for c in self.clients)

    def describe(self, name: str) -> str:
        """Backend ``name``'s health in words, for ``/ready``."""
        b = next((c.state for c in self.clients if c.state.name == name), None)
        if b is None or name not in self.checked:
            return "not checked yet"
        if not b.healthy:
            return f"down: failed {self.failures.get(name, 0)} health checks in a row"
        n = self.failures.get(name, 0)
        if n:
            return f"failing: failed its last {n} health check(s); marked down after {self.cfg.unhealthy_threshold}"
        return "passing"

    async def run(self) -> None:
        await self.discover_all()  # an auto backend serves nothing before its first read
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            await self.check_all()
