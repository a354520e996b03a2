"""Senders: how a batch consumer (:mod:`gateway.batch.worker`) sends a line.

:class:`HttpSender` posts it to a gateway with ``x-turbo-priority: batch``
(``python -m gateway.batch`` on any machine); :class:`LocalSender` hands it to this
gateway's own proxy (in-process workers). Both pass the same admission gate
(:mod:`gateway.batch.batch_gate`). The usage ledger (:mod:`gateway.tenancy.usage_ledger`)
counts a line sent by :class:`LocalSender` under its batch's owner, and one posted by
:class:`HttpSender` under the key the consumer authenticates with (the gateway knows
no other caller).
"""

from __future__ import annotations

import asyncio

import aiohttp

from gateway.apis.registry import BY_PATH
from gateway.batch.batch_gate import PRIORITY_HEADER
from gateway.pipeline import director
from gateway.tenancy.keys import ANONYMOUS

Answer = tuple[int, dict[str, str], bytes]


class HttpSender:
    """Posts lines to a gateway (``base_url`` without ``/v1``)."""

    def __init__(self, base_url: str, timeout_s: float, *, priority: bool = True, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.headers = {"Content-Type": "application/json"}
        if priority:
            self.headers[PRIORITY_HEADER] = "batch"
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.session: aiohttp.ClientSession | None = None

    async def send(self, url: str, body: bytes, request_id: str, key_name: str | None = None) -> Answer:
        """POST the line; ``key_name`` is ignored (the gateway counts the consumer's key)."""
        if self.session is None:
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        async with self.session.post(self.base_url + url, data=body, timeout=self.timeout,
                                     headers={**self.headers, "x-request-id": request_id}) as resp:
            data = await resp.read()
            return resp.status, dict(resp.headers), data

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


class LocalSender:
    """Sends lines through this gateway's own gate and pipeline (no HTTP hop)."""

    def __init__(self, state, gate, timeout_s: float) -> None:
        self.state = state
        self.gate = gate
        self.timeout_s = timeout_s

    async def send(self, url: str, body: bytes, request_id: str, key_name: str | None = None) -> Answer:
        """Serve the line in process, its usage counted under ``key_name`` (the batch's
        owner; ``anonymous`` when ``None``)."""
        async with asyncio.timeout(self.timeout_s):
            return await director.collect(self.state, BY_PATH[url], body, request_id, key_name or ANONYMOUS)

    async def close(self) -> None:
        return None
