"""Where a request's answer goes: one interface, :class:`Downstream`, three kinds.

:class:`AiohttpDownstream` (a completion served by the aiohttp app),
:class:`gateway.server.lean_downstream.LeanDownstream` (one served by the lean HTTP/1.1 protocol) and
:class:`CollectDownstream` (an in-process batch line, no socket).

- :meth:`respond` answers at once with a whole body (bytes) and headers;
- :meth:`start_stream` sends status 200, the headers and the first chunk of a chunked
  stream (``end=True``: also its end), or only the chunk when the stream was started
  already (a keep-alive comment went first); :meth:`write` and :meth:`end_stream` go on;
- ``keepalive``: whether the answer may start with keep-alive comments before the
  first event (a client on the other end of a connection);
- ``transport`` is what the SSE relay writes each relayed read to directly (HTTP/1.1
  chunks when ``chunked``): the client's socket, or ``None`` once it is gone;
  ``started`` tells whether any byte was committed to the client; ``may_wait`` whether
  :meth:`start_stream` can wait for a slow client (one that cannot also offers
  ``start_stream_now`` and ``end_stream_now``, the same calls without ``await``, which
  the relay makes from inside the backend connection's read callback, or to end a
  stream without a coroutine).

All writers raise :class:`ClientGone` when the client's connection is gone.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import aiohttp
from aiohttp import web


class ClientGone(Exception):
    """The client closed its connection while the response was being written."""


class WriteSide(Protocol):
    """What the SSE relay uses of a transport: a socket's, or :class:`_BodySink`."""

    def write(self, data: bytes) -> None: ...

    def is_closing(self) -> bool: ...

    def get_write_buffer_size(self) -> int: ...


class Downstream(Protocol):
    """What the pipeline writes an answer to (see the module doc)."""

    started: bool
    chunked: bool
    may_wait: bool
    keepalive: bool

    @property
    def transport(self) -> WriteSide | None: ...

    def respond(self, status: int, body: bytes, headers: dict[str, str]) -> None: ...

    async def start_stream(self, headers: dict[str, str], first: bytes, end: bool = False) -> None: ...

    def start_stream_now(self, headers: dict[str, str], first: bytes, end: bool = False) -> None: ...

    async def write(self, data: bytes) -> None: ...

    async def end_stream(self, last: bytes = b"") -> None: ...

    def end_stream_now(self, last: bytes = b"") -> None: ...


_WRITE_ERRORS = (ConnectionError, aiohttp.ClientConnectionResetError)


class AiohttpDownstream:
    """Writes through aiohttp's response objects; ``response`` is what the handler returns.
    An HTTP/1.0 client gets its stream unframed, ended by closing the connection."""

    __slots__ = ("request", "response", "started", "chunked")
    may_wait = True  # start_stream may wait for a slow client (aiohttp's drain)
    keepalive = True

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None
        self.started = False
        self.chunked = request.version >= (1, 1)

    @property
    def transport(self) -> asyncio.Transport | None:
        return self.request.transport

    def respond(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.response = web.Response(status=status, body=body, headers=headers)

    def start_stream_now(self, headers: dict[str, str], first: bytes, end: bool = False) -> None:
        raise NotImplementedError("aiohttp's response is started with `await start_stream`")  # may_wait

    def end_stream_now(self, last: bytes = b"") -> None:
        raise NotImplementedError("aiohttp's response is ended with `await end_stream`")  # may_wait

    async def start_stream(self, headers: dict[str, str], first: bytes, end: bool = False) -> None:
        if self.started:  # the head went out already (a keep-alive commit): the body goes on
            await (self.end_stream(first) if end else self.write(first))
            return
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


class _BodySink:
    """The write side of a transport, appending to a :class:`CollectDownstream`'s body."""

    __slots__ = ("down",)

    def __init__(self, down: CollectDownstream) -> None:
        self.down = down

    def write(self, data: bytes) -> None:
        self.down.body += data

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0


class CollectDownstream:
    """Keeps the answer in memory (status, headers, body) for an in-process caller;
    the relay's writes to its ``transport`` append to ``body``."""

    __slots__ = ("status", "headers", "body", "started", "transport")
    chunked = False
    may_wait = False
    keepalive = False

    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = b""
        self.started = False
        self.transport = _BodySink(self)

    def respond(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.status, self.body, self.headers = status, body, dict(headers)

    def start_stream_now(self, headers: dict[str, str], first: bytes, end: bool = False) -> None:
        if self.started:  # the head went out already: the body goes on
            self.body += first
            return
        self.status, self.headers, self.body, self.started = 200, dict(headers), first, True

    async def start_stream(self, headers: dict[str, str], first: bytes, end: bool = False) -> None:
        self.start_stream_now(headers, first, end)

    async def write(self, data: bytes) -> None:
        self.body += data

    async def end_stream(self, last: bytes = b"") -> None:
        self.end_stream_now(last)

    def end_stream_now(self, last: bytes = b"") -> None:
        self.body += last
