"""One request and its response on one pooled keep-alive connection to a backend: the
HTTP/1.1 client protocol (responses parsed by llhttp through ``httptools``), whose
relayed reads wait for their turn in :mod:`gateway.upstream.relay_turns`.
:mod:`gateway.upstream.client` owns the connections (a :class:`ConnectionOwner` to
them); callers see an :class:`Exchange`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol, cast

import httptools

from gateway.errors import Disconnected, UpstreamError
from gateway.upstream.relay_turns import INLINE_PER_MS, RelayTurns


def _fail(fut: asyncio.Future | None, exc: BaseException) -> None:
    if fut is not None and not fut.done():
        fut.set_exception(exc)
        fut.exception()  # retrieved: an exchange nobody waits on any more logs nothing


class Exchange:
    """One request/response on one pooled connection.

    After :meth:`UpstreamPool.request` returns, ``status`` (int) and ``headers``
    (lower-case name to value, ``str``) are set. The body goes to :meth:`read`, or to
    :meth:`wait_first_body` then :meth:`relay`; the owner then calls :meth:`finish`
    once, which puts a clean keep-alive connection back into the pool and closes any
    other.
    """

    __slots__ = ("conn", "status", "headers", "_head", "_waiter", "_chunks", "_size", "_limit", "_sink",
                 "_complete", "_keep_alive", "_wake_on_data", "last_data_at", "_error", "_timer", "_on_ready",
                 "_finished")

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.status = 0
        self.headers: dict[str, str] = {}
        self._head: asyncio.Future[None] = conn.loop.create_future()
        self._waiter: asyncio.Future[None] | None = None
        self._chunks: list[bytes] = []
        self._size = 0
        self._limit = 1 << 62
        self._sink: Callable[[bytes], None] | None = None
        self._complete = False
        self._keep_alive = False
        self._wake_on_data = False
        self.last_data_at = 0.0  # loop time of the last body bytes
        self._error: BaseException | None = None  # the first failure, raised by every later wait
        self._timer: asyncio.TimerHandle | None = None
        self._on_ready: Callable[[Exchange], None] | None = None  # see UpstreamPool.request
        self._finished = False

    # ---- called by the connection (inside data_received) ------------------------

    def _on_head(self, status: int, headers: dict[str, str]) -> None:
        self.status, self.headers = status, headers
        if not self._head.done():
            self._head.set_result(None)

    def _on_complete(self, keep_alive: bool) -> None:
        self._complete, self._keep_alive = True, keep_alive

    def _on_error(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        _fail(self._head, self._error)
        _fail(self._waiter, self._error)

    def set_deadline(self, at: float | None, error: Callable[[], UpstreamError] | None = None) -> None:
        """Fail every wait of this exchange with ``error()`` at loop time ``at``
        (``None``: no deadline) and drop the connection; replaces an earlier deadline."""
        self.clear_deadline()
        if at is not None:
            self._timer = self.conn.loop.call_at(at, self._expire, error)

    def clear_deadline(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self, error: Callable[[], UpstreamError] | None) -> None:
        self._timer = None
        if not self._complete:
            self._on_error(error() if error is not None else TimeoutError())
            self.conn.exchange = None
            self.conn.close()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        self._waiter = self.conn.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    # ---- the owner's side ----------------------------------------------------------

    @property
    def complete(self) -> bool:
        """The whole response (headers and body) has arrived."""
        return self._complete

    async def wait_first_body(self) -> bytes:
        """Wait until some body bytes arrived (or the response completed) and take
        them: the first chunk(s) of a stream, ``b""`` for an empty body. Raises
        :class:`~gateway.errors.Disconnected` or the deadline's error."""
        if not self._chunks and not self._complete:
            self._wake_on_data = True
            await self._wait()
            self._wake_on_data = False
        data = b"".join(self._chunks)
        self._chunks.clear()
        return data

    async def read(self, limit: int | None = None) -> bytes:
        """The rest of the body, collected. With ``limit`` (bytes), at most that much
        is returned and the wait ends as soon as it arrived (the connection is then
        not reused). Raises :class:`~gateway.errors.Disconnected` if the connection
        breaks first, or the deadline's error."""
        if limit is not None:
            self._limit = limit
        while not self._complete and self._size < self._limit:
            await self._wait()
        data = b"".join(self._chunks)
        self._chunks.clear()
        return data[:limit] if limit is not None else data

    def relay(self, sink: Callable[[bytes], None]) -> asyncio.Future[None]:
        """From now on pass the body bytes of each socket read to ``sink`` as they
        arrive (inside the connection's ``data_received``: ``sink`` must not block and
        must not raise), except those of the read that completes the response: they
        wait for :meth:`take`. Returns a future that resolves when the response
        completes or fails with :class:`~gateway.errors.Disconnected`; :meth:`abort` fails it from
        the caller's side (a timeout, the client gone)."""
        self._sink = sink
        fut = self._waiter = self.conn.loop.create_future()
        if self._error is not None:  # the connection broke while the caller was busy
            _fail(fut, self._error)
        elif self._complete:
            fut.set_result(None)
        elif self._chunks:  # arrived while the caller was busy answering the client
            data = b"".join(self._chunks)
            self._chunks.clear()
            sink(data)
        return fut

    def take(self) -> bytes:
        """The body bytes received and not yet handed out: after :meth:`relay`'s
        future resolved, the response's last bytes (relayed by the owner together
        with the end of its own response)."""
        data = b"".join(self._chunks)
        self._chunks.clear()
        return data

    def pause_reading(self) -> None:
        """Stop reading from the backend (the client is slower than the stream)."""
        t = self.conn.transport
        if t is not None and not t.is_closing():
            t.pause_reading()

    def resume_reading(self) -> None:
        t = self.conn.transport
        if t is not None and not t.is_closing():
            t.resume_reading()

    def abort(self, exc: BaseException) -> None:
        """Fail the pending wait with ``exc`` and drop the connection."""
        _fail(self._waiter, exc)
        self.conn.exchange = None
        self.conn.close()

    def finish(self) -> None:
        """Hand the connection back: into the pool after a complete keep-alive
        response that was read whole, closed otherwise (the backend then sees the
        client go away and aborts the generation). Later calls do nothing."""
        if self._finished:
            return
        self._finished = True
        self.clear_deadline()
        conn = self.conn
        if conn.exchange is self:
            conn.exchange = None
        if self._complete and self._keep_alive and self._size <= self._limit:
            conn.pool.put_back(conn)
        else:
            conn.close()


class ConnectionOwner(Protocol):
    """What a :class:`Connection` needs of the pool that opened it
    (:class:`gateway.upstream.client.UpstreamPool`), named here so that this module does
    not import the client back."""

    name: str  # the backend's, for errors
    loop: asyncio.AbstractEventLoop

    def put_back(self, conn: Connection) -> None:
        """Keep ``conn`` for the next request (it finished a response and may be reused)."""

    def forget(self, conn: Connection) -> None:
        """Drop ``conn`` (it closed)."""


class Connection(asyncio.Protocol):
    """One keep-alive TCP connection to a backend, one request at a time."""

    __slots__ = ("pool", "loop", "transport", "parser", "exchange", "_status", "_headers", "idle_since",
                 "served", "got_bytes", "closed", "informational", "in_trailers", "pending", "turns")

    def __init__(self, pool: ConnectionOwner) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.exchange: Exchange | None = None
        self._headers: dict[str, str] = {}
        self.idle_since = 0.0
        self.served = 0
        self.got_bytes = False
        self.closed = False
        self.informational = False
        self.in_trailers = False
        self.pending: list[bytes] | None = None  # a relayed stream's reads waiting for their turn
        self.turns = RelayTurns.of(self.loop)

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream protocol gets a Transport

    def data_received(self, data: bytes) -> None:
        ex = self.exchange
        now = self.loop.time()
        if ex is not None and ex._sink is not None and not ex._complete:  # a relayed stream
            ex.last_data_at = now
            pending = self.pending
            if pending is not None:  # earlier reads still wait: this one after them
                pending.append(data)
                return
            turns = self.turns
            if turns.inline_at != now:  # another millisecond of the loop's clock: a new allowance
                turns.inline_at, turns.inline_left = now, INLINE_PER_MS
            if turns.inline_left <= 0:  # busy: wait for a turn
                self.pending = [data]
                turns.add(self)
                return
            turns.inline_left -= 1
        self._feed(data, now)

    def run_pending(self) -> None:
        """Parse and relay the reads that waited for this connection's turn."""
        pending, self.pending = self.pending, None
        if pending is None or self.closed:
            return
        ex = self.exchange
        self._feed(b"".join(pending),
                   ex.last_data_at if ex is not None else self.loop.time())

    def _feed(self, data: bytes, at: float) -> None:
        """Parse ``data``, read at loop time ``at``, and pass its body bytes on."""
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(Disconnected(self.pool.name, f"backend {self.pool.name} sent invalid HTTP: {e}"))
            return
        ex = self.exchange
        if ex is None:
            return
        if ex._on_ready is not None and ex.status and (ex._chunks or ex._complete):
            on_ready, ex._on_ready = ex._on_ready, None
            on_ready(ex)  # the status, headers and first body bytes arrived before the owner resumed
        # hand this read's body bytes to the relay sink as one chunk (the response's last
        # bytes stay for Exchange.take), or wake the waiting owner
        chunks = ex._chunks
        if chunks:
            ex.last_data_at = at
            sink = ex._sink
            if sink is not None and not ex._complete:
                data = b"".join(chunks)  # one chunk: that chunk itself, not a copy
                chunks.clear()
                sink(data)
                return
        if ex._complete or ex._size >= ex._limit or (ex._wake_on_data and chunks):
            ex._wake()

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if self.pending is not None:  # the reads before the close come first
            self.run_pending()
        self.closed = True
        self.transport = None
        self.pool.forget(self)
        ex = self.exchange
        if ex is not None and not ex.complete:
            h = ex.headers
            if exc is None and ex.status and "content-length" not in h and \
                    "chunked" not in h.get("transfer-encoding", "").lower():
                ex._on_complete(False)  # a body delimited by the close (RFC 9112 6.3): this is its end
                ex._wake()
            else:
                name = self.pool.name
                when = "mid-response" if ex._size else "before the first body byte" if ex.status else "before answering"
                ex._on_error(Disconnected(name, f"backend {name} closed the connection {when}",
                                          got_bytes=self.got_bytes))

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._headers = {}
        self.in_trailers = False

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.in_trailers:  # trailer fields never override the header section (RFC 9110 6.5.1)
            self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.in_trailers = True
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # informational (100 Continue, 103 Early Hints): the answer follows
            self.informational = True
            return
        ex = self.exchange
        if ex is not None:
            ex._on_head(status, self._headers)

    def on_body(self, body: bytes) -> None:
        ex = self.exchange
        if ex is not None:
            if ex._size < ex._limit:
                ex._chunks.append(body)
            ex._size += len(body)

    def on_message_complete(self) -> None:
        if self.informational:
            self.informational = False
            return
        ex = self.exchange
        if ex is not None:
            ex._on_complete(self.parser.should_keep_alive())

    # ours
    def _fail(self, exc: BaseException) -> None:
        ex = self.exchange
        if ex is not None:
            ex._on_error(exc)
        self.close()

    def close(self) -> None:
        self.pending = None
        if not self.closed:
            self.closed = True
            self.pool.forget(self)
            if self.transport is not None:
                self.transport.abort()
