"""LoRA adapters loaded on demand (``backends[].lora.dynamic``, ``models.<name>.lora``).

When routing chose a backend that may load the request's adapter but does not list it,
:meth:`AdapterLoader.ensure` loads it there first through vLLM's
``POST /v1/load_lora_adapter`` (``{"lora_name", "lora_path"}``; 200 on success, 400
"has already been loaded" when another client loaded it meanwhile), once per backend
and adapter however many requests wait for it, then tells the decision core
(:meth:`routing.core.DecisionCore.adapter_loaded`). A failed load is an
:class:`~gateway.errors.AdapterLoadFailed` attempt failure: the request is retried
on another backend like any failed attempt.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from gateway.errors import AdapterLoadFailed
from routing.core import DecisionCore

log = logging.getLogger("gateway.upstream.lora_loader")


class AdapterLoader:
    """The on-demand loads in progress, one per (backend, adapter)."""

    def __init__(self) -> None:
        self._loads: dict[tuple[str, str], asyncio.Future] = {}

    async def ensure(self, core: DecisionCore, client, adapter: str, path: str, timeout_s: float) -> None:
        """Load ``adapter`` (from ``path``, as the engine sees it) on ``client``'s
        backend, or wait for the load already under way; returns once it is loaded.
        Raises :class:`AdapterLoadFailed` (within ``timeout_s`` seconds)."""
        key = (client.state.name, adapter)
        fut = self._loads.get(key)
        if fut is None:
            fut = asyncio.ensure_future(self._load(core, client, adapter, path, timeout_s))
            self._loads[key] = fut
            fut.add_done_callback(lambda f: self._done(key, f))
        await asyncio.shield(fut)  # a waiter that leaves does not cancel the others' load

    def _done(self, key: tuple[str, str], fut: asyncio.Future) -> None:
        if self._loads.get(key) is fut:
            del self._loads[key]
        if not fut.cancelled():
            fut.exception()  # retrieved here too: every waiter may have left

    @staticmethod
    async def _load(core: DecisionCore, client, adapter: str, path: str, timeout_s: float) -> None:
        name = client.state.name
        headers = {"Authorization": client.auth_header} if client.auth_header else None
        try:
            async with client.session.post(client.base_url + "/v1/load_lora_adapter",
                                           json={"lora_name": adapter, "lora_path": path}, headers=headers,
                                           timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                text = await r.text(errors="replace")
                ok = r.status == 200 or (r.status == 400 and "already been loaded" in text)
                if not ok:
                    raise AdapterLoadFailed(name, f"backend {name} did not load LoRA adapter {adapter!r}: "
                                            f"HTTP {r.status} {text[:200]}")
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            raise AdapterLoadFailed(name, f"backend {name} did not load LoRA adapter {adapter!r}: "
                                    f"{type(e).__name__} {e}") from None
        log.info("loaded LoRA adapter %s on backend %s", adapter, name)
        core.adapter_loaded(client.state, adapter)
