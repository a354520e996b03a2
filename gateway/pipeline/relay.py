"""Relaying an answer to the client: whole responses, and streams chunk by chunk.

A stream is relayed byte for byte from inside the backend connection's read callback
(:meth:`gateway.upstream.connection.Exchange.relay`): each read is scanned
(:class:`~gateway.pipeline.stream_scan.StreamScan`: events, the final ``usage``,
``data: [DONE]``), its gap since the last one observed as ITL, and written with HTTP/1.1
chunk framing straight to the client's transport (:class:`StreamRelay`). The stream's
last bytes go out together with the end of the chunked response. When the head and
first bytes of a stream arrive in one read, the client is answered inside that read
(:class:`EarlyAnswer`, the director's one early-answer hook) rather than a loop turn
later. What the answer teaches and counts is :mod:`~gateway.pipeline.settlement`'s. A
continuation of a stream whose backend failed (:mod:`~gateway.pipeline.migration`) is
relayed the same way into the client's open stream, its scan rewriting its events.

A client that did not ask for ``usage`` gets the stream it asked for, although the
attempt asked the engine for it (:func:`~gateway.pipeline.openai_request.request_usage`)
so that what was generated is counted exactly: the scan withholds the usage-only event
(``StreamScan(withhold=True)``).
"""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING, Any

from gateway.errors import Disconnected
from gateway.pipeline import migration, settlement
from gateway.pipeline.context import RequestContext
from gateway.pipeline.deadlines import Deadlines
from gateway.pipeline.downstream import ClientGone, Downstream
from gateway.pipeline.headers import answer_headers, stream_headers
from gateway.pipeline.stream_scan import StreamScan, TypedEventScan, whole_usage
from gateway.upstream.connection import Exchange as Upstream
from routing.core import Reservation

if TYPE_CHECKING:
    from gateway.runtime import GatewayState

_HIGH_WATER_BYTES = 256 * 1024  # the client's unsent bytes past which the backend is not read
_LOW_WATER_BYTES = 64 * 1024
_DRAIN_POLL_S = 0.005


class StreamRelay:
    """The sink of one relayed stream, called with each read's body bytes inside the
    upstream connection's read callback. One timer enforces the idle and total
    timeouts without a reschedule per chunk; a client slower than the stream pauses
    reading from the backend (backpressure); a client that left aborts the upstream
    connection, so the engine stops generating."""

    __slots__ = ("chunked", "deadlines", "itl", "last_at", "loop", "paused", "scan", "timer", "transport", "up")

    def __init__(self, loop: asyncio.AbstractEventLoop, up: Upstream, down: Downstream, scan: StreamScan, itl: Any,
                 first_at: float, deadlines: Deadlines) -> None:
        self.loop, self.up, self.scan, self.itl = loop, up, scan, itl
        self.transport = down.transport
        self.chunked = down.chunked  # False for an HTTP/1.0 client or an in-process one: raw bytes
        self.last_at = first_at
        self.deadlines = deadlines
        self.timer: asyncio.TimerHandle | None = None
        self.paused = False

    def run(self) -> asyncio.Future[None]:
        """Install the relay; the future resolves when the backend ended the response
        and fails with :class:`~gateway.errors.Disconnected` or a timeout."""
        fut = self.up.relay(self)
        self._arm()
        return fut

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def __call__(self, data: bytes) -> None:
        now = self.up.last_data_at  # the loop time of the read that brought ``data``
        if now < self.last_at:
            now = self.last_at
        self.itl.observe(now - self.last_at)
        self.last_at = now
        data = self.scan.feed(data)
        t = self.transport
        if t is None or t.is_closing():
            self.up.abort(ClientGone())
            return
        if data:  # empty: a partial line withheld
            t.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)
            if t.get_write_buffer_size() > _HIGH_WATER_BYTES and not self.paused:
                self.paused = True
                self.up.pause_reading()
                self.loop.call_later(_DRAIN_POLL_S, self._drain)

    def _drain(self) -> None:
        t = self.transport
        if not self.paused or self.up.complete:
            return
        if t is None or t.is_closing():
            self.up.abort(ClientGone())
        elif t.get_write_buffer_size() <= _LOW_WATER_BYTES:
            self.paused = False
            self.last_at = self.loop.time()  # time spent waiting for the client is not a stall
            self.up.resume_reading()
        else:
            self.loop.call_later(_DRAIN_POLL_S, self._drain)

    def _arm(self) -> None:
        """(Re)arm the timer at the nearer of the idle and total deadlines, or fail
        the relay with the one that passed."""
        self.timer = None
        now = self.loop.time()
        d = self.deadlines
        idle_s = d.timeouts.idle_s
        idle_at = ((now if self.paused else max(self.last_at, self.up.last_data_at)) + idle_s) if idle_s else None
        total_at = d.total_at
        if total_at is not None and now >= total_at:
            self.up.abort(d.total_error())
            return
        if idle_at is not None and now >= idle_at:
            self.up.abort(d.idle_error())
            return
        at = min(idle_at or total_at, total_at or idle_at) if (idle_at or total_at) else None  # type: ignore[type-var]
        if at is not None:
            self.timer = self.loop.call_at(at, self._arm)


def whole(state: GatewayState, ctx: RequestContext, up: Upstream, data: bytes, reservation: Reservation) -> None:
    """Answer with a whole (non-streamed) response ``data`` and settle it."""
    ctx.answer = data
    settlement.first_byte(state, ctx, None, state.loop.time(), data)
    settlement.completed(state, ctx, reservation, whole_usage(data, ctx.parsed.api), 0, whole=True)
    settlement.finish(state, ctx, 200)
    ctx.down.respond(200, data, answer_headers(ctx, up.headers.get("content-type", "application/json")))


def _start(state: GatewayState, ctx: RequestContext, reservation: Reservation,
           chunk: bytes) -> tuple[float, StreamScan, bytes]:
    """The stream's first bytes ``chunk`` are going to the client now: record the first
    token (a stream of typed events: when its first output delta comes,
    :class:`~gateway.pipeline.stream_scan.TypedEventScan`) and scan them. Returns the
    time, the scan and the bytes to send."""
    first_at = state.loop.time()
    scan = ctx.scan = migration.scan_for(state, ctx)  # a continuation's: rewritten into the client's stream
    if isinstance(scan, TypedEventScan):
        scan.on_first_token = functools.partial(_first_token, state, ctx, reservation)
    else:
        settlement.first_byte(state, ctx, reservation, first_at, chunk)
    return first_at, scan, scan.feed(chunk)


def _first_token(state: GatewayState, ctx: RequestContext, reservation: Reservation, head: bytes) -> None:
    settlement.first_byte(state, ctx, reservation, state.loop.time(), head)


def _relay(state: GatewayState, ctx: RequestContext, up: Upstream, scan: StreamScan, first_at: float,
           deadlines: Deadlines) -> tuple[StreamRelay, asyncio.Future[None]]:
    m = state.metrics
    relay = StreamRelay(state.loop, up, ctx.down, scan, m.child(m.itl, ctx.model, ctx.parsed.api.name), first_at,
                        deadlines)
    return relay, relay.run()


def open_now(state: GatewayState, ctx: RequestContext, up: Upstream, chunk: bytes, reservation: Reservation,
             deadlines: Deadlines) -> tuple[StreamRelay, asyncio.Future[None]]:
    """Answer the client with the stream's head and first bytes ``chunk`` without a
    wait (a downstream that never waits, a response still arriving) and install the
    relay; what :func:`stream` does first, callable from inside a read callback.
    Returns the relay and its future. Raises :class:`ClientGone`."""
    up.clear_deadline()  # the relay's own timer takes over: idle and total timeouts
    if ctx.keepalive is not None:
        ctx.keepalive.discard(ctx)  # a downstream that never waits has no comment in flight
    first_at, scan, chunk = _start(state, ctx, reservation, chunk)
    ctx.down.start_stream_now(stream_headers(ctx, up.headers.get("content-type", "text/event-stream")), chunk)
    return _relay(state, ctx, up, scan, first_at, deadlines)


class EarlyAnswer:
    """``on_ready`` of a streamed attempt (:meth:`gateway.upstream.client.UpstreamPool.request`):
    when the head and first bytes of a stream arrive in one read, the client is answered
    inside that read's callback (:func:`open_now`), not a loop turn later. ``opened``
    receives the running relay and its future, or the exception met, which the attempt
    raises (never the read callback)."""

    __slots__ = ("ctx", "deadlines", "opened", "reservation", "state")

    def __init__(self, state: GatewayState, ctx: RequestContext, reservation: Reservation,
                 deadlines: Deadlines) -> None:
        self.state, self.ctx, self.reservation, self.deadlines = state, ctx, reservation, deadlines
        self.opened: list[Any] = []

    def __call__(self, up: Upstream) -> None:
        if self.ctx.down.started or up.status != 200 or up.complete or \
                not up.headers.get("content-type", "").lower().startswith("text/event-stream"):
            return
        chunk = up.take()
        if chunk:
            try:
                self.opened.append(open_now(self.state, self.ctx, up, chunk, self.reservation, self.deadlines))
            except Exception as e:  # noqa: BLE001 - ClientGone, or a bug: its owner raises it
                self.opened.append(e)

    def stop(self) -> None:
        """Stop the relay's timer (its owner may not have reached the relay)."""
        if self.opened and not isinstance(self.opened[0], BaseException):
            self.opened[0][0].stop()


async def stream(state: GatewayState, ctx: RequestContext, name: str, up: Upstream, chunk: bytes,
                 reservation: Reservation, deadlines: Deadlines,
                 opened: tuple[StreamRelay, asyncio.Future[None]] | None = None) -> None:
    """Relay a stream: answer the client with its first ``chunk``, relay the rest from
    inside the upstream connection's read callback until the backend ends the
    response, then settle and end the client's stream with the last bytes in one
    write (``name``: the backend's). ``opened``: :func:`open_now` already answered the client and installed the
    relay. Raises :class:`~gateway.errors.Disconnected` (the backend broke the stream
    or ended it without ``data: [DONE]``), the relay's timeouts, and
    :class:`ClientGone`."""
    down = ctx.down
    if opened is not None:
        assert ctx.scan is not None
        scan = ctx.scan
        relay, fut = opened
    else:
        up.clear_deadline()  # the relay's own timer takes over: idle and total timeouts
        if ctx.keepalive is not None:  # the first event: no more comments, one being written goes first
            task = ctx.keepalive.discard(ctx)
            if task is not None:
                await task  # Downstream.start_stream: raises ClientGone
        first_at, scan, chunk = _start(state, ctx, reservation, chunk)
        headers = stream_headers(ctx, up.headers.get("content-type", "text/event-stream"))
        if up.complete and scan.done:  # the whole stream arrived at once: one write
            settlement.completed(state, ctx, reservation, scan.usage, scan)
            await down.start_stream(headers, chunk + scan.flush(), end=True)
            settlement.finish(state, ctx, 200)
            return
        if up.complete:  # the response ended with this read, without [DONE]: _end says so
            await down.start_stream(headers, chunk)
            return await _end(state, ctx, name, scan, scan.flush(), reservation)
        if down.may_wait:  # the relay is not installed yet: nothing else would stop reading the backend
            up.pause_reading()
        await down.start_stream(headers, chunk)
        relay, fut = _relay(state, ctx, up, scan, first_at, deadlines)
        if down.may_wait:
            up.resume_reading()
    try:
        await fut  # the relay ended
    finally:
        relay.stop()
    last = scan.feed(up.take()) + scan.flush()  # the last bytes, and those withheld until the end
    if scan.done and not down.may_wait:  # the usual end, without a coroutine
        return _ended(state, ctx, scan, last, reservation)
    return await _end(state, ctx, name, scan, last, reservation)


def _ended(state: GatewayState, ctx: RequestContext, scan: StreamScan, last: bytes,
           reservation: Reservation) -> None:
    """The backend ended a relayed stream with ``data: [DONE]`` (``last``: its last
    bytes, not yet sent) and the client's downstream never waits: settle and end the
    client's stream now, the last bytes and the end of the chunked body in one write."""
    settlement.completed(state, ctx, reservation, scan.usage, scan)
    ctx.down.end_stream_now(last)
    settlement.finish(state, ctx, 200)


async def _end(state: GatewayState, ctx: RequestContext, name: str, scan: StreamScan, last: bytes,
               reservation: Reservation) -> None:
    """The backend ended a relayed stream (``last``: its last bytes, not yet sent):
    settle and end the client's stream (the last bytes and the end of the chunked body
    in one write; :func:`_ended` when the downstream never waits), or raise
    :class:`Disconnected` when it ended without ``data: [DONE]``."""
    down = ctx.down
    if not scan.done:
        if last:
            await down.write(last)
        raise Disconnected(name, f"backend {name} ended the stream without its last event"
                                 f" ({ctx.parsed.api.name}: {_last_event(ctx)})")
    if not down.may_wait:
        return _ended(state, ctx, scan, last, reservation)
    settlement.completed(state, ctx, reservation, scan.usage, scan)
    await down.end_stream(last)  # aiohttp's: it may wait for the client
    settlement.finish(state, ctx, 200)


def _last_event(ctx: RequestContext) -> str:
    """The event that ends a stream of ``ctx``'s API, in words."""
    ends = ctx.parsed.api.end_events
    return " or ".join(sorted(e.decode() for e in ends)) if ends else "data: [DONE]"
