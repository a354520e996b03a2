"""Where the answer to one request of the lean protocol's connection goes:
:class:`LeanDownstream` (the :class:`gateway.pipeline.downstream.Downstream` interface),
and :func:`response_head`, the HTTP/1.1 response head it writes."""

from __future__ import annotations

import asyncio
import time
from email.utils import formatdate
from http import HTTPStatus
from typing import Protocol

from gateway.errors import REQUEST_ID_HEADER
from gateway.eventloop.batched_writes import Sends
from gateway.pipeline.downstream import ClientGone


class Connection(Protocol):
    """What a :class:`LeanDownstream` needs of its connection
    (:class:`gateway.server.fast_path.DataPlaneProtocol`)."""

    transport: asyncio.Transport | None
    keep_alive: bool
    loop: asyncio.AbstractEventLoop


_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


class _Date:
    """The ``Date`` header value, formatted at most once a second."""

    second = -1
    value = b""

    @classmethod
    def get(cls) -> bytes:
        now = int(time.time())
        if now != cls.second:
            cls.second, cls.value = now, formatdate(now, usegmt=True).encode()
        return cls.value


def response_head(status: int, headers: dict[str, str], tail: bytes) -> bytes:
    """The response head; CR, LF and NUL are dropped from header values (no injected lines)."""
    block = "".join([f"{k}: {v}\r\n" for k, v in headers.items()]).encode("latin-1", "replace")
    n = len(headers)
    if block.count(b"\r") != n or block.count(b"\n") != n or b"\x00" in block:
        block = b"".join([b"%s: %s\r\n" % (k.encode("latin-1"),
                                              v.encode("latin-1", "replace").translate(None, b"\r\n\x00"))
                          for k, v in headers.items()])
    return b"HTTP/1.1 %d %s\r\n%sDate: %s\r\nServer: turbo-gateway\r\n%s\r\n" % (
        status, _REASONS.get(status, b"Unknown"), block, _Date.get(), tail)


class LeanDownstream:
    """Answers one request of a :class:`DataPlaneProtocol` connection (the interface:
    :class:`gateway.pipeline.downstream.Downstream`)."""

    __slots__ = ("proto", "request_id", "started", "finished")
    chunked = True
    may_wait = False
    keepalive = True

    def __init__(self, proto: Connection, request_id: str) -> None:
        self.proto = proto
        self.request_id = request_id
        self.started = False
        self.finished = False

    @property
    def transport(self) -> asyncio.Transport | None:
        return self.proto.transport

    def _write(self, data: bytes) -> None:
        t = self.proto.transport
        if t is None or t.is_closing():
            raise ClientGone()
        t.write(data)

    def respond(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        if self.finished:
            return
        headers.setdefault(REQUEST_ID_HEADER, self.request_id)
        tail = b"Content-Length: %d\r\n" % len(body)
        if not self.proto.keep_alive:
            tail += b"Connection: close\r\n"
        self.started = self.finished = True
        t = self.proto.transport
        # a whole response: sent with this turn's others (gateway/eventloop/batched_writes.py)
        if t is not None and not t.is_closing():
            Sends.of(self.proto.loop).send(t, response_head(status, headers, tail) + body)

    async def start_stream(self, headers: dict[str, str], first: bytes, end: bool = False) -> None:
        self.start_stream_now(headers, first, end)

    def start_stream_now(self, headers: dict[str, str], first: bytes, end: bool = False) -> None:
        if self.started:  # the head went out already (a keep-alive commit): the body goes on
            data = b""
        else:
            tail = b"Transfer-Encoding: chunked\r\n"
            if not self.proto.keep_alive:
                tail += b"Connection: close\r\n"
            self.started = True
            data = response_head(200, headers, tail)
        if end:
            self.finished = True
        if first:  # one copy of the (possibly large) first bytes, framed as a chunk
            data = b"%b%x\r\n%b\r\n%b" % (data, len(first), first, b"0\r\n\r\n" if end else b"")
        elif end:
            data += b"0\r\n\r\n"
        self._write(data)

    async def write(self, data: bytes) -> None:
        if data:
            self._write(b"%x\r\n%b\r\n" % (len(data), data))

    async def end_stream(self, last: bytes = b"") -> None:
        self.end_stream_now(last)

    def end_stream_now(self, last: bytes = b"") -> None:
        self.finished = True
        self._write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(last), last) if last else b"0\r\n\r\n")
