"""The listening socket: completion requests on a lean HTTP/1.1 protocol, every other
connection handed to the aiohttp app unchanged.

:class:`DataPlaneProtocol` serves the requests that make up the traffic, ``POST
/v1/chat/completions`` and ``POST /v1/completions`` over HTTP/1.1 with a
``Content-Length`` body (identity, gzip or deflate), itself: aiohttp's server builds
request and response objects and runs its middleware chain and router for each
request, which costs more CPU than the rest of a short completion's path in the
gateway. The moment a connection carries anything else (another path or method,
HTTP/1.0, chunked bodies, other content codings, ``Expect``, ``Upgrade``, obsolete
line folding, an oversized head or body, bytes that are not plain HTTP), the
connection, with every byte read so far, goes to aiohttp's ``RequestHandler``, which
answers exactly as it would have alone, with its own parser's checks and errors; the
connection stays with aiohttp afterwards.

Both stacks serve a completion through the same front door,
:func:`gateway.pipeline.director.handle` (authentication, body checks, the request id,
OpenAI error answers, limits, admission, routing), so the choice of stack changes no
behaviour. Turn the lean protocol off with ``listen.fast_path: false``.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
from typing import Any

from aiohttp import web

from gateway.eventloop import eager_tasks
from gateway.eventloop.batched_writes import Sends
from gateway.runtime import OWN_MIDDLEWARES, STATE, GatewayState
from gateway.server.fast_path import DataPlaneProtocol

log = logging.getLogger("gateway.server.listener")

_ACCEPT_BATCH = 512  # connections accepted per readiness of a listening socket
_ACCEPT_RETRY_S = 0.5  # after accept() failed for want of file descriptors or memory


class DataPlaneServer:
    """Listens on ``host:port`` for both the data-plane protocol and the aiohttp app.

    ``runner`` is the app's set-up :class:`aiohttp.web.AppRunner`; its ``server`` makes
    the aiohttp protocol for handed-over connections. :meth:`shutdown` stops
    accepting, lets in-flight requests finish for up to ``timeout_s`` seconds, then
    cleans the runner up (aiohttp drains its own requests in the same way).
    """

    def __init__(self, app: web.Application, runner: web.AppRunner, lean: bool = True) -> None:
        self.app = app
        self.runner = runner
        self.aiohttp_server: Any = runner.server
        self.lean = lean  # False: every connection goes to aiohttp at once (listen.fast_path: false)
        self.gateway: GatewayState = app[STATE]  # the app's state, for the lean protocol's per-request reads
        self.conns: set[DataPlaneProtocol] = set()
        self.closing = False
        self._socks: list[socket.socket] = []  # the listening sockets (one per resolved address)
        self._accepting: set[asyncio.Task] = set()
        self._accept_errors_logged_at = -1e9
        lc = app[STATE].cfg.listen
        self.head_timeout_s = lc.head_timeout_s
        self.body_timeout_s = lc.body_timeout_s
        self.body_min_bytes_per_s = lc.body_min_bytes_per_s
        self.keepalive_timeout_s = lc.keepalive_timeout_s
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.max_connections = min(lc.max_connections, soft * 3 // 4) if soft > 0 else lc.max_connections
        self.max_per_address = min(lc.max_connections_per_address, self.max_connections)
        # every open client connection, by address, oldest first (both stacks)
        self.open: dict[str, dict[DataPlaneProtocol, None]] = {}
        self.open_count = 0
        self._sweeper: asyncio.Task | None = None

    def admit(self, conn: DataPlaneProtocol) -> bool:
        """Count a new connection against ``listen.max_connections`` and
        ``max_connections_per_address``; at a cap, close the oldest connection with no
        request in flight (of that address, or of any) to make room. Returns whether
        ``conn`` may stay (False: every connection it would replace is busy)."""
        mine = self.open.get(conn.addr)
        if mine is not None and len(mine) >= self.max_per_address and not self._give_way(mine):
            return False
        if self.open_count >= self.max_connections and not any(self._give_way(c) for c in list(self.open.values())):
            return False
        if mine is None:
            mine = self.open[conn.addr] = {}
        mine[conn] = None
        self.open_count += 1
        return True

    def _give_way(self, conns: dict[DataPlaneProtocol, None]) -> bool:
        for c in conns:
            if not c.busy():
                self.release(c)
                c.close()
                return True
        return False

    def release(self, conn: DataPlaneProtocol) -> None:
        """``conn`` closed (or is closing): it no longer counts against the caps."""
        mine = self.open.get(conn.addr)
        if mine is not None and mine.pop(conn, 0) is None:
            self.open_count -= 1
            if not mine:
                del self.open[conn.addr]

    async def _sweep(self) -> None:
        """Once a second, close the connections handed to aiohttp whose head or body
        is late (``listen.head_timeout_s``, ``body_timeout_s``, ``body_min_bytes_per_s``)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(1.0)
            now = loop.time()
            for conns in list(self.open.values()):
                for c in list(conns):
                    h = c.handed
                    if h is not None and h.transport is not None:
                        self._check_handed(h, now)

    def _check_handed(self, h: Any, now: float) -> None:
        handler = h.handler
        count = handler._request_count  # aiohttp's RequestHandler keeps no public state
        if handler._request_in_progress or count != h.count:
            if count != h.count:  # a request started since the last look: its head was whole
                h.count, h.head_due, h.body_due = count, None, None
            req = handler._current_request
            if req is not None and not req.content.is_eof():
                if h.body_due is None:
                    h.body_due = now + self.body_timeout_s + (req.content_length or 0) / self.body_min_bytes_per_s
                elif now >= h.body_due:
                    h.transport.close()
            return
        if h.head_due is not None and now >= h.head_due:
            h.transport.close()

    @property
    def state(self) -> GatewayState:
        return self.app[STATE]

    def max_body_bytes(self) -> int:
        return self.gateway.cfg.limits.max_body_bytes

    async def start(self, host: str, port: int, *, reuse_port: bool = False, backlog: int = 1024) -> None:
        """Bind and listen on every address ``host`` resolves to (raises ``OSError``),
        then accept on the event loop (see :meth:`_accept`)."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        try:
            for family, _, _, _, addr in dict.fromkeys((i[0], i[1], i[2], i[3], i[4][:2]) for i in infos):
                sock = socket.create_server(addr, family=family, backlog=backlog, reuse_port=reuse_port)
                self._socks.append(sock)
                sock.setblocking(False)
                loop.add_reader(sock.fileno(), self._accept, sock)
        except BaseException:
            self._close_listeners()
            raise
        self._sweeper = asyncio.create_task(self._sweep())

    def _accept(self, sock: socket.socket) -> None:
        """Accept every connection waiting on ``sock`` (up to :data:`_ACCEPT_BATCH`).

        Not uvloop's server: libuv accepts one connection per loop iteration, and
        leaves the next to the next poll (libuv PR #3696, "unix: don't accept()
        connections in a loop", 2022). When an iteration relays many streams, a burst
        of connects would wait in the kernel's accept queue for several iterations,
        all of it added TTFT. Each accepted socket becomes a uvloop transport through
        ``loop.connect_accepted_socket``, its first step run eagerly."""
        loop = asyncio.get_running_loop()
        for _ in range(_ACCEPT_BATCH):
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as e:  # EMFILE, ENFILE, ENOBUFS...: stop polling a moment, not spin on it
                now = loop.time()
                if now - self._accept_errors_logged_at > 10:
                    self._accept_errors_logged_at = now
                    log.warning("cannot accept connections: %s (retrying every %.1f s)", e, _ACCEPT_RETRY_S)
                self._pause_accepting(sock)
                return
            if self.closing:
                conn.close()
                continue
            task, run_first_step = eager_tasks.create(
                loop, loop.connect_accepted_socket(lambda: DataPlaneProtocol(self), conn))
            self._accepting.add(task)
            task.add_done_callback(self._accepted)
            run_first_step()

    def _accepted(self, task: asyncio.Task) -> None:
        self._accepting.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("could not set an accepted connection up: %s", task.exception())

    def _pause_accepting(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(sock.fileno())

        def resume() -> None:
            if not self.closing and sock.fileno() >= 0:
                loop.add_reader(sock.fileno(), self._accept, sock)

        loop.call_later(_ACCEPT_RETRY_S, resume)

    def _close_listeners(self) -> None:
        loop = asyncio.get_running_loop()
        for sock in self._socks:
            if sock.fileno() >= 0:
                loop.remove_reader(sock.fileno())
                sock.close()

    @property
    def addresses(self) -> list[Any]:
        return [s.getsockname() for s in self._socks]

    def in_flight(self) -> int:
        """Requests this protocol is serving now."""
        return sum(1 for c in self.conns if c.task is not None)

    async def shutdown(self, timeout_s: float) -> None:
        """Stop accepting, finish in-flight requests (up to ``timeout_s`` seconds),
        close idle connections, then clean the aiohttp runner up."""
        self.closing = True
        self._close_listeners()
        if self._sweeper is not None:
            self._sweeper.cancel()
        Sends.of(asyncio.get_running_loop()).flush()  # answers queued this turn, before any close below
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        for c in list(self.conns):
            if c.task is None and c.transport is not None:
                c.transport.close()
        while self.in_flight() and loop.time() < deadline:  # noqa: ASYNC110 - polled once, at shutdown
            await asyncio.sleep(0.05)
        for c in list(self.conns):
            if c.transport is not None:
                c.transport.close()
        await self.runner.cleanup()


async def listen(app: web.Application, host: str, port: int, *, reuse_port: bool = False) -> DataPlaneServer:
    """Set the app up and listen on ``host:port`` (port 0: any free port, see
    ``.addresses``); with ``listen.fast_path`` (the default) through
    :class:`DataPlaneServer`. Stop it with ``await server.shutdown(drain_timeout_s)``.
    Raises ``OSError`` when the address cannot be bound, and ``ValueError`` when the
    lean protocol would bypass a middleware added to the app (which then needs
    ``listen.fast_path: false``)."""
    cfg = app[STATE].cfg
    fast = cfg.listen.fast_path
    extra = [m for m in app.middlewares if m not in app.get(OWN_MIDDLEWARES, ())]
    if fast and extra:
        raise ValueError("the lean protocol serves completions without aiohttp's middleware, and the app has "
                         f"middleware it would bypass ({', '.join(getattr(m, '__qualname__', repr(m)) for m in extra)})"
                         "; set listen.fast_path: false to serve every request through aiohttp")
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=cfg.lifecycle.drain_timeout_s,
                           keepalive_timeout=cfg.listen.keepalive_timeout_s)
    await runner.setup()
    # without the lean protocol every connection is handed to aiohttp at once, under the
    # same caps and deadlines
    server = DataPlaneServer(app, runner, lean=fast)
    try:
        await server.start(host, port, reuse_port=reuse_port)
    except BaseException:
        await runner.cleanup()
        raise
    return server
