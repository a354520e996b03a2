"""The tests' Envoy starter survives a port that another process takes between its choice
and Envoy's bind."""

from __future__ import annotations

import socket

import aiohttp
import pytest

from tests.support.envoy import envoy

pytestmark = pytest.mark.slow


def _direct_response(listen: int, admin: int) -> dict:
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {"listeners": [{
            "name": "inference",
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen}},
            "filter_chains": [{"filters": [{
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
                             ".HttpConnectionManager",
                    "stat_prefix": "t",
                    "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [{
                        "match": {"prefix": "/"},
                        "direct_response": {"status": 200, "body": {"inline_string": "ok"}}}]}]},
                    "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}}]}]}]}}


async def test_a_listen_port_taken_before_envoy_binds_it_starts_envoy_on_new_ports():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        taken_port = taken.getsockname()[1]
        offered: list[int] = []

        def bootstrap_for(listen: int, admin: int) -> dict:
            offered.append(listen)
            return _direct_response(taken_port if len(offered) == 1 else listen, admin)

        async with envoy(bootstrap_for) as e, aiohttp.ClientSession() as s:
            async with s.get(e.url + "/") as r:
                assert r.status == 200 and await r.text() == "ok"
        assert len(offered) == 2 and e.url.endswith(f":{offered[1]}")
