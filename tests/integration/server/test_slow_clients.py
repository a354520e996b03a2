"""Deadlines and caps for slow or greedy clients (issue 27, point 4), on both stacks.

Hundreds of connections trickle heads and bodies (a byte at a time, for a bounded
number of rounds, 127.0.0.1 only) while honest clients send completions on fresh
connections: every honest request is served, no backend's breaker hears of it, and the
gateway cuts the trickling connections by its head and body deadlines
(``listen.head_timeout_s``, ``body_timeout_s``, ``body_min_bytes_per_s``) and by its
per-address cap (``listen.max_connections_per_address``), long before the trickle ends."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.support.servers import ScriptedBackend, gateway_config, running_gateway
from tests.support.slow_clients import trickles

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize("fast_path", [True, False])
async def test_hundreds_of_trickling_connections_neither_stop_honest_clients_nor_trip_a_breaker(fast_path):
    be = ScriptedBackend()
    async with be.running():
        cfg = gateway_config([{"name": "b", "url": be.url, "models": ["m"]}],
                             listen={"fast_path": fast_path, "head_timeout_s": 1.0, "body_timeout_s": 1.0,
                                     "body_min_bytes_per_s": 1_000_000, "max_connections_per_address": 100},
                             breaker={"failure_threshold": 1})
        async with running_gateway(cfg) as gw:
            port = int(gw.url.rsplit(":", 1)[1])
            connected: list[int] = []
            tricklers = [asyncio.ensure_future(t) for t in trickles(port, connected)]
            # the honest clients come once the tricklers hold their connections: a new
            # connection from an address at its cap replaces the one idle longest there
            while len(connected) < len(tricklers):
                await asyncio.sleep(0.01)
            served = 0
            try:
                while not all(t.done() for t in tricklers) or served < 20:
                    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s, \
                            s.post(gw.url + "/v1/chat/completions", json=CHAT,
                                   timeout=aiohttp.ClientTimeout(total=30)) as r:
                        assert r.status == 200, await r.text()
                        await r.read()
                    served += 1
                    await asyncio.sleep(0.05)
                cut = [await t for t in tricklers]
            finally:
                for t in tricklers:
                    t.cancel()
            assert served >= 20
            assert all(cut), f"{cut.count(False)} of {len(cut)} trickling connections outlived the deadlines"
            backend = gw.state.fleet.backends["b"]
            assert backend.breaker.state == "closed" and backend.breaker.opened_total == 0
            assert len(be.bodies) == served  # no trickler's request reached the backend
