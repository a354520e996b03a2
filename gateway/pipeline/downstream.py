"""The client side of an exchange: where :class:`gateway.proxy.Proxy` writes its answer.

Three kinds, one interface: :class:`AiohttpDownstream` (a request served by the aiohttp
app), :class:`gateway.fastpath.FastDownstream` (a completion served by the data-plane
protocol) and :class:`CollectDownstream` (an in-process batch consumer, no socket).

- :meth:`respond` answers at once with a whole body (bytes) and headers;
- :meth:`start_stream` sends status 200, the headers and the first chunk of a chunked
  stream (``end=True``: also its end); :meth:`write` and :meth:`end_stream` go on;
- ``transport`` is the socket the SSE relay writes to directly (HTTP/1.1 chunks when
  ``chunked``), or ``None``; ``started`` tells whether any byte was committed to the
  client; ``may_wait`` whether :meth:`start_stream` can wait for a slow client (one that
  cannot also offers ``start_stream_now``, the same call without ``await``, which the
  proxy makes from inside the backend connection's read callback).

All writers raise :class:`ClientGone` when the client's connection is gone.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web


class ClientGone(Exception):
    """The client closed its connection while the response was being written."""


_WRITE_ERRORS = (ConnectionError, aiohttp.ClientConnectionResetError)


class AiohttpDownstream:
    """Writes through aiohttp's response objects; ``response`` is what the handler returns.
    An HTTP/1.0 client gets its stream unframed, ended by closing the connection."""

    __slots__ = ("request", "response", "started", "chunked")
    may_wait = True  # start_stream may wait for a slow client (aiohttp's drain)

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None
        self.started = False
        self.chunked = request.version >= (1, 1)

    @property
    def transport(self) -> asyncio.Transport | None:
        return self.request.transport  # type: ignore[return-value]

    def respond(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.response = web.Response(status=status, body=body, headers=headers)

    async def start_stream(self, headers: dict[str, str], first: bytes, end: bool = False) -> None:
        out = web.StreamResponse(status=200, headers=headers)
        if self.chunked:
            out.enable_chunked_encoding()
        else:
            out.force_close()
        try:
            await out.prepare(self.request)
            self.response, self.started = out, True
            if end:
                await out.write_eof(first)
            else:
                await out.write(first)  # the headers and the first chunk in one write
        except _WRITE_ERRORS as e:
            raise ClientGone() from e

    async def write(self, data: bytes) -> None:
        assert self.response is not None
        try:
            await self.response.write(data)
        except _WRITE_ERRORS as e:
            raise ClientGone() from e

    async def end_stream(self, last: bytes = b"") -> None:
        assert self.response is not None
        try:
            await self.response.write_eof(last)
        except _WRITE_ERRORS as e:
            raise ClientGone() from e


class CollectDownstream:
    """Keeps the answer in memory (status, headers, body) for an in-process caller."""

    __slots__ = ("status", "headers", "body", "started")
    transport = None
    chunked = False
    may_wait = False

    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = b""
        self.started = False

    def respond(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.status, self.body, self.headers = status, body, dict(headers)

    def start_stream_now(self, headers: dict[str, str], first: bytes, end: bool = False) -> None:
        self.status, self.headers, self.body, self.started = 200, dict(headers), first, True

    async def start_stream(self, headers: dict[str, str], first: bytes, end: bool = False) -> None:
        self.start_stream_now(headers, first, end)

    async def write(self, data: bytes) -> None:
        self.body += data

    async def end_stream(self, last: bytes = b"") -> None:
        self.body += last


Downstream = Any  # AiohttpDownstream | FastDownstream | CollectDownstream (duck-typed, see the module doc)
