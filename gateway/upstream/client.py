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
import ipaddress
import socket
import ssl
from collections.abc import Callable
from urllib.parse import urlsplit

from gateway.errors import ConnectFailed, ConnectTimeout, Disconnected, UpstreamError
from gateway.eventloop.batched_writes import Sends
from gateway.upstream.connection import Connection, Exchange

__all__ = ["BackendClient", "Exchange", "UpstreamPool", "header_value"]

# vLLM and SGLang serve with uvicorn, whose keep-alive timeout is 5 s by default: drop
# idle connections before the server does, so that a request rarely meets a closing one
IDLE_TTL_S = 4.0
MAX_IDLE_PER_BACKEND = 512


def header_value(value: str) -> bytes:
    """``value`` as a header value: latin-1, with CR, LF and NUL dropped."""
    return value.encode("latin-1", "replace").translate(None, b"\r\n\x00")


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
        self._idle: list[Connection] = []
        self._all: set[Connection] = set()
        self.closed = False
        self._warming: asyncio.Task | None = None  # the spare connection being made (see _take_idle)

    def put_back(self, conn: Connection) -> None:
        if self.closed or conn.closed or len(self._idle) >= MAX_IDLE_PER_BACKEND:
            conn.close()
            return
        conn.idle_since = self.loop.time()
        self._idle.append(conn)

    def forget(self, conn: Connection) -> None:
        self._all.discard(conn)
        try:
            self._idle.remove(conn)
        except ValueError:
            pass

    async def _connect(self) -> Connection:
        try:
            async with asyncio.timeout(self.connect_s):
                _, conn = await self.loop.create_connection(lambda: Connection(self), self.host, self.port,
                                                            ssl=self.ssl)
        except TimeoutError as e:
            raise ConnectTimeout(self.name, f"connecting to backend {self.name} timed out after "
                                            f"{self.connect_s} s") from e
        except OSError as e:
            raise ConnectFailed(self.name, f"could not connect to backend {self.name}: {e.strerror or e}") from e
        self._all.add(conn)
        return conn

    def _take_idle(self) -> Connection | None:
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
        self.put_back(conn)  # closed (a retired or closed pool) or kept idle

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
        (:mod:`gateway.eventloop.batched_writes`), not at once; for requests whose latency is not a TTFT.
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


def endpoint_of(base_url: str) -> str:
    """The ``ip:port`` (``[ip6]:port``) of a backend's base URL, as a proxy in front
    names its destination (:mod:`gateway.epp.picker`); a host name is resolved once, since
    Envoy's override-host policy takes addresses."""
    u = urlsplit(base_url)
    host = u.hostname or ""
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        try:
            ip = ipaddress.ip_address(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0])
        except (OSError, IndexError, ValueError):
            return f"{host}:{port}"
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


class BackendClient:
    """How to reach one backend: its state in the decision core, base URL, timeouts,
    the ``Authorization`` header sent to it (the caller's own key never is), the
    keep-alive :class:`UpstreamPool` of every request on a request's path, and an
    aiohttp ``session`` for the health checks and metric scraping. Made inside the
    running loop."""

    __slots__ = ("state", "base_url", "session", "timeouts", "auth_header", "pool", "auth_line", "endpoint",
                 "return_token_ids")

    def __init__(self, state, base_url: str, session, timeouts, auth_header: str | None = None) -> None:
        self.state = state
        self.base_url = base_url
        self.session = session
        self.timeouts = timeouts
        self.auth_header = auth_header
        self.pool = UpstreamPool(base_url, timeouts.connect_s, name=state.name)
        self.auth_line = b"Authorization: %s\r\n" % header_value(auth_header) if auth_header else b""
        self.endpoint = endpoint_of(base_url)  # ip:port, as Envoy names it
        self.return_token_ids = False  # its engine streams token ids when asked (config `return_token_ids`)
