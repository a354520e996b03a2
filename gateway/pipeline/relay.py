"""Relaying an answer to the client: whole responses, and streams chunk by chunk.

A stream is relayed byte for byte from inside the backend connection's read callback
(:meth:`gateway.upstream.connection.Exchange.relay`): each read is scanned (:class:`StreamScan`:
events, the final ``usage``, ``data: [DONE]``), its gap since the last one observed as
ITL, and written with HTTP/1.1 chunk framing straight to the client's transport. The
stream's last bytes go out together with the end of the chunked response. When the
head and first bytes of a stream arrive in one read, the client is answered inside
that read (:class:`EarlyAnswer`) rather than a loop turn later.
"""

from __future__ import annotations

import asyncio
import re
from typing import TYPE_CHECKING, Any

import orjson

from gateway.errors import BACKEND_HEADER, REQUEST_ID_HEADER, Disconnected
from gateway.pipeline import settle
from gateway.pipeline.downstream import ClientGone, Downstream
from gateway.upstream.connection import Exchange as Upstream
from routing.core import Decision, Reservation

if TYPE_CHECKING:
    from gateway.pipeline.attempt import Deadlines
    from gateway.pipeline.director import Exchange
    from gateway.runtime import GatewayState
    from gateway.upstream.client import BackendClient

ROUTE_HEADER = "x-turbo-route"
_MAX_SCAN_TAIL_BYTES = 1024 * 1024
_EMPTY_CONTENT = re.compile(rb'"content":\s*(""|null)')
_HIGH_WATER_BYTES = 256 * 1024  # the client's unsent bytes past which the backend is not read
_LOW_WATER_BYTES = 64 * 1024
_DRAIN_POLL_S = 0.005


class StreamScan:
    """Incremental scan of an SSE byte stream: counts ``data:`` events, keeps the last
    ``usage`` object seen and whether ``data: [DONE]`` arrived. Only complete lines are
    inspected; a partial line waits in ``tail``."""

    __slots__ = ("tail", "events", "done", "usage", "overflow", "role_only")

    def __init__(self) -> None:
        self.tail = b""
        self.events = 0
        self.done = False
        self.usage: dict[str, Any] | None = None
        self.overflow = False
        self.role_only = 0  # 1 when the first event only announced the role (vLLM, llama.cpp)

    def feed(self, chunk: bytes) -> None:
        if self.overflow:
            return
        # the usual read of a stream: one whole JSON event ("data: {...}\n\n", no other
        # line) without usage; this is what the general scan concludes for it, at the
        # cost of one substring search and three cheap checks
        if not self.tail and self.events and chunk.endswith(b"}\n\n") and chunk.count(b"\n") == 2 and \
                chunk.startswith(b"data:") and chunk.find(b'"usage"') < 0:
            self.events += 1
            return
        self._feed_general(chunk)

    def _feed_general(self, chunk: bytes) -> None:
        nl = chunk.rfind(b"\n")
        if nl < 0:
            self.tail += chunk
            if len(self.tail) > _MAX_SCAN_TAIL_BYTES:
                self.overflow, self.tail = True, b""
            return
        if nl == len(chunk) - 1:  # whole events: no copy
            complete = self.tail + chunk if self.tail else chunk
            self.tail = b""
        else:
            complete = self.tail + chunk[: nl + 1] if self.tail else chunk[: nl + 1]
            self.tail = chunk[nl + 1:]
        if self.events == 0:
            first = complete[: complete.find(b"\n")]
            if b'"role"' in first and (b'"content"' not in first or _EMPTY_CONTENT.search(first)):
                self.role_only = 1
        # ``complete`` starts at a line start: count events only at line starts, so that
        # "data:" or "[DONE]" inside a token's text changes nothing
        self.events += complete.startswith(b"data:") + complete.count(b"\ndata:")
        i = complete.rfind(b"[DONE]")  # the last event, when the stream is well formed
        if i >= 0:
            line = complete[complete.rfind(b"\n", 0, i) + 1:complete.find(b"\n", i)].rstrip(b"\r ")
            if line == b"data: [DONE]" or line == b"data:[DONE]":
                self.done = True
        if complete.find(b'"usage"') >= 0:
            for line in reversed(complete.split(b"\n")):
                if line.startswith(b"data:") and b'"usage"' in line:
                    try:
                        obj = orjson.loads(line[5:])
                    except orjson.JSONDecodeError:
                        continue
                    if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                        self.usage = obj["usage"]
                        break

    @property
    def content_events(self) -> int:
        """``data:`` events that were neither ``[DONE]``, a usage-only chunk nor a
        role-only first chunk: the completion tokens when ``usage`` is absent (one
        token per event, as vLLM and llama.cpp stream)."""
        return max(self.events - (1 if self.done else 0) - (1 if self.usage else 0) - self.role_only, 0)


class StreamRelay:
    """The sink of one relayed stream, called with each read's body bytes inside the
    upstream connection's read callback. One timer enforces the idle and total
    timeouts without a reschedule per chunk; a client slower than the stream pauses
    reading from the backend (backpressure); a client that left aborts the upstream
    connection, so the engine stops generating."""

    __slots__ = ("loop", "up", "transport", "chunked", "scan", "itl", "last_at", "deadlines", "timer", "paused")

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
        if now < self.last_at:  # bytes that waited for the relay to start
            now = self.last_at
        self.itl.observe(now - self.last_at)
        self.last_at = now
        self.scan.feed(data)
        t = self.transport
        if t is None or t.is_closing():
            self.up.abort(ClientGone())
            return
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
        at = min(idle_at or total_at, total_at or idle_at) if (idle_at or total_at) else None  # type: ignore[type-var]  # one is set
        if at is not None:
            self.timer = self.loop.call_at(at, self._arm)


def route_header(decision: Decision, fallback: str = "", fallback_reason: str = "") -> str:
    """The explanation header: policy, backend, reason, matched prefix tokens and the
    kind of evidence behind them (``precise``, ``speculative`` or ``approximate``), the
    estimate that decided (when the policy made one) and, for a request served by a
    fallback model, that model and the failure that sent it there."""
    d = decision.detail
    parts = [f"policy={decision.policy}", f"backend={decision.backend.name}", f"reason={decision.reason}",
             f"matched_tokens={int(d.get('matched_tokens', 0))}", f"evidence={decision.evidence}"]
    if "ttft_est_s" in d:
        parts.append(f"ttft_est_ms={d['ttft_est_s'] * 1000:.1f}")
    if "metrics_stale" in d:
        parts.append("metrics_stale=1")
    if fallback_reason:
        parts.append(f"fallback={fallback}; fallback_reason={fallback_reason}")
    return "; ".join(parts)


def _answer_headers(ex: Exchange, up: Upstream, content_type: str) -> dict[str, str]:
    return {"Content-Type": up.headers.get("content-type", content_type), BACKEND_HEADER: ex.backend,
            REQUEST_ID_HEADER: ex.request_id,
            ROUTE_HEADER: route_header(ex.decision, ex.model, ex.fallback_reason)}  # type: ignore[arg-type]  # routed


def _stream_headers(ex: Exchange, up: Upstream) -> dict[str, str]:
    h = _answer_headers(ex, up, "text/event-stream")
    h["Cache-Control"] = "no-cache"
    h["X-Accel-Buffering"] = "no"  # an nginx in front passes the events on as they come
    return h


class KeepAlives:
    """The streamed requests of one event loop whose keep-alive comments may fall due
    (``streaming`` in the config) while their first token is long in coming.

    At its arrival plus ``keepalive_after_s``, if no event reached the client yet, a
    request's 200 head and a ``: keep-alive`` SSE comment go out, then another comment
    every ``keepalive_every_s`` until its first event (:meth:`discard`). One timer
    ticks, a quarter of the shortest interval apart (at most a second), while any
    request waits: a request costs a dict entry, not a timer of its own. Attempts go on
    behind the comments as before (retries, fallbacks); only a final failure can no
    longer be a status, and ends the stream with an error event. Comments are not
    events: no TTFT, ITL or token is counted."""

    __slots__ = ("loop", "waiting", "tick_s", "timer")
    COMMENT = b": keep-alive\n\n"

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.waiting: dict[int, list[Any]] = {}  # id(ex): [ex, due loop time, every_s, comment task or None]
        self.tick_s = 1.0
        self.timer: asyncio.TimerHandle | None = None

    def add(self, ex: Exchange, after_s: float, every_s: float) -> None:
        """``ex``'s first comment falls due ``after_s`` seconds after its arrival."""
        self.waiting[id(ex)] = [ex, ex.arrival + after_s, every_s, None]
        if self.timer is None:
            tick = min(after_s, every_s) / 4
            if tick < self.tick_s:
                self.tick_s = tick
            self.timer = self.loop.call_later(self.tick_s, self._tick)

    def discard(self, ex: Exchange) -> asyncio.Task | None:
        """No more comments for ``ex``; returns the comment being written to it, if
        any (its first event must go out after it)."""
        w = self.waiting.pop(id(ex), None)
        return w[3] if w is not None else None

    @staticmethod
    def _headers(ex: Exchange) -> dict[str, str]:
        h = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
             REQUEST_ID_HEADER: ex.request_id}
        if ex.decision is not None:
            h[BACKEND_HEADER] = ex.backend
            h[ROUTE_HEADER] = route_header(ex.decision, ex.model, ex.fallback_reason)
        return h

    def _tick(self) -> None:
        now = self.loop.time()
        for key, w in list(self.waiting.items()):
            ex, due, every_s, task = w
            if due > now:
                continue
            w[1] = now + every_s
            down = ex.down
            if down.may_wait:  # aiohttp: its writes are awaited, one at a time
                if task is None or task.done():
                    w[3] = self.loop.create_task(down.start_stream(self._headers(ex), self.COMMENT))
            else:
                try:
                    down.start_stream_now(self._headers(ex), self.COMMENT)
                except ClientGone:
                    del self.waiting[key]  # the request's own path sees the client go
        self.timer = self.loop.call_later(self.tick_s, self._tick) if self.waiting else None


def close_comment(task: asyncio.Task) -> None:
    """A keep-alive comment still in flight when its request ended: cancelled, or its
    outcome retrieved (a comment the client never read is no error)."""
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()


def whole_usage(data: bytes) -> Any:
    """The ``usage`` object of a whole (non-streamed) response body, or ``None``."""
    if b'"usage"' in data:
        try:
            obj = orjson.loads(data)
            return obj.get("usage") if isinstance(obj, dict) else None
        except orjson.JSONDecodeError:
            pass
    return None


def whole(state: GatewayState, ex: Exchange, up: Upstream, data: bytes, reservation: Reservation) -> None:
    """Answer with a whole (non-streamed) response ``data`` and settle it."""
    settle.first_byte(state, ex, None, state.loop.time())
    settle.completed(state, ex, reservation, whole_usage(data), 0, whole=True)
    settle.finish(state, ex, 200)
    ex.down.respond(200, data, _answer_headers(ex, up, "application/json"))


def _start(state: GatewayState, ex: Exchange, reservation: Reservation, chunk: bytes) -> tuple[float, StreamScan]:
    """The stream's first bytes are going to the client now: record the first token
    and scan them."""
    first_at = state.loop.time()
    settle.first_byte(state, ex, reservation, first_at)
    scan = ex.scan = StreamScan()
    scan.feed(chunk)
    return first_at, scan


def _relay(state: GatewayState, ex: Exchange, up: Upstream, scan: StreamScan, first_at: float,
           deadlines: Deadlines) -> tuple[StreamRelay, asyncio.Future[None]]:
    m = state.metrics
    relay = StreamRelay(state.loop, up, ex.down, scan, m.child(m.itl, ex.model), first_at,
                        deadlines)
    return relay, relay.run()


def open_now(state: GatewayState, ex: Exchange, up: Upstream, chunk: bytes, reservation: Reservation,
             deadlines: Deadlines) -> tuple[StreamRelay, asyncio.Future[None]]:
    """Answer the client with the stream's head and first bytes ``chunk`` without a
    wait (a downstream that never waits, a response still arriving) and install the
    relay; what :func:`stream` does first, callable from inside a read callback.
    Returns the relay and its future. Raises :class:`ClientGone`."""
    up.clear_deadline()  # the relay's own timer takes over: idle and total timeouts
    if ex.keepalive is not None:
        ex.keepalive.discard(ex)  # a downstream that never waits has no comment in flight
    first_at, scan = _start(state, ex, reservation, chunk)
    ex.down.start_stream_now(_stream_headers(ex, up), chunk)
    return _relay(state, ex, up, scan, first_at, deadlines)


class EarlyAnswer:
    """``on_ready`` of a streamed attempt (:meth:`gateway.upstream.client.UpstreamPool.request`):
    when the head and first bytes of a stream arrive in one read, the client is answered
    inside that read's callback (:func:`open_now`), not a loop turn later. ``opened``
    receives the running relay and its future, or the exception met, which the attempt
    raises (never the read callback)."""

    __slots__ = ("state", "ex", "reservation", "deadlines", "opened")

    def __init__(self, state: GatewayState, ex: Exchange, reservation: Reservation, deadlines: Deadlines) -> None:
        self.state, self.ex, self.reservation, self.deadlines = state, ex, reservation, deadlines
        self.opened: list[Any] = []

    def __call__(self, up: Upstream) -> None:
        if self.ex.down.started or up.status != 200 or up.complete or \
                not up.headers.get("content-type", "").lower().startswith("text/event-stream"):
            return
        chunk = up.take()
        if chunk:
            try:
                self.opened.append(open_now(self.state, self.ex, up, chunk, self.reservation, self.deadlines))
            except Exception as e:  # noqa: BLE001 - ClientGone, or a bug: its owner raises it
                self.opened.append(e)

    def stop(self) -> None:
        """Stop the relay's timer (its owner may not have reached the relay)."""
        if self.opened and not isinstance(self.opened[0], BaseException):
            self.opened[0][0].stop()


async def stream(state: GatewayState, ex: Exchange, client: BackendClient, up: Upstream, chunk: bytes,
                 reservation: Reservation, deadlines: Deadlines,
                 opened: tuple[StreamRelay, asyncio.Future[None]] | None = None) -> None:
    """Relay a stream: answer the client with its first ``chunk``, relay the rest from
    inside the upstream connection's read callback until the backend ends the
    response, then settle and end the client's stream with the last bytes in one
    write. ``opened``: :func:`open_now` already answered the client and installed the
    relay. Raises :class:`~gateway.errors.Disconnected` (the backend broke the stream
    or ended it without ``data: [DONE]``), the relay's timeouts, and
    :class:`ClientGone`."""
    name = client.state.name
    down = ex.down
    if opened is not None:
        assert ex.scan is not None
        last = await _relayed(up, ex.scan, *opened)
        return await _end(state, ex, name, ex.scan, last, reservation)
    up.clear_deadline()  # the relay's own timer takes over: idle and total timeouts
    if ex.keepalive is not None:  # the first event: no more comments, one being written goes first
        task = ex.keepalive.discard(ex)
        if task is not None:
            await task  # Downstream.start_stream: raises ClientGone
    first_at, scan = _start(state, ex, reservation, chunk)
    headers = _stream_headers(ex, up)
    if up.complete and scan.done:  # the whole stream arrived at once: one write
        settle.completed(state, ex, reservation, scan.usage, scan.content_events)
        await down.start_stream(headers, chunk, end=True)
        settle.finish(state, ex, 200)
        return
    last = b""
    if not up.complete:
        if down.may_wait:  # the relay is not installed yet: nothing else would stop reading the backend
            up.pause_reading()
        await down.start_stream(headers, chunk)
        relay, fut = _relay(state, ex, up, scan, first_at, deadlines)
        if down.may_wait:
            up.resume_reading()
        last = await _relayed(up, scan, relay, fut)
    else:  # the response ended with this read, without [DONE]: _end says so
        await down.start_stream(headers, chunk)
    return await _end(state, ex, name, scan, last, reservation)


async def _relayed(up: Upstream, scan: StreamScan, relay: StreamRelay, fut: asyncio.Future[None]) -> bytes:
    """Wait for the relay to end and return the response's last bytes, scanned, not
    yet sent."""
    try:
        await fut
    finally:
        relay.stop()
    chunk = up.take()
    scan.feed(chunk)
    return chunk


async def _end(state: GatewayState, ex: Exchange, name: str, scan: StreamScan, last: bytes,
               reservation: Reservation) -> None:
    """The backend ended a relayed stream (``last``: its last bytes, not yet sent):
    settle and end the client's stream, or raise :class:`Disconnected` when it ended
    without ``data: [DONE]``."""
    down = ex.down
    if not scan.done:
        if last:
            await down.write(last)
        raise Disconnected(name, f"backend {name} ended the stream without `data: [DONE]`")
    settle.completed(state, ex, reservation, scan.usage, scan.content_events)
    await down.end_stream(last)  # the last bytes and the end of the chunked body in one write
    settle.finish(state, ex, 200)
