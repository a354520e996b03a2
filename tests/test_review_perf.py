"""Review of the performance work 298c774..d059299 (metrics as plain floats, the
latin-1 head parser, ``_head()``, the reused RouteRequest, ``_ServedMetrics``, the
inlined relay, ``BackendState.name``, ``chain_seed``'s cache, one round trip per
state sync). Real sockets and a real Redis-protocol server; every wait is bounded.

Tests marked ``fixed_bug`` failed on d059299: the bugs the review found (helper-14),
fixed right after; the others guard edge cases the review checked and found handled."""

from __future__ import annotations

import gc
import math
import tracemalloc
import uuid

import orjson
import pytest
from aiohttp import web

from gateway.server.fast_path import _head
from gateway.ops.config_reload import apply_config
from routing import BackendSpec, Fleet
from routing.estimate import TokenEstimator, _chain_seed_cached
from routing.prefix_index import PrefixIndex
from routing.state import RedisStore, redis_client
from tests.support.redis_server import redis_url
from tests.support.servers import ScriptedBackend, gateway_config, running_gateway
from tests.integration.server.test_adversarial_probes import BODY, exchange, post

_P = "/v1/chat/completions"


# ---- the data plane's head parser (latin-1 text, one _FIELDS regex) -------------------


async def test_head_parser_edge_cases_answer_as_before():
    """Header shapes the latin-1 parser must treat as the byte parser did."""
    n = str(len(BODY))
    cases = {
        # a latin-1 superscript digit is str.isdigit() but no Content-Length: aiohttp's 400
        "superscript_length": (post(_P, BODY).replace(f"Content-Length: {n}".encode(), b"Content-Length: \xb2"),
                               400, "aiohttp"),
        "plus_length": (post(_P, BODY).replace(b"Content-Length: ", b"Content-Length: +"), 400, "aiohttp"),
        # upper-case names, an empty value, padded length: served by the data plane
        "upper_case_names": (b"POST %b HTTP/1.1\r\nHOST: gw\r\nCONTENT-TYPE: application/json\r\n"
                             b"CONTENT-LENGTH:  %b \r\nX-Empty:\r\n\r\n%b" % (_P.encode(), n.encode(), BODY),
                             200, "turbo-gateway"),
    }
    async with ScriptedBackend().running() as be:
        async with running_gateway(gateway_config([{"name": "b", "url": be.url, "models": ["m"]}])) as gw:
            for label, (raw, status, server) in cases.items():
                got, _ = await exchange(gw.url, [raw], 1, wait_s=5, check_close=False)
                assert [d[0] for d in got.done] == [status], label
                assert server in got.done[0][1].get("server", ""), label


async def test_a_latin1_request_id_is_echoed_byte_for_byte():
    async with ScriptedBackend().running() as be:
        async with running_gateway(gateway_config([{"name": "b", "url": be.url, "models": ["m"]}])) as gw:
            got, _ = await exchange(gw.url, [post(_P, BODY, "X-Request-Id: caf\xe9-\xff")], 1, wait_s=5,
                                    check_close=False)
            status, headers, _ = got.done[0]
            assert status == 200 and headers["server"] == "turbo-gateway"
            assert headers["x-request-id"] == "caf\xe9-\xff"
            sent = {k.lower(): v for k, v in be.headers[-1].items()}["x-request-id"]
            assert sent.encode("utf-8", "surrogateescape") == b"caf\xe9-\xff"  # forwarded as the same bytes


@pytest.mark.fixed_bug(reason="a Content-Length of over 4,300 digits raised in data_received: no answer")
async def test_a_content_length_of_thousands_of_digits_is_answered_not_dropped():
    """PRE-EXISTING (also on 298c774): int() of > 4300 digits raises ValueError inside
    data_received; the connection is aborted with no answer (aiohttp answers 400)."""
    raw = post(_P, BODY).replace(f"Content-Length: {len(BODY)}".encode(), b"Content-Length: " + b"0" * 4400 + b"5")
    async with ScriptedBackend().running() as be:
        async with running_gateway(gateway_config([{"name": "b", "url": be.url, "models": ["m"]}])) as gw:
            got, _ = await exchange(gw.url, [raw], 1, wait_s=5, check_close=False)
            assert [d[0] for d in got.done] == [400]


def test_response_head_drops_cr_lf_nul_and_replaces_non_latin1():
    head = _head(200, {"x-a": "a\r\nSet-Cookie: evil", "x-b": "caf\xe9\u20ac\x00z", "x-c": ""}, b"Tail: 1\r\n")
    lines = head.split(b"\r\n")
    assert b"x-a: aSet-Cookie: evil" in lines and b"x-b: caf\xe9?z" in lines and b"x-c: " in lines
    assert not any(line.startswith(b"Set-Cookie") for line in lines)
    assert head.endswith(b"Tail: 1\r\n\r\n") and head.count(b"\r\n\r\n") == 1


# ---- chain_seed's lru_cache ------------------------------------------------------------


@pytest.mark.fixed_bug(reason="chain_seed's lru_cache kept every client-sent cache_salt alive")
def test_chain_seed_cache_does_not_pin_client_supplied_salts():
    """``cache_salt`` is a client's request field of any length (bodies up to 32 MiB):
    lru_cache(4096) keeps each distinct salt alive, so 4096 requests with a 1 MiB salt
    pin 4 GiB. 16 requests with a 1 MiB salt must not retain 16 MiB."""
    est = TokenEstimator()
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(16):
            salt = f"{i}-" + "s" * (1 << 20)
            est.estimate("m", "hello", 4, salt)
            del salt
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
        _chain_seed_cached.cache_clear()
    assert retained < 4 << 20, f"{retained / 2**20:.1f} MiB of salts retained by chain_seed's cache"


# ---- proxy: the reused RouteRequest and _ServedMetrics ---------------------------------


async def test_retry_and_reload_label_the_backend_and_pool_that_answered():
    """A retry after the first route answers from the second backend (metrics say so);
    a reload that moves a backend to another pool, and one that renames it, label the
    next answers with the new pool and name."""

    async def broken(b, request, body):
        return web.json_response({"error": {"message": "down"}}, status=503)

    async with ScriptedBackend(handler=broken).running() as bad, ScriptedBackend().running() as good:
        backends = [{"name": "bad", "url": bad.url, "models": ["m"], "pool": "p1"},
                    {"name": "good", "url": good.url, "models": ["m"], "pool": "p1"}]
        pools = [{"name": "p1"}, {"name": "p2"}]
        cfg = gateway_config(backends, pools=pools, routing={"policy": "round_robin", "scrape_interval_s": 0})
        async with running_gateway(cfg) as gw:
            for _ in range(2):  # round robin: one of them starts on "bad" and is retried
                got, _ = await exchange(gw.url, [post(_P, BODY)], 1, wait_s=5, check_close=False)
                assert got.done[0][0] == 200 and got.done[0][1]["x-turbo-backend"] == "good"
            assert gw.metric("turbo_gateway_requests_total", model="m", backend="good", status="200") == 2
            assert gw.metric("turbo_gateway_requests_total", model="m", backend="bad", status="200") == 0
            assert gw.metric("turbo_gateway_pool_requests_total", pool="p1", status="200") == 2

            moved = [{**backends[1], "pool": "p2"}]
            apply_config(gw.app, gateway_config(moved, pools=pools,
                                                routing={"policy": "round_robin", "scrape_interval_s": 0}))
            got, _ = await exchange(gw.url, [post(_P, BODY)], 1, wait_s=5, check_close=False)
            assert got.done[0][0] == 200
            assert gw.metric("turbo_gateway_pool_requests_total", pool="p2", status="200") == 1
            assert gw.metric("turbo_gateway_pool_ttft_seconds_count", pool="p2") == 1
            assert gw.metric("turbo_gateway_pool_requests_total", pool="p1", status="200") == 2

            renamed = [{**moved[0], "name": "fresh"}]
            apply_config(gw.app, gateway_config(renamed, pools=pools,
                                                routing={"policy": "round_robin", "scrape_interval_s": 0}))
            got, _ = await exchange(gw.url, [post(_P, BODY)], 1, wait_s=5, check_close=False)
            assert got.done[0][0] == 200 and got.done[0][1]["x-turbo-backend"] == "fresh"
            assert gw.state.fleet.backends["fresh"].name == "fresh"
            assert gw.metric("turbo_gateway_requests_total", model="m", backend="fresh", status="200") == 1
            assert gw.idle("fresh")


# ---- routing/state.py: one round trip per sync -----------------------------------------


def _store(url: str, ns: str, index: PrefixIndex | None = None) -> RedisStore:
    st = RedisStore(Fleet([BackendSpec("a", frozenset({"m"}), "mixed", 1.0, "mixed")]), index or PrefixIndex(),
                    url, namespace=ns, timeout_s=2.0)
    st.client = redis_client(url, timeout_s=2.0)
    return st


async def _mget_calls(r) -> int:
    return (await r.info("commandstats")).get("cmdstat_mget", {}).get("calls", 0)


@pytest.mark.fixed_bug(reason="an MGET was counted when none was sent")
async def test_sync_counts_an_mget_only_when_it_sends_one_and_sees_replicas_come_and_go():
    """Replicas that come are read by a second MGET in the same sync, replicas that go
    leave the view at once. Fails on d059299 (minor): when the last other replica goes,
    ``listed`` is empty, no MGET is sent, yet ``calls["mget"]`` (the
    turbo_gateway_state_redis_calls{op="mget"} counter) is incremented."""
    ns = uuid.uuid4().hex
    with redis_url() as url:
        r = redis_client(url, timeout_s=2.0)
        st, peer, late = _store(url, ns), _store(url, ns), _store(url, ns)
        try:
            await peer.sync_once()
            await st.sync_once()  # a replica came: a second MGET reads its load
            assert st.stats.replicas == 2 and st.stats.calls.get("mget") == 1
            await st.sync_once()  # steady: the load rides in the pipeline
            assert st.stats.calls.get("mget") == 1 and st.stats.calls["pipeline"] == 2

            late.fleet.backends["a"].in_flight = 3
            await late.sync_once()
            await st.sync_once()  # another came: its load is counted in this very sync
            assert st.stats.replicas == 3 and st.fleet.backends["a"].remote_in_flight == 3

            for gone in (peer, late):  # both leases end
                await r.zrem(st.k_registry, gone.replica)
                await r.delete(st.k_load_prefix + gone.replica)
            mgets = st.stats.calls.get("mget", 0)
            await r.config_resetstat()
            await st.sync_once()  # nobody else is listed: no MGET beyond the pipeline's
            assert st.stats.replicas == 1 and st.fleet.backends["a"].remote_in_flight == 0
            assert await _mget_calls(r) == 1  # the pipeline's (the replicas listed last round)
            assert st.stats.calls.get("mget", 0) == mgets, "an MGET counted that was never sent"
        finally:
            for s in (st, peer, late):
                await s.client.aclose()
            await r.aclose()


@pytest.mark.fixed_bug(reason="int(inf) in the late-replica stream start: the replica never synced")
async def test_sync_with_an_infinite_prefix_ttl():
    """``routing.prefix_ttl_s: .inf`` passes config validation (and the index handles
    it); the late-replica XRANGE start ``int(ttl_s * 1000)`` raises OverflowError on
    every sync, so that replica never syncs."""
    cfg = gateway_config([{"name": "a", "url": "http://127.0.0.1:1", "models": ["m"]}],
                         routing={"policy": "round_robin", "prefix_ttl_s": math.inf})
    assert cfg.routing.prefix_ttl_s == math.inf
    ns = uuid.uuid4().hex
    with redis_url() as url:
        index = PrefixIndex(ttl_s=cfg.routing.prefix_ttl_s)
        peer, st = _store(url, ns), _store(url, ns, index)
        try:
            peer.record_dispatch("a", (101, 102))
            await peer.sync_once()
            await st.sync_once()
            assert index.match((101, 102), 1.0) == {"a": 2}
        finally:
            for s in (st, peer):
                await s.client.aclose()


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
