"""Slow clients for the tests: connections that send a request head or body a byte at a
time (:func:`trickles`), on 127.0.0.1 only and each for a bounded number of rounds."""

from __future__ import annotations

import asyncio

ROUNDS = 40  # bytes each trickler sends, one per TRICKLE_S, unless cut first
TRICKLE_S = 0.25


async def trickle(port: int, head: bytes, tail: bytes, connected: list[int]) -> bool:
    """Connect, send ``head`` at once, then ``tail`` a byte at a time. Returns whether
    the gateway closed the connection before the tail was sent."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return True  # refused at the door counts as cut
    finally:
        connected.append(1)
    try:
        writer.write(head)
        for i in range(min(ROUNDS, len(tail))):
            await asyncio.sleep(TRICKLE_S)
            if reader.at_eof():
                return True
            writer.write(tail[i:i + 1])
            try:
                await writer.drain()
            except ConnectionError:
                return True
            try:  # anything the gateway sent (an answer, or EOF) ends it
                await asyncio.wait_for(reader.read(1024), 0.001)
                return True
            except TimeoutError:
                pass
        return False
    except ConnectionError:
        return True
    finally:
        writer.close()


def trickles(port: int, connected: list[int]) -> list:
    lean_head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"
    aiohttp_head = b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n"
    body_head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 4000\r\n\r\n")
    chunked_head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n400\r\n")
    return ([trickle(port, lean_head, b"X-Slow: " + b"a" * 100, connected) for _ in range(120)]
            + [trickle(port, aiohttp_head, b"X-Slow: " + b"a" * 100, connected) for _ in range(80)]
            + [trickle(port, body_head, b"{" * 100, connected) for _ in range(60)]
            + [trickle(port, chunked_head, b"{" * 100, connected) for _ in range(40)])
