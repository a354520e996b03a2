"""The lean HTTP/1.1 protocol of the listening socket: completion requests served
without aiohttp's server (see :mod:`gateway.server.listener` for what it serves and what it
hands over). A request it serves goes to :func:`gateway.pipeline.director.handle`, the
front door the aiohttp routes use too; its answer goes to a
:class:`~gateway.server.lean_downstream.LeanDownstream`, and a compressed body is decoded
by :mod:`gateway.server.content_coding`.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, cast

from multidict import CIMultiDict

from gateway.apis.base import Api
from gateway.apis.registry import CHAT, COMPLETIONS
from gateway.errors import ClientError
from gateway.eventloop import eager_tasks
from gateway.eventloop.batched_writes import Sends
from gateway.ops import access_log
from gateway.pipeline import director
from gateway.pipeline.downstream import ClientGone
from gateway.request_ids import request_id
from gateway.server.content_coding import decode_body
from gateway.server.lean_downstream import LeanDownstream

if TYPE_CHECKING:
    from gateway.runtime import GatewayState
    from gateway.tenancy.keys import Caller

_HOT = {CHAT.path: CHAT, COMPLETIONS.path: COMPLETIONS}  # the APIs it serves; any other goes to aiohttp
_PREFIXES = (b"POST /v1/chat/completions HTTP/1.1\r\n", b"POST /v1/completions HTTP/1.1\r\n")
# the header fields after the request line: each a token (RFC 9110, 5.6.2), a colon and
# a value, CRLF between them (control characters, bare CR and LF are refused before, so
# ``.`` stops at the line's end: one CR, then LF)
_FIELDS = re.compile(r"(?:[!#$%&'*+\-.^_`|~0-9A-Za-z]+:.*(?:\r\n|\Z))*")
_MAX_HEAD_BYTES = 16 * 1024  # a longer head goes to aiohttp, which applies its own limits
# what aiohttp's parser refuses with a 400 is handed to it: its limits (max_field_size,
# max_headers), its singleton headers, field values with control characters
# (RFC 9110 5.5), a missing Host (RFC 9112 3.2)
_MAX_LINE_BYTES = 8190
_MAX_HEADERS = 128
_SINGLETONS = {"authorization", "content-length", "content-location", "content-range", "content-type",
               "etag", "host", "max-forwards", "server", "transfer-encoding", "user-agent"}
_CONTROL = bytes([*range(9), *range(10, 32), 127])  # all but TAB (CR and LF are allowed as pairs)
_STREAM_TRUE = re.compile(rb'"stream"\s*:\s*true')  # starts with a literal: re scans for it at C speed
_MAX_BUFFERED_BYTES = 1 << 20  # bytes read ahead (pipelined) before reading pauses
# headers whose requests aiohttp serves: codings and protocol switches it implements, and a
# key in ``x-api-key`` (the lean protocol reads only ``Authorization``)
_HANDED_OVER = {"transfer-encoding", "expect", "upgrade", "x-api-key"}
# request body codings decoded here (zlib); others (br, several codings) go to aiohttp
_CODINGS = {"identity", "gzip", "x-gzip", "deflate"}
# the header fields whose values the head's pass reads or refuses (any other is only kept)
_LENGTH, _AUTHORIZATION, _HANDED, _CODING, _CONNECTION = range(5)
_FIELD_ROLES = {"content-length": _LENGTH, "authorization": _AUTHORIZATION, "content-encoding": _CODING,
                "connection": _CONNECTION, **dict.fromkeys(_HANDED_OVER, _HANDED)}
class DataPlaneHost(Protocol):
    """What a :class:`DataPlaneProtocol` needs of the server that accepted its connection
    (:class:`gateway.server.listener.DataPlaneServer`), named here so that this module
    does not import the listener back."""

    conns: set[DataPlaneProtocol]  # the open connections, closed at shutdown
    closing: bool  # shutting down: finish the request at hand, then close
    aiohttp_server: Any  # makes the aiohttp protocol for a connection handed over
    gateway: GatewayState  # the app's state
    lean: bool  # False: every connection goes to aiohttp at once
    head_timeout_s: float  # listen.head_timeout_s
    body_timeout_s: float  # listen.body_timeout_s
    body_min_bytes_per_s: int  # listen.body_min_bytes_per_s
    keepalive_timeout_s: float  # listen.keepalive_timeout_s

    @property
    def state(self) -> GatewayState: ...

    def max_body_bytes(self) -> int: ...

    def admit(self, conn: DataPlaneProtocol) -> bool: ...  # a new connection, within the caps?

    def release(self, conn: DataPlaneProtocol) -> None: ...  # a connection closed


class DataPlaneProtocol(asyncio.Protocol):
    """One client connection (see the module doc)."""

    def __init__(self, server: DataPlaneHost) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.task: asyncio.Task | None = None
        self.keep_alive = True
        self.paused = False
        self.idle_timer: asyncio.TimerHandle | None = None
        self.due = 0.0  # loop time by which the connection must have a request in flight, else it is closed
        self.write_paused = False
        self.caller: Caller | None = None  # who sent the request whose head is buffered, once its key was checked
        self.addr = ""  # the client's IP address
        self.handed: Any = None  # the aiohttp protocol serving the connection, once handed over

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream protocol gets a Transport
        peer = transport.get_extra_info("peername")
        self.addr = peer[0] if isinstance(peer, tuple) else ""
        if not self.server.admit(self):  # over the connection caps, with none to give way
            self.transport = None
            transport.close()
            return
        self.server.conns.add(self)
        self._arm(self.server.head_timeout_s)
        if not self.server.lean:
            self._hand_over()

    def _arm(self, within_s: float) -> None:
        """Close the connection unless a request is in flight ``within_s`` from now:
        the deadline of a head (``listen.head_timeout_s``), a body (``body_timeout_s``
        and ``body_min_bytes_per_s``) or an idle keep-alive (``keepalive_timeout_s``).
        One timer per connection, re-armed lazily when it fires: moving the deadline is
        one assignment."""
        loop = self.loop
        self.due = loop.time() + within_s
        if self.idle_timer is None:
            self.idle_timer = loop.call_at(self.due, self._idle_check)

    def _idle_check(self) -> None:
        self.idle_timer = None
        if self.transport is None:
            return
        if self.task is not None:  # busy: look again a full period after it is idle again
            self.idle_timer = self.loop.call_later(self.server.keepalive_timeout_s, self._idle_check)
            return
        if self.loop.time() >= self.due:
            self.transport.close()
        else:
            self.idle_timer = self.loop.call_at(self.due, self._idle_check)

    def busy(self) -> bool:
        """Whether a request is being served on the connection (on either stack): its
        head and body arrived. A connection still sending its head or body is not."""
        if self.handed is not None:
            handler = self.handed.handler
            req = handler._current_request if handler._request_in_progress else None
            return req is not None and req.content.is_eof()
        return self.task is not None

    def close(self) -> None:
        """Close the connection now (given way to a newer one at the connection caps)."""
        t = self.transport if self.handed is None else self.handed.transport
        if t is not None:
            t.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.server.conns.discard(self)
        self.server.release(self)
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        if self.task is not None:
            self.task.cancel()  # the client left: stop the request (and the backend's generation)

    def pause_writing(self) -> None:
        self.write_paused = True  # the client reads slower than we answer: start no new request

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.task is None and self.transport is not None:
            self._next()

    def data_received(self, data: bytes) -> None:
        if self.task is None:
            if not self.buf:  # a request's first bytes: its head is due within listen.head_timeout_s
                self.due = self.loop.time() + self.server.head_timeout_s
            self.buf += data
            self._next()
            return
        self.buf += data
        if len(self.buf) > _MAX_BUFFERED_BYTES and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    # eof_received: the default (close) as aiohttp does: a client that shuts its side
    # down mid-request has gone, and its request is cancelled in connection_lost

    def _next(self) -> None:
        """Start the next buffered request, wait for more bytes, or hand over. One pass
        over the head, in one function: each check decides between serving here and
        handing the connection to aiohttp, in the order the bytes are read."""
        buf = self.buf
        if not buf or self.transport is None or self.server.closing or self.write_paused:
            if buf and self.write_paused and len(buf) > _MAX_BUFFERED_BYTES and not self.paused and self.transport:
                self.paused = True
                self.transport.pause_reading()
            return
        n = len(buf)
        if not buf.startswith(_PREFIXES):
            if any(p.startswith(bytes(buf)) for p in _PREFIXES):
                return  # the request line is still arriving
            return self._hand_over()
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if n > _MAX_HEAD_BYTES:
                self._hand_over()
            return
        if end > _MAX_HEAD_BYTES:
            return self._hand_over()
        head = bytes(buf[:end])
        # control characters, a bare CR or LF: aiohttp's 400 (each CRLF holds one CR and one LF)
        if len(head.translate(None, _CONTROL)) != len(head) - 2 * head.count(b"\r\n"):
            return self._hand_over()
        text = head.decode("latin-1")  # one decode; header names and values are latin-1 strings from here
        lines = text.split("\r\n")
        if len(lines) > _MAX_HEADERS + 1 or _FIELDS.fullmatch(text, len(lines[0]) + 2) is None or \
                max(map(len, lines)) > _MAX_LINE_BYTES:  # also obs-fold, "Name :"
            return self._hand_over()
        path = lines[0].split(" ", 2)[1]
        pairs: list[tuple[str, str]] = []
        names: list[str] = []  # lower case
        length = -1
        keep_alive = True
        coding = "identity"
        authorization = None
        for line in lines[1:]:
            name, _, value = line.partition(":")
            lname = name.lower()
            value = value.strip(" \t")
            names.append(lname)
            pairs.append((name, value))
            field = _FIELD_ROLES.get(lname)
            if field is None:
                continue
            if field == _LENGTH:
                # more than 18 digits: aiohttp answers it (int() refuses over 4,300 digits)
                if not value.isdigit() or not value.isascii() or len(value) > 18:
                    return self._hand_over()
                length = int(value)
            elif field == _AUTHORIZATION:
                authorization = value
            elif field == _HANDED:
                return self._hand_over()
            elif field == _CODING:
                coding = value.lower()
                if coding not in _CODINGS:
                    return self._hand_over()
            else:  # connection
                v = value.lower()
                if "upgrade" in v:
                    return self._hand_over()
                if "close" in v:
                    keep_alive = False
        if length < 0 or length > self.server.max_body_bytes() or "host" not in names:
            return self._hand_over()
        if len(set(names)) != len(names) and not _SINGLETONS.isdisjoint([n for n in names if names.count(n) > 1]):
            return self._hand_over()  # a field that may appear once, repeated
        caller = self.caller  # the key is checked on the head, once, before any of the body is waited for
        if caller is None:
            keyring = self.server.gateway.keyring
            try:
                caller = self.caller = keyring.authenticate_value(authorization) if keyring.by_digest \
                    else keyring.anonymous
            except ClientError as e:
                return self._refuse(e, pairs, _HOT[path].name)
            if n < end + 4 + length:  # the body is due at listen.body_min_bytes_per_s, after a grace
                server = self.server
                self.due = self.loop.time() + server.body_timeout_s + length / server.body_min_bytes_per_s
        need = end + 4 + length
        if n < need:
            return
        body = bytes(buf[end + 4:need])
        del buf[:need]
        self.caller = None
        self.keep_alive = keep_alive
        loop = self.loop
        serve = self._serve(_HOT[path], CIMultiDict(pairs), body, coding, caller)
        if _STREAM_TRUE.search(body) is not None:
            # a stream's first step (parse, route, send upstream) runs now, in this read's
            # callback, not after every other callback of this loop turn (gateway/eventloop/eager_tasks.py):
            # its TTFT is what the client waits on. An eager start costs one task step
            # more, so a whole response starts as a plain task. The test is on the raw
            # bytes, before parsing (a compressed body is never eager); a false match
            # costs only the eager start it did not need.
            self.task, run_first_step = eager_tasks.create(loop, serve)
            run_first_step()
        else:
            self.task = loop.create_task(serve)

    def _refuse(self, err: ClientError, pairs: list[tuple[str, str]], endpoint: str) -> None:
        """Answer a request refused on its head (``err``: no valid key) and close the
        connection: its body is never read, nor kept."""
        self.buf.clear()
        self.keep_alive = False
        down = LeanDownstream(self, request_id(CIMultiDict(pairs)))
        down.respond(*err.answer(down.request_id))
        access_log.refused(down.request_id, endpoint, err.status, err.code)
        t = self.transport
        assert t is not None
        Sends.of(self.loop).close(t)  # after the answer, queued for this turn
        self.transport = None  # bytes that still arrive are not looked at
        self.server.conns.discard(self)
        self.server.release(self)

    def _hand_over(self) -> None:
        """Give the connection, with the bytes read so far, to aiohttp."""
        transport = self.transport
        assert transport is not None
        Sends.of(self.loop).flush()  # our queued answers on it go out before aiohttp's
        handler = self.server.aiohttp_server()
        self.server.conns.discard(self)
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        self.transport = None
        data = bytes(self.buf)
        self.buf.clear()
        self.handed = watched = HandedOver(self, handler, transport, self.due if data else None)
        transport.set_protocol(watched)
        handler.connection_made(transport)
        if self.paused:
            transport.resume_reading()
        if data:
            handler.data_received(data)

    async def _serve(self, api: Api, headers: CIMultiDict, body: bytes, coding: str = "identity",
                     caller: Caller | None = None) -> None:
        server = self.server
        rid = request_id(headers)
        down = LeanDownstream(self, rid)
        arrival = self.loop.time()
        payload: bytes | Callable[[], Awaitable[bytes]] = body
        if coding != "identity":
            raw, limit = body, server.max_body_bytes()

            async def decoded() -> bytes:
                return decode_body(raw, coding, limit)
            payload = decoded
        try:
            await director.handle(server.gateway, api, headers, payload, down, arrival, rid, caller=caller)
        except (asyncio.CancelledError, ClientGone):
            down.finished = False  # the client left: close
        finally:
            self.task = None
            self._after(down)

    def _after(self, down: LeanDownstream) -> None:
        t = self.transport
        if t is None:
            return
        if not down.finished or not self.keep_alive or self.server.closing:
            Sends.of(self.loop).close(t)  # after the response queued for this turn
            return
        if self.paused:
            self.paused = False
            t.resume_reading()
        self._arm(self.server.keepalive_timeout_s)
        self._next()


class HandedOver(asyncio.Protocol):
    """A connection handed to aiohttp: its ``RequestHandler`` (``handler``) serves it,
    and this protocol, between the transport and the handler, keeps the time a head
    started arriving while no request was in flight (``head_due``), which
    :meth:`gateway.server.listener.DataPlaneServer.sweep` holds to
    ``listen.head_timeout_s``; aiohttp keeps its own idle timeout
    (``listen.keepalive_timeout_s``)."""

    __slots__ = ("body_due", "count", "handler", "head_due", "owner", "transport")

    def __init__(self, owner: DataPlaneProtocol, handler: Any, transport: asyncio.Transport,
                 head_due: float | None) -> None:
        self.owner = owner
        self.handler = handler
        self.transport: asyncio.Transport | None = transport
        self.head_due = head_due  # loop time by which the head that is arriving must be whole
        self.count = 0  # the handler's requests seen started
        self.body_due: float | None = None  # loop time by which the in-flight request's body must be whole

    def data_received(self, data: bytes) -> None:
        if self.head_due is None and not self.handler._request_in_progress:
            self.head_due = self.owner.loop.time() + self.owner.server.head_timeout_s
        self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received()

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.handler.connection_lost(exc)
        self.owner.server.release(self.owner)
