"""What the TTFT work on the data plane must not break, over real sockets on 127.0.0.1:

- a stream whose status, headers and first event arrive in one read is answered from
  inside that read (``UpstreamPool.request(on_ready=...)``, ``Proxy._open_stream``);
- relayed reads wait for their turn (``gateway.upstream.relay_turns.RelayTurns``) and still reach
  the client byte-exact and in order, also when the backend closes right after;
- the listening socket accepts every queued connection, not one per loop turn.

The backends here are raw asyncio servers, so that the test decides which bytes go out
in one write (one segment on loopback, one read at the gateway)."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import orjson
import pytest
import uvloop

from gateway.server.app import STATE, create_app
from gateway.server.listener import listen
from gateway.upstream.client import UpstreamPool
from tests.support.servers import gateway_config, raw_backend, running_gateway, sse_chunk, wait_until

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "stream_options": {"include_usage": True}}
HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
        b"Cache-Control: no-cache\r\n\r\n")
ROLE = (b'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"m","choices":[{"index":0,'
        b'"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n')
USAGE = (b'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"m","choices":[],'
         b'"usage":{"prompt_tokens":9,"completion_tokens":%d,"total_tokens":%d}}\n\n')
DONE = b"data: [DONE]\n\n"



def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One HTTP/1.1 request with a Content-Length body; b"" at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return b""
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)

def token_events(n: int) -> list[bytes]:
    return [sse_chunk(i, f" t{i}") for i in range(n)]


async def stream(url: str) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", data=orjson.dumps(CHAT),
                          headers={"Content-Type": "application/json"}) as r:
            return r.status, await r.read()


async def test_on_ready_is_called_when_head_and_body_share_a_read() -> None:
    async def script(reader, writer):
        while await read_request(reader):
            writer.write(HEAD + chunk(ROLE))  # one write: head and first event
            await writer.drain()
            await reader.read(1)  # the client's next request or EOF: nothing more for this test

    async with raw_backend(script) as url:
        pool = UpstreamPool(url, 5.0)
        calls: list[tuple[int, bytes]] = []
        try:
            ex = await pool.request("/v1/chat/completions", b"", b"{}", None,
                                    lambda up: calls.append((up.status, up.take())))
            assert calls == [(200, chunk(ROLE)[len(b"%x\r\n" % len(ROLE)):-2])]  # once, with the event's bytes
            assert ex.status == 200
            ex.abort(ConnectionError("done"))
        finally:
            pool.close()


async def test_on_ready_is_not_called_once_the_owner_resumed_on_the_head() -> None:
    head_seen = asyncio.Event()

    async def script(reader, writer):
        await read_request(reader)
        writer.write(HEAD)  # the head alone
        await writer.drain()
        await head_seen.wait()  # the owner resumed: now the first event
        writer.write(chunk(ROLE) + chunk(DONE) + b"0\r\n\r\n")
        await writer.drain()

    async with raw_backend(script) as url:
        pool = UpstreamPool(url, 5.0)
        calls: list[int] = []
        try:
            ex = await pool.request("/v1/chat/completions", b"", b"{}", None, lambda up: calls.append(up.status))
            head_seen.set()
            body = await ex.read()
            assert body == ROLE + DONE
            assert calls == []  # the owner took the body itself
            ex.finish()
        finally:
            pool.close()


async def test_early_answered_stream_is_byte_exact_and_fully_accounted() -> None:
    events = token_events(24)

    async def script(reader, writer):
        while await read_request(reader):
            writer.write(HEAD + chunk(ROLE))
            await writer.drain()
            for e in events:
                writer.write(chunk(e))
                await writer.drain()
            writer.write(chunk(USAGE % (len(events), 9 + len(events))) + chunk(DONE) + b"0\r\n\r\n")
            await writer.drain()

    async with raw_backend(script) as url:
        cfg = gateway_config([{"name": "raw", "url": url, "models": ["m"]}])
        async with running_gateway(cfg) as gw:
            for _ in range(2):  # the second one on the pooled connection
                status, body = await stream(gw.url)
                assert status == 200
                assert body == ROLE + b"".join(events) + USAGE % (len(events), 9 + len(events)) + DONE
            assert gw.metric("turbo_gateway_completion_tokens_total", model="m") == 2 * len(events)
            assert gw.metric("turbo_gateway_prompt_tokens_total", model="m") == 18
            assert gw.metric("turbo_gateway_requests_total", model="m", backend="raw", status="200") == 2
            assert gw.idle("raw")
            assert gw.state.clients["raw"].pool.idle >= 1  # kept alive and reused (and a spare made)


async def test_client_leaving_after_the_early_first_event_closes_the_backend_connection() -> None:
    backend_saw_close = asyncio.Event()

    async def script(reader, writer):
        await read_request(reader)
        writer.write(HEAD + chunk(ROLE) + chunk(sse_chunk(0, " t0")))
        await writer.drain()
        if await reader.read(1) == b"":  # the gateway dropped the connection: the engine would abort
            backend_saw_close.set()

    async with raw_backend(script) as url:
        cfg = gateway_config([{"name": "raw", "url": url, "models": ["m"]}])
        async with running_gateway(cfg) as gw:
            async with aiohttp.ClientSession() as s:
                async with s.post(gw.url + "/v1/chat/completions", data=orjson.dumps(CHAT),
                                  headers={"Content-Type": "application/json"}) as r:
                    assert r.status == 200
                    assert (await r.content.readuntil(b"\n\n")) == ROLE
            await asyncio.wait_for(backend_saw_close.wait(), 10)
            await wait_until(lambda: gw.idle("raw"))
            assert gw.metric("turbo_gateway_client_disconnects_total", backend="raw") == 1


async def test_error_status_in_one_read_is_not_answered_early_but_retried() -> None:
    async def failing(reader, writer):
        await read_request(reader)
        body = b'{"error":{"message":"overloaded","type":"server_error"}}'
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
        await writer.drain()

    async def good(reader, writer):
        while await read_request(reader):
            writer.write(HEAD + chunk(ROLE) + chunk(DONE) + b"0\r\n\r\n")
            await writer.drain()

    async with raw_backend(failing) as bad_url, raw_backend(good) as good_url:
        cfg = gateway_config([{"name": "bad", "url": bad_url, "models": ["m"]},
                              {"name": "good", "url": good_url, "models": ["m"]}])
        async with running_gateway(cfg) as gw:
            status, body = await stream(gw.url)  # round robin: `bad` first, then the retry
            assert status == 200
            assert body == ROLE + DONE
            assert gw.metric("turbo_gateway_retries_total", reason="status_503") == 1
            assert gw.idle("bad") and gw.idle("good")


async def test_backend_closing_right_after_a_burst_loses_no_byte() -> None:
    """A close-delimited stream (no length, no chunking) whose last events and close
    arrive together: the queued reads are relayed before the close ends the response."""
    events = token_events(40)

    async def script(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n" + ROLE)
        await writer.drain()
        for e in events[:10]:
            writer.write(e)
            await writer.drain()
        writer.write(b"".join(events[10:]) + DONE)  # the rest in one burst, then the close
        await writer.drain()

    async with raw_backend(script) as url:
        cfg = gateway_config([{"name": "raw", "url": url, "models": ["m"]}])
        async with running_gateway(cfg) as gw:
            for _ in range(5):
                status, body = await stream(gw.url)
                assert status == 200
                assert body == ROLE + b"".join(events) + DONE
            assert gw.idle("raw")


async def test_many_streams_relayed_in_turns_stay_byte_exact() -> None:
    """64 streams whose events arrive in the same loop turns: each client gets exactly
    its own bytes, in order."""
    async def script(reader, writer):
        while True:
            req = await read_request(reader)
            if not req:
                return
            tag = req.rsplit(b'"tag":"', 1)[1].split(b'"', 1)[0]
            writer.write(HEAD + chunk(ROLE))
            await writer.drain()
            for i in range(30):
                writer.write(chunk(sse_chunk(i, f" {tag.decode()}-{i}")))
                await writer.drain()
                if i % 10 == 9:
                    await asyncio.sleep(0)  # let the other streams' writes interleave
            writer.write(chunk(DONE) + b"0\r\n\r\n")
            await writer.drain()

    async def one(url: str, tag: str) -> bytes:
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/chat/completions", data=orjson.dumps({**CHAT, "tag": tag}),
                              headers={"Content-Type": "application/json"}) as r:
                assert r.status == 200
                return await r.read()

    async with raw_backend(script) as url:
        cfg = gateway_config([{"name": "raw", "url": url, "models": ["m"]}])
        async with running_gateway(cfg) as gw:
            tags = [f"s{k}" for k in range(64)]
            bodies = await asyncio.gather(*(one(gw.url, t) for t in tags))
            for tag, body in zip(tags, bodies):
                assert body == ROLE + b"".join(sse_chunk(i, f" {tag}-{i}") for i in range(30)) + DONE
            assert gw.idle("raw")


def test_every_queued_connection_is_accepted_in_one_loop_turn() -> None:
    """On uvloop, whose own servers accept one connection per loop iteration (libuv
    PR #3696): 64 connections made while the loop is busy are all taken at its next
    poll, not one per turn."""
    async def main() -> None:
        cfg = gateway_config([{"name": "b", "url": "http://127.0.0.1:9", "models": ["m"]}],
                             health={"interval_s": 3600})
        app = create_app(cfg)
        server = await listen(app, "127.0.0.1", 0)
        port = server.addresses[0][1]
        socks = []
        try:
            for _ in range(64):  # blocking connects: the kernel completes them while the loop waits for us
                socks.append(socket.create_connection(("127.0.0.1", port)))
            for _ in range(3):  # poll (accept all), connection_made, and one turn to spare
                await asyncio.sleep(0)
            assert len(server.conns) == 64
        finally:
            for s in socks:
                s.close()
            await server.shutdown(app[STATE].cfg.lifecycle.drain_timeout_s)

    uvloop.run(main())


async def test_taking_the_last_idle_connection_makes_a_spare() -> None:
    """Envoy-style preconnect: a request that takes the pool's last idle connection
    starts one more in the background, so that the next one does not connect in its
    TTFT; a pool with idle connections left makes none."""
    connections = 0
    release = asyncio.Event()

    async def script(reader, writer):
        nonlocal connections
        connections += 1
        while await read_request(reader):
            await release.wait()
            writer.write(HEAD + chunk(ROLE) + chunk(DONE) + b"0\r\n\r\n")
            await writer.drain()

    async with raw_backend(script) as url:
        pool = UpstreamPool(url, 5.0)
        try:
            release.set()
            ex = await pool.request("/v1/chat/completions", b"", b"{}")  # no idle one: connects itself
            assert await ex.read() == ROLE + DONE
            ex.finish()
            assert (pool.idle, connections) == (1, 1)  # no spare for a request that connected itself
            release.clear()
            pending = asyncio.ensure_future(pool.request("/v1/chat/completions", b"", b"{}"))  # takes the last one
            await wait_until(lambda: pool.idle == 1 and connections == 2)  # the spare, while it waits
            release.set()
            ex = await pending
            assert await ex.read() == ROLE + DONE
            ex.finish()
            assert pool.idle == 2
        finally:
            pool.close()


async def test_batched_sends_keep_order_and_close_after_their_bytes() -> None:
    """gateway/eventloop/batched_writes.py: what one loop turn queues goes out in order, a queued close
    after the bytes queued before it, and nothing is written to a closed transport."""
    from gateway.eventloop.batched_writes import Sends

    got: dict[int, bytes] = {}
    done = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        k = int((await reader.readexactly(1)).decode())
        got[k] = await reader.read()  # until the sender's close
        writer.close()
        if len(got) == 2:
            done.set()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        loop = asyncio.get_running_loop()
        (_, w1), (_, w2) = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        t1, t2 = w1.transport, w2.transport
        sends = Sends.of(loop)
        sends.send(t1, b"1first ")
        sends.send(t2, b"2other ")
        sends.send(t1, b"second")
        sends.close(t1)  # after t1's two sends
        sends.send(t2, b"stream")
        sends.close(t2)
        assert not t1.is_closing()  # nothing happened yet: all of it goes out at the end of the turn
        await asyncio.wait_for(done.wait(), 10)
        assert got == {1: b"first second", 2: b"other stream"}
        sends.send(t1, b"late")  # t1 is closed: dropped, no error
        sends.flush()
        assert sends.queue == []
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.fixed_bug(reason="a 502 answer finished twice put its connection in the idle pool twice: "
                              "two later requests shared it and one got the other's answer")
async def test_an_exchange_finished_twice_returns_its_connection_once() -> None:
    answers = iter([b"first", b"second", b"third"])

    async def script(reader, writer):
        while await read_request(reader):
            body = next(answers)
            writer.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    async with raw_backend(script) as url:
        pool = UpstreamPool(url, 5.0)
        try:
            ex = await pool.request("/v1/chat/completions", b"", b"{}")
            assert (ex.status, await ex.read()) == (502, b"first")
            ex.finish()
            ex.finish()
            assert pool.idle == 1  # once, not twice
            a, b = await asyncio.gather(pool.request("/v1/chat/completions", b"", b"{}"),
                                        pool.request("/v1/chat/completions", b"", b"{}"))
            assert sorted([await a.read(), await b.read()]) == [b"second", b"third"]  # each its own answer
            assert a.conn is not b.conn
            a.finish()
            b.finish()
        finally:
            pool.close()
