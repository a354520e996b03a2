"""The one upstream HTTP/1.1 client: every request to a backend on a request's path
(completions, the prefill leg of a disaggregated request, in-process batch lines)
goes through it. Pooled keep-alive connections per backend, responses parsed by llhttp
(``httptools``), body bytes handed to the caller as they arrive, inside the
connection's read callback, without a task switch per chunk (a streamed completion is
about one TCP segment per token).

Shapes: :meth:`UpstreamPool.request` sends one ``POST`` and returns an
:class:`Exchange` once the status line and headers arrived. Its body is then either
collected (:meth:`Exchange.read`, bytes) or relayed (:meth:`Exchange.relay`, each
read's body bytes passed to a callback). Failures are raised as the gateway's one
hierarchy (:mod:`gateway.errors`): :class:`~gateway.errors.ConnectFailed`,
:class:`~gateway.errors.ConnectTimeout`, :class:`~gateway.errors.Disconnected` (the
backend closed or broke the connection, or sent what llhttp rejects) and the error a
deadline was armed with (:meth:`Exchange.set_deadline`). Health checks and metric
scraping, which are not on a request's path, use aiohttp.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Callable
from urllib.parse import urlsplit

import httptools

from gateway.errors import ConnectFailed, ConnectTimeout, Disconnected, UpstreamError
from gateway.sends import PerLoop, Sends

TURN_S = 0.001  # longest run of relayed reads between two polls of the loop (see RelayTurns)
INLINE_PER_MS = 2  # relayed reads handled in their own callback per millisecond of loop time, before turns
# vLLM and SGLang serve with uvicorn, whose keep-alive timeout is 5 s by default: drop
# idle connections before the server does, so that a request rarely meets a closing one
IDLE_TTL_S = 4.0
MAX_IDLE_PER_BACKEND = 512


def header_value(value: str) -> bytes:
    """``value`` as a header value: latin-1, with CR, LF and NUL dropped."""
    return value.encode("latin-1", "replace").translate(None, b"\r\n\x00")


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
                 "_complete", "_keep_alive", "_wake_on_data", "last_data_at", "_error", "_timer", "_on_ready", "_finished")

    def __init__(self, conn: _Connection) -> None:
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
            conn.pool._put(conn)
        else:
            conn.close()


class _Connection(asyncio.Protocol):
    """One keep-alive TCP connection to a backend, one request at a time."""

    __slots__ = ("pool", "loop", "transport", "parser", "exchange", "_status", "_headers", "idle_since",
                 "served", "got_bytes", "closed", "informational", "in_trailers", "pending", "turns")

    def __init__(self, pool: UpstreamPool) -> None:
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
        self.transport = transport  # type: ignore[assignment]

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
        self._feed(pending[0] if len(pending) == 1 else b"".join(pending),
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
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
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
        self.pool._forget(self)
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
                ex._on_error(Disconnected(name, f"backend {name} closed the connection {when}", got_bytes=self.got_bytes))

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
            self.pool._forget(self)
            if self.transport is not None:
                self.transport.abort()


class RelayTurns(PerLoop):
    """The reads of relayed streams, parsed and relayed in turns of at most
    :data:`TURN_S` seconds, between which the loop polls again.

    Why: an engine's decode step emits one event per running sequence at once, so
    with hundreds of streams the gateway reads hundreds of events in one loop
    iteration. Relayed inside their read callbacks, they would make that iteration
    long, and a new request, or the head of one, arriving meanwhile would wait for
    all of them: added TTFT. So, past :data:`INLINE_PER_MS` relayed reads in a
    millisecond of the loop's clock, a read callback of a relayed stream only queues
    the bytes; requests, heads and first tokens are still handled in their read
    callbacks; and the queued reads are relayed in FIFO turns. (A preemptive router
    gets the same effect from its threads.) Under that rate, with few streams, reads
    are relayed in their callbacks: a turn costs one more loop iteration per read.
    The measurements behind both numbers are in loadtest/README.md.

    Per connection the order of bytes is kept (a connection's reads are relayed in
    one turn, before any later read of it, and before its close is handled). The
    relay's writes to clients happen inside the turn, back to back, and count
    against its time."""

    __slots__ = ("conns", "scheduled", "inline_at", "inline_left")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.conns: deque[_Connection] = deque()
        self.scheduled = False
        self.inline_at = -1.0  # the loop time (ms resolution on uvloop) the allowance below is for
        self.inline_left = 0

    def add(self, conn: _Connection) -> None:
        self.conns.append(conn)
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_soon(self.run)

    def run(self) -> None:
        self.scheduled = False
        conns = self.conns
        end = time.perf_counter() + TURN_S
        try:
            while conns:
                conns.popleft().run_pending()
                if time.perf_counter() >= end:
                    break
        finally:
            if conns and not self.scheduled:
                self.scheduled = True
                self.loop.call_soon(self.run)  # after the loop polled again


class UpstreamPool:
    """Keep-alive connections to one backend, reused LIFO (the warmest first).

    ``base_url`` is ``http://host:port[/prefix]`` or ``https://…``; ``connect_s`` bounds
    the TCP/TLS connect (seconds, ``None`` for no bound); ``name`` is the backend's,
    for the errors raised.
    """

    def __init__(self, base_url: str, connect_s: float | None, loop: asyncio.AbstractEventLoop | None = None,
                 name: str = "") -> None:
        u = urlsplit(base_url)
        self.name = name or base_url
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"backend URL must be http:// or https:// with a host, not {base_url!r}")
        self.loop = loop or asyncio.get_running_loop()
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if u.scheme == "https" else None
        self.prefix = u.path.rstrip("/")
        netloc = self.host if u.port is None else f"{self.host}:{u.port}"
        if ":" in self.host and not self.host.startswith("["):
            netloc = f"[{self.host}]" + (f":{u.port}" if u.port is not None else "")
        self.host_header = netloc.encode("ascii", "ignore")
        self.connect_s = connect_s
        self._idle: list[_Connection] = []
        self._all: set[_Connection] = set()
        self.closed = False
        self._warming: asyncio.Task | None = None  # the spare connection being made (see _take_idle)

    def _put(self, conn: _Connection) -> None:
        if self.closed or conn.closed or len(self._idle) >= MAX_IDLE_PER_BACKEND:
            conn.close()
            return
        conn.idle_since = self.loop.time()
        self._idle.append(conn)

    def _forget(self, conn: _Connection) -> None:
        self._all.discard(conn)
        try:
            self._idle.remove(conn)
        except ValueError:
            pass

    async def _connect(self) -> _Connection:
        try:
            async with asyncio.timeout(self.connect_s):
                _, conn = await self.loop.create_connection(lambda: _Connection(self), self.host, self.port,
                                                            ssl=self.ssl)
        except TimeoutError as e:
            raise ConnectTimeout(self.name, f"connecting to backend {self.name} timed out after "
                                            f"{self.connect_s} s") from e
        except OSError as e:
            raise ConnectFailed(self.name, f"could not connect to backend {self.name}: {e.strerror or e}") from e
        self._all.add(conn)
        return conn

    def _take_idle(self) -> _Connection | None:
        """The warmest idle connection, or ``None``. Taking the last one starts a spare
        connection in the background (at most one at a time), so that the next
        request finds one ready instead of connecting in its TTFT: Envoy's
        ``preconnect_policy`` in its simplest form (without it, a load that shifts
        between backends connects on the critical path)."""
        now = self.loop.time()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and now - conn.idle_since < IDLE_TTL_S:
                if not self._idle and self._warming is None and not self.closed:
                    self._warming = self.loop.create_task(self._warm())
                return conn
            conn.close()
        return None

    async def _warm(self) -> None:
        try:
            conn = await self._connect()
        except (UpstreamError, OSError):
            return  # the backend's trouble shows on the requests' own connects
        finally:
            self._warming = None
        self._put(conn)  # closed (a retired or closed pool) or kept idle

    async def request(self, path: str, headers: bytes, body: bytes, deadline: float | None = None,
                      on_ready: Callable[[Exchange], None] | None = None, batched: bool = False,
                      deadline_error: Callable[[], UpstreamError] | None = None) -> Exchange:
        """Send ``POST prefix+path`` with the extra header lines ``headers`` (CRLF
        terminated, no Host/Content-Length) and ``body``; return the exchange once the
        status line and headers arrived.

        A reused connection that the backend closed before answering a single byte is
        retried once on a new connection (the backend never saw the request).
        ``deadline`` (loop time, or ``None``) bounds the connect and every wait of the
        returned exchange until :meth:`Exchange.clear_deadline` or :meth:`Exchange.finish`:
        past it they raise ``deadline_error()`` (``TimeoutError`` when ``None``) and the
        connection is dropped.
        ``on_ready(exchange)``, when given, is called at most once, inside the
        connection's read callback, if the status line, the headers and body bytes
        (or the whole response) arrive in one read before this coroutine resumed:
        the caller can answer its client there, a loop turn earlier (it must not
        raise and must not block). It is never called once this method returned.
        ``batched``: the request is sent with this loop turn's other non-urgent sends
        (:mod:`gateway.sends`), not at once; for requests whose latency is not a TTFT.
        Raises :class:`~gateway.errors.ConnectFailed`, :class:`~gateway.errors.ConnectTimeout`,
        :class:`~gateway.errors.Disconnected` and ``deadline_error()``.
        """
        head = b"POST %s%s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n%s\r\n" % (
            self.prefix.encode(), path.encode(), self.host_header, len(body), headers)
        for first in (True, False):
            conn = self._take_idle() if first else None
            reused = conn is not None
            if conn is None:
                if deadline is None:
                    conn = await self._connect()
                else:
                    try:
                        async with asyncio.timeout_at(deadline):
                            conn = await self._connect()
                    except TimeoutError:
                        if deadline_error is None:
                            raise
                        raise deadline_error() from None
            ex = Exchange(conn)
            ex._on_ready = on_ready
            ex.set_deadline(deadline, deadline_error)
            conn.exchange = ex
            conn.got_bytes = False
            conn.served += 1
            assert conn.transport is not None
            if batched:
                Sends.of(self.loop).send(conn.transport, head + body)
            else:
                conn.transport.write(head + body)
            try:
                await ex._head
                ex._on_ready = None
            except Disconnected as e:
                ex.clear_deadline()
                conn.exchange = None
                conn.close()
                if first and reused and not e.got_bytes:
                    continue
                raise
            except BaseException:
                ex.clear_deadline()
                conn.exchange = None
                conn.close()
                raise
            return ex
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Close every connection, idle or busy (a busy one's exchange fails)."""
        self.closed = True
        if self._warming is not None:
            self._warming.cancel()
        for conn in list(self._all):
            conn.close()
        self._idle.clear()

    def retire(self) -> None:
        """Take no new requests: idle connections close now, busy ones when their
        response is done (a reload replaced or removed this backend)."""
        self.closed = True
        for conn in list(self._idle):
            conn.close()
        self._idle.clear()

    @property
    def busy(self) -> bool:
        """Some connection is carrying a request."""
        return len(self._all) > len(self._idle)

    @property
    def idle(self) -> int:
        """Idle pooled connections (for tests and metrics)."""
        return len(self._idle)


class BackendClient:
    """How to reach one backend: its state in the decision core, base URL, timeouts,
    the ``Authorization`` header sent to it (the caller's own key never is), the
    keep-alive :class:`UpstreamPool` of every request on a request's path, and an
    aiohttp ``session`` for the health checks and metric scraping. Made inside the
    running loop."""

    __slots__ = ("state", "base_url", "session", "timeouts", "auth_header", "pool", "auth_line")

    def __init__(self, state, base_url: str, session, timeouts, auth_header: str | None = None) -> None:
        self.state = state
        self.base_url = base_url
        self.session = session
        self.timeouts = timeouts
        self.auth_header = auth_header
        self.pool = UpstreamPool(base_url, timeouts.connect_s, name=state.name)
        self.auth_line = b"Authorization: %s\r\n" % header_value(auth_header) if auth_header else b""
