"""Upstream attempts, retries and the SSE relay: one request from route to settle.

Follow a request here: :meth:`Proxy.forward` routes, reserves, runs one
:meth:`Proxy._attempt` per backend tried (retrying with backoff while no byte has
reached the client), and releases the reservation exactly once in the attempt's
``finally``. Streams are relayed chunk by chunk, byte for byte; the gateway scans the
bytes only to count events, catch the final ``usage`` and the ``[DONE]`` marker.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import random
import re
import time
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from gateway.config import GatewayConfig, Timeouts
from gateway.errors import (
    BackendStatus,
    ConnectFailed,
    ConnectTimeout,
    Disconnected,
    FirstByteTimeout,
    IdleTimeout,
    TotalTimeout,
    UpstreamError,
    error_body,
    sse_error_event,
)
from gateway.metrics import GatewayMetrics
from gateway.downstream import ClientGone, CollectDownstream, Downstream
from gateway.openai_api import ParsedRequest
from gateway.upstream import ConnectError, ConnectTimedOut, UpstreamClosed, UpstreamPool
from gateway.upstream import Exchange as UpstreamExchange
from routing import Decision, NoBackendAvailable, Reservation, Router, RouteRequest
from routing.estimate import PromptEstimate, TokenEstimator
from routing.fleet import BackendState
from routing.router import DECODE, PREFILL, SERVING

log = logging.getLogger("gateway.proxy")

BACKEND_HEADER = "x-turbo-backend"
ROUTE_HEADER = "x-turbo-route"
REQUEST_ID_HEADER = "x-request-id"
_MAX_ERROR_BODY_BYTES = 64 * 1024
_MAX_SCAN_TAIL_BYTES = 1024 * 1024
_EMPTY_CONTENT = re.compile(rb'"content":\s*(""|null)')
_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


_JSON_HEADERS = b"Content-Type: application/json\r\nAccept: application/json\r\n"
_STREAM_HEADERS = b"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
_HIGH_WATER_BYTES = 256 * 1024  # the client's unsent bytes past which the backend is not read
_LOW_WATER_BYTES = 64 * 1024
_DRAIN_POLL_S = 0.005


def _header_value(value: str) -> bytes:
    """``value`` as a header value: latin-1, with CR, LF and NUL dropped."""
    return value.encode("latin-1", "replace").translate(None, b"\r\n\x00")


@dataclass(slots=True)
class BackendClient:
    """How to reach one backend: its base URL, auth and timeouts, the data plane's
    keep-alive pool (:class:`gateway.upstream.UpstreamPool`, completions) and an aiohttp
    session (health checks, scraping, the prefill leg). Made inside the running loop."""

    state: BackendState
    base_url: str
    session: aiohttp.ClientSession
    timeouts: Timeouts
    auth_header: str | None = None
    pool: UpstreamPool = field(init=False)
    auth_line: bytes = field(init=False)  # the ``Authorization`` header line for the pool, or b""

    def __post_init__(self) -> None:
        self.pool = UpstreamPool(self.base_url, self.timeouts.connect_s)
        self.auth_line = b"Authorization: %s\r\n" % _header_value(self.auth_header) if self.auth_header else b""


@dataclass(slots=True)
class StreamScan:
    """Incremental scan of an SSE byte stream: counts ``data:`` events, keeps the last
    ``usage`` object seen and whether ``data: [DONE]`` arrived. Only complete lines are
    inspected; a partial line waits in ``tail``."""

    tail: bytes = b""
    events: int = 0
    done: bool = False
    usage: dict[str, Any] | None = None
    overflow: bool = False
    role_only: int = 0  # 1 when the first event only announced the role (vLLM, llama.cpp)

    def feed(self, chunk: bytes) -> None:
        if self.overflow:
            return
        # the usual read of a stream: one whole JSON event ("data: {...}\n\n", no other
        # line) that carries no usage: what the general scan would conclude, with one
        # substring search and three cheap checks instead of five substring searches
        if not self.tail and self.events and chunk.endswith(b"}\n\n") and chunk.count(b"\n") == 2 and \
                chunk.startswith(b"data:") and chunk.find(b'"usage"') < 0:
            self.events += 1
            return
        self._feed_general(chunk)

    def _feed_general(self, chunk: bytes) -> None:
        if self.overflow:
            return
        nl = chunk.rfind(b"\n")
        if nl < 0:
            self.tail += chunk
            if len(self.tail) > _MAX_SCAN_TAIL_BYTES:
                self.overflow, self.tail = True, b""
            return
        if nl == len(chunk) - 1:  # the usual read: whole events (no copy)
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
        if complete.find(b'"usage"') >= 0:  # find: cheaper than ``in`` for short needles
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


class _Relay:
    """Relays one stream's body from the backend to the client inside the upstream
    connection's ``data_received``: scan the chunk, observe ITL, write it with HTTP/1.1
    chunk framing straight to the client's transport. One timer enforces the idle and
    total timeouts without a reschedule per chunk; a client slower than the stream
    pauses reading from the backend (backpressure), and a client that left aborts the
    upstream connection."""

    __slots__ = ("loop", "up", "transport", "chunked", "collect", "scan", "itl", "last_at", "name", "idle_s", "total_s",
                 "total_deadline", "timer", "paused")

    def __init__(self, loop: asyncio.AbstractEventLoop, up: UpstreamExchange, down: Downstream,
                 scan: StreamScan, itl: Any, first_at: float, name: str, timeouts: Timeouts,
                 total_deadline: float | None) -> None:
        self.loop, self.up, self.scan, self.itl = loop, up, scan, itl
        self.transport = down.transport
        self.chunked = down.chunked  # False for an HTTP/1.0 client: raw bytes, the end is the close
        self.collect = down if isinstance(down, CollectDownstream) else None
        self.last_at = first_at
        self.name = name
        self.idle_s, self.total_s, self.total_deadline = timeouts.idle_s, timeouts.total_s, total_deadline
        self.timer: asyncio.TimerHandle | None = None
        self.paused = False

    def run(self) -> asyncio.Future[None]:
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
        gap = now - self.last_at
        itl = self.itl  # itl.observe(gap), inlined: this runs for every read of every stream
        itl.counts[bisect_left(itl.bounds, gap)] += 1
        itl.sum += gap
        self.last_at = now
        self.scan.feed(data)
        if self.collect is not None:
            self.collect.body += data
            return
        t = self.transport
        if t is None or t.is_closing():
            self.up.abort(ClientGone())
            return
        t.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)  # type: ignore[attr-defined]
        if t.get_write_buffer_size() > _HIGH_WATER_BYTES and not self.paused:  # type: ignore[attr-defined]
            self.paused = True
            self.up.pause_reading()
            self.loop.call_later(_DRAIN_POLL_S, self._drain)

    def _drain(self) -> None:
        t = self.transport
        if not self.paused or self.up.complete:
            return
        if t is None or t.is_closing():
            self.up.abort(ClientGone())
        elif t.get_write_buffer_size() <= _LOW_WATER_BYTES:  # type: ignore[attr-defined]
            self.paused = False
            self.last_at = self.loop.time()  # time spent waiting for the client is not a stall
            self.up.resume_reading()
        else:
            self.loop.call_later(_DRAIN_POLL_S, self._drain)

    def _arm(self) -> None:
        """(Re)arm the timeout timer at the nearer of the idle and total deadlines."""
        self.timer = None
        now = self.loop.time()
        last = max(self.last_at, self.up.last_data_at)
        idle_at = (now if self.paused else last) + self.idle_s if self.idle_s else None
        total_at = self.total_deadline
        if total_at is not None and now >= total_at:
            self.up.abort(TotalTimeout(self.name, f"backend {self.name} exceeded the total timeout of {self.total_s} s"))
            return
        if idle_at is not None and now >= idle_at:
            self.up.abort(IdleTimeout(self.name, f"backend {self.name} stalled for more than {self.idle_s} s between chunks"))
            return
        at = min(x for x in (idle_at, total_at) if x is not None) if (idle_at or total_at) else None
        if at is not None:
            self.timer = self.loop.call_at(at, self._arm)


@dataclass(slots=True)
class Exchange:
    """One client request's progress across attempts."""

    down: Downstream  # where the answer goes (gateway/downstream.py)
    parsed: ParsedRequest
    request_id: str
    arrival: float
    backend: str = ""
    estimate: PromptEstimate | None = None
    decision: Decision | None = None
    body: bytes = b""  # what is sent upstream: the client's bytes unless a leg rewrote them
    scan: StreamScan | None = None  # the stream being relayed, if any
    attempts: list[tuple[str, float, str]] = field(default_factory=list)  # (backend, start time, outcome)
    tokens: int | None = None  # prompt + completion tokens of a completed response (per-key token limits)
    served: _ServedMetrics | None = None  # the answering backend's metric children, once it answered


class _ServedMetrics:
    """The metric children one answered request updates, for one (model, backend,
    pool): looked up once per request instead of once per update."""

    __slots__ = ("pool", "ttft", "pool_ttft", "e2e", "ok", "pool_ok", "prompt_tokens", "completion_tokens")

    def __init__(self, m: GatewayMetrics, model: str, backend: str, pool: str) -> None:
        self.pool = pool
        self.ttft = m.child(m.ttft, model)
        self.pool_ttft = m.child(m.pool_ttft, pool)
        self.e2e = m.child(m.e2e, model)
        self.ok = m.child(m.requests, model, backend, "200")
        self.pool_ok = m.child(m.pool_requests, pool, "200")
        self.prompt_tokens = m.child(m.prompt_tokens, model)
        self.completion_tokens = m.child(m.completion_tokens, model)


def parse_retry_after(value: str | None) -> float | None:
    """``Retry-After`` as seconds (delta-seconds or an HTTP date), or ``None``."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - time.time(), 0.0)


def full_jitter_backoff(retry: int, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Sleep before retry number ``retry`` (1-based): ``uniform(0, min(cap, base*2**(retry-1)))``
    seconds ("full jitter", AWS Architecture Blog, 2015)."""
    return rng.uniform(0.0, min(cap_s, base_s * (2 ** (retry - 1))))


class _EarlyAnswer:
    """``on_ready`` of a streamed attempt (:meth:`gateway.upstream.UpstreamPool.request`):
    the head and first bytes of a stream came in one read, so the client is answered
    now, inside that read's callback, not a loop turn later (at 256 streams a turn is a
    few hundred other reads); the relay then runs as usual. ``opened`` receives the
    running relay and its future, or the exception met (raised in the owner, not in the
    read callback)."""

    __slots__ = ("proxy", "ex", "client", "reservation", "total_deadline", "opened")

    def __init__(self, proxy: Proxy, ex: Exchange, client: BackendClient, reservation: Reservation,
                 total_deadline: float | None) -> None:
        self.proxy, self.ex, self.client, self.reservation = proxy, ex, client, reservation
        self.total_deadline = total_deadline
        self.opened: list[Any] = []

    def __call__(self, answer: UpstreamExchange) -> None:
        if self.ex.down.started or answer.status != 200 or answer.complete or \
                not answer.headers.get("content-type", "").lower().startswith("text/event-stream"):
            return
        chunk = answer.take()
        if chunk:
            try:
                self.opened.append(self.proxy._open_stream(self.ex, self.client, answer, chunk, self.reservation,
                                                           self.total_deadline))
            except Exception as e:  # ClientGone, or a bug
                self.opened.append(e)


class Proxy:
    """Forwards parsed completion requests to the fleet."""

    def __init__(self, cfg: GatewayConfig, router: Router, clients: dict[str, BackendClient],
                 metrics: GatewayMetrics, estimator: TokenEstimator, rng: random.Random | None = None) -> None:
        self.cfg = cfg
        self.router = router
        self.clients = clients
        self.metrics = metrics
        self.estimator = estimator
        self.rng = rng or random.Random()
        self._served_cache: dict[tuple[str, str], _ServedMetrics] = {}

    def route_header(self, decision: Decision) -> str:
        """The explanation header: policy, backend, reason, matched prefix tokens and
        the estimate that decided (when the policy made one)."""
        d = decision.detail
        parts = [f"policy={decision.policy}", f"backend={decision.backend.name}", f"reason={decision.reason}",
                 f"matched_tokens={int(d.get('matched_tokens', 0))}"]
        if "ttft_est_s" in d:
            parts.append(f"ttft_est_ms={d['ttft_est_s'] * 1000:.1f}")
        return "; ".join(parts)

    async def forward(self, ex: Exchange) -> None:
        """Route, attempt and retry; the answer goes to ``ex.down``. Never raises an
        :class:`UpstreamError`; raises :class:`ClientGone` (or ``CancelledError``)
        when the client left."""
        loop = asyncio.get_running_loop()
        retries = self.cfg.retries
        parsed = ex.parsed
        excluded: set[str] = set()
        last: UpstreamError | None = None
        t0 = loop.time()
        est = ex.estimate = self.estimator.estimate(parsed.model, parsed.prompt_text, parsed.max_tokens,
                                                    parsed.cache_salt)
        tokens_per_block = self.estimator.block_bytes / self.estimator.stats(parsed.model).bytes_per_token
        ex.body = parsed.body
        base = RouteRequest(parsed.model, frozenset(), est.text, est.size_bytes, est.hashes, est.prompt_tokens,
                            est.output_tokens, tokens_per_block)
        plan = self.router.plan(base, t0, self.cfg.routing.long_prompt_tokens)
        roles, remote = plan.roles, False
        if plan.kind == "disaggregated":
            params = await self._prefill_leg(ex, base)
            if params is not None:
                ex.body = orjson.dumps({**parsed.data, "kv_transfer_params": params})
                roles, remote = DECODE, True
                self.metrics.child(self.metrics.disaggregated, "ok").inc()
            else:  # the prefill leg failed: a decode or mixed backend recomputes the prompt
                roles = SERVING
                self.metrics.child(self.metrics.disaggregated, "fallback").inc()
        pools, stable_pools = self.router.canary_pools(parsed.model)
        # the first route reuses the planned request at the plan's instant (its prefix
        # match stands); a later one (after a prefill leg or a retry) matches afresh
        now = t0 if plan.kind != "disaggregated" else loop.time()
        req = base
        while True:
            req.roles, req.pools, req.remote_prefill = roles, pools, remote
            if excluded:
                req.exclude = frozenset(excluded)
            try:
                decision, reservation = self.router.route(req, now)
            except NoBackendAvailable as e:
                if stable_pools is not None:  # no canary backend can take it: the stable pool does
                    pools, stable_pools = stable_pools, None
                    self.metrics.child(self.metrics.canary_fallbacks, "no_canary_backend").inc()
                    continue
                wait = e.retry_after_s
                if wait is not None and len(ex.attempts) < retries.max_attempts and \
                        now + wait - t0 <= retries.budget_s and wait <= retries.max_retry_after_s:
                    await asyncio.sleep(wait)
                    now = loop.time()
                    continue
                return self._final_failure(ex, last, no_backend=e)
            self.metrics.child(self.metrics.decisions, decision.policy, decision.reason).inc()
            backend = decision.backend
            client = self.clients[backend.name]
            ex.backend = backend.name
            ex.decision = decision
            ex.attempts.append((backend.name, now, "started"))
            try:
                return await self._attempt(ex, client, reservation)
            except UpstreamError as err:
                # the circuit breaker counts the backend's faults, not its 4xx answers or 429s
                reservation.outcome(isinstance(err, BackendStatus) and err.status < 500, loop.time())
                reservation.release(loop.time())
                ex.attempts[-1] = (backend.name, now, err.reason)
                self.metrics.child(self.metrics.upstream_errors, backend.name, err.reason).inc()
                if ex.down.started:  # bytes already reached the client: end the stream
                    return await self._end_stream_with_error(ex, err)
                last = err
                now = loop.time()
                if err.retry_after_s is not None:
                    # keep every request off this backend for as long as it asked; this
                    # request waits for it only if no other backend can serve it and the
                    # wait is within max_retry_after_s and the retry budget
                    self.router.fleet.cool_down(backend, now + err.retry_after_s)
                elif isinstance(err, (ConnectFailed, ConnectTimeout)):
                    self.router.fleet.cool_down(backend, now + retries.failed_backend_cooldown_s)
                if not err.retryable or len(ex.attempts) >= retries.max_attempts:
                    return self._final_failure(ex, err)
                delay = full_jitter_backoff(len(ex.attempts), retries.base_backoff_s, retries.max_backoff_s, self.rng)
                if now + delay - t0 > retries.budget_s:
                    return self._final_failure(ex, err)
                excluded.add(backend.name)
                if stable_pools is not None:  # a canary failed: retry on the stable pool
                    pools, stable_pools = stable_pools, None
                    self.metrics.child(self.metrics.canary_fallbacks, err.reason).inc()
                self.metrics.child(self.metrics.retries, err.reason).inc()
                log.info("retrying request %s after %s from %s (attempt %d)", ex.request_id, err.reason,
                         backend.name, len(ex.attempts))
                await asyncio.sleep(delay)
                now = loop.time()
            finally:
                reservation.release(loop.time())

    # ---- one attempt -------------------------------------------------------------

    async def _attempt(self, ex: Exchange, client: BackendClient, reservation: Reservation) -> None:
        """Send the request to one backend and relay its answer.

        Raises an :class:`UpstreamError` subclass on failure (with ``ex.down.started``
        when bytes had already been written to the client) and :class:`ClientGone`
        (or ``CancelledError``) when the client left; either way the upstream
        connection is closed at once, so the engine aborts the generation.
        """
        loop = asyncio.get_running_loop()
        t = client.timeouts
        parsed = ex.parsed
        name = client.state.name
        start = loop.time()
        total_deadline = start + t.total_s if t.total_s else None
        ttft_deadline = start + t.ttft_s if t.ttft_s else None
        if total_deadline is not None and (ttft_deadline is None or total_deadline < ttft_deadline):
            ttft_deadline = total_deadline
        headers = (_STREAM_HEADERS if parsed.stream else _JSON_HEADERS) + b"x-request-id: %s\r\n%s" % (
            _header_value(ex.request_id), client.auth_line)
        up: UpstreamExchange | None = None
        early = _EarlyAnswer(self, ex, client, reservation, total_deadline) \
            if parsed.stream and not ex.down.may_wait else None
        opened = early.opened if early is not None else ()
        try:
            try:  # every wait up to the first body byte is bounded by ttft_deadline (the exchange's timer)
                try:
                    up = await client.pool.request(_PATHS[parsed.endpoint], headers, ex.body, ttft_deadline, early,
                                                   batched=not parsed.stream)
                except ConnectTimedOut as e:
                    raise ConnectTimeout(name, f"connecting to backend {name} timed out") from e
                except ConnectError as e:
                    raise ConnectFailed(name, f"could not connect to backend {name}: {e}") from e
                except UpstreamClosed as e:
                    raise Disconnected(name, f"backend {name} closed the connection before answering") from e
                if opened:
                    if isinstance(opened[0], BaseException):
                        raise opened[0]
                    return await self._relay_stream(ex, client, up, b"", reservation, total_deadline, opened[0])
                if up.status != 200:
                    try:
                        body = await up.read(_MAX_ERROR_BODY_BYTES)
                    except UpstreamClosed:
                        body = b""
                    ctype = up.headers.get("content-type", "").split(";", 1)[0].strip().lower()
                    raise BackendStatus(name, up.status, body, ctype,
                                        parse_retry_after(up.headers.get("retry-after")))
                if not parsed.stream or not up.headers.get("content-type", "").lower().startswith("text/event-stream"):
                    try:
                        data = await up.read()
                    except UpstreamClosed as e:
                        raise Disconnected(name, f"backend {name} closed the connection mid-response") from e
                    return await self._relay_whole(ex, up, data, reservation)
                # streaming: wait for the first chunk before answering the client, so
                # that everything up to here can still be retried elsewhere
                try:
                    chunk = await up.wait_first_body()
                except UpstreamClosed as e:
                    raise Disconnected(name, f"backend {name} closed the stream before the first byte") from e
                if not chunk:
                    raise Disconnected(name, f"backend {name} ended the stream without sending an event")
            except TimeoutError as e:
                if total_deadline is not None and loop.time() >= total_deadline:
                    raise TotalTimeout(name, f"backend {name} exceeded the total timeout of {t.total_s} s") from e
                raise FirstByteTimeout(name, f"backend {name} sent no first byte within {t.ttft_s} s") from e
            up.clear_deadline()  # the relay's own timer takes over: idle and total timeouts
            return await self._relay_stream(ex, client, up, chunk, reservation, total_deadline)
        except (ClientGone, asyncio.CancelledError):
            self.metrics.child(self.metrics.client_disconnects, name).inc()
            self._finish(ex, 499)
            raise
        finally:
            if opened and not isinstance(opened[0], BaseException):
                opened[0][0].stop()  # the relay's timer (the owner may not have reached the relay)
            if up is not None:
                up.finish()  # back to the pool when complete, else closed (the engine aborts)

    def _open_stream(self, ex: Exchange, client: BackendClient, up: UpstreamExchange, chunk: bytes,
                     reservation: Reservation, total_deadline: float | None) -> tuple[_Relay, asyncio.Future[None]]:
        """The start of :meth:`_relay_stream` without a wait, for a downstream that never
        waits (``start_stream_now``) and a response still arriving: the first token is
        recorded, the client gets the headers and ``chunk``, and the relay is installed.
        Returns the relay and its future. Raises :class:`ClientGone`."""
        up.clear_deadline()  # the relay's own timer takes over: idle and total timeouts
        loop = asyncio.get_running_loop()
        first_at = loop.time()
        reservation.first_token(first_at)
        self._observe_ttft(ex, first_at - ex.arrival)
        name = client.state.name
        scan = ex.scan = StreamScan()
        scan.feed(chunk)
        ex.down.start_stream_now(self._stream_headers(ex, up, name), chunk)
        relay = _Relay(loop, up, ex.down, scan, self.metrics.child(self.metrics.itl, ex.parsed.model),
                       first_at, name, client.timeouts, total_deadline)
        return relay, relay.run()

    def _stream_headers(self, ex: Exchange, up: UpstreamExchange, name: str) -> dict[str, str]:
        return {"Content-Type": up.headers.get("content-type", "text/event-stream"), "Cache-Control": "no-cache",
                BACKEND_HEADER: name, REQUEST_ID_HEADER: ex.request_id, ROUTE_HEADER: self.route_header(ex.decision)}

    async def _relay_stream(self, ex: Exchange, client: BackendClient, up: UpstreamExchange, chunk: bytes,
                            reservation: Reservation, total_deadline: float | None,
                            opened: tuple[_Relay, asyncio.Future[None]] | None = None) -> None:
        """Answer the client with the stream's first ``chunk``, then relay the rest
        from inside the upstream connection's ``data_received`` (no task switch per
        read) until the backend ends the response; the last read goes out with the
        end of the chunked response, in one write. ``opened``: :meth:`_open_stream`
        already answered the client and installed the relay."""
        name = client.state.name
        if opened is not None:
            assert ex.scan is not None
            chunk = await self._relayed(name, up, ex.scan, *opened)
            return await self._end_relayed_stream(ex, name, ex.scan, chunk, reservation)
        loop = asyncio.get_running_loop()
        first_at = loop.time()
        reservation.first_token(first_at)
        self._observe_ttft(ex, first_at - ex.arrival)
        headers = self._stream_headers(ex, up, name)
        down = ex.down
        scan = ex.scan = StreamScan()
        scan.feed(chunk)
        if up.complete and scan.done:  # the whole stream arrived at once: one write
            self._settle(ex, reservation, scan.usage, scan.content_events)
            await down.start_stream(headers, chunk, end=True)
            self._finish(ex, 200)
            return
        if not up.complete:
            if down.may_wait:  # the relay is not installed yet: nothing else would stop reading the backend
                up.pause_reading()
            await down.start_stream(headers, chunk)
            chunk = b""
            relay = _Relay(loop, up, down, scan, self.metrics.child(self.metrics.itl, ex.parsed.model),
                           first_at, name, client.timeouts, total_deadline)
            fut = relay.run()
            if down.may_wait:
                up.resume_reading()
            chunk = await self._relayed(name, up, scan, relay, fut)
        elif not down.started:
            await down.start_stream(headers, chunk)
            chunk = b""
        return await self._end_relayed_stream(ex, name, scan, chunk, reservation)

    async def _relayed(self, name: str, up: UpstreamExchange, scan: StreamScan, relay: _Relay,
                       fut: asyncio.Future[None]) -> bytes:
        """Wait for the relay to end (``fut``: the backend ended the response) and
        return the response's last bytes, scanned, not yet sent. Raises
        :class:`Disconnected` when the backend broke the stream."""
        try:
            await fut
        except UpstreamClosed as e:
            raise Disconnected(name, f"backend {name} closed the stream mid-response") from e
        finally:
            relay.stop()
        chunk = up.take()
        scan.feed(chunk)
        return chunk

    async def _end_relayed_stream(self, ex: Exchange, name: str, scan: StreamScan, chunk: bytes,
                                  reservation: Reservation) -> None:
        """The backend ended a relayed stream (``chunk``: its last bytes, not yet
        sent): settle the tokens and end the client's stream, or raise
        :class:`Disconnected` when it ended without ``data: [DONE]``."""
        down = ex.down
        if not scan.done:
            if chunk:
                await down.write(chunk)
            raise Disconnected(name, f"backend {name} ended the stream without `data: [DONE]`")
        self._settle(ex, reservation, scan.usage, scan.content_events)
        await down.end_stream(chunk)  # the last bytes and the end of the chunked body in one write
        self._finish(ex, 200)

    async def _prefill_leg(self, ex: Exchange, base: RouteRequest) -> dict[str, Any] | None:
        """Run the prefill leg of a disaggregated request (vLLM's disaggregated-serving
        proxy flow: ``max_tokens`` 1, no stream, ``kv_transfer_params.do_remote_decode``)
        on the ``prefill`` pool, trying up to ``retries.max_attempts`` backends.

        Returns the ``kv_transfer_params`` the decode leg must carry, or ``None`` when
        every attempt failed (the caller falls back). A client that goes away cancels
        this leg with the request (its connection is closed, the engine aborts).
        """
        loop = asyncio.get_running_loop()
        parsed = ex.parsed
        data = dict(parsed.data)
        data.pop("stream_options", None)
        data.update(stream=False, max_tokens=1, kv_transfer_params={
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None})
        if "max_completion_tokens" in data:
            data["max_completion_tokens"] = 1
        body = orjson.dumps(data)
        excluded: set[str] = set()
        for _ in range(self.cfg.retries.max_attempts):
            now = loop.time()
            req = RouteRequest(parsed.model, frozenset(excluded), base.prompt_text, base.prompt_bytes,
                               base.block_hashes, base.prompt_tokens, 1, base.tokens_per_block, PREFILL)
            try:
                decision, reservation = self.router.route(req, now)
            except NoBackendAvailable:
                return None
            name = decision.backend.name
            client = self.clients[name]
            t = client.timeouts
            headers = {"Content-Type": "application/json", REQUEST_ID_HEADER: ex.request_id}
            if client.auth_header:
                headers["Authorization"] = client.auth_header
            try:
                async with asyncio.timeout(min(x for x in (t.ttft_s, t.total_s, 1e9) if x)):
                    async with client.session.post(client.base_url + _PATHS[parsed.endpoint], data=body,
                                                   headers=headers) as resp:
                        payload = await resp.read()
                        status = resp.status
                if status == 200:
                    obj = orjson.loads(payload)
                    params = obj.get("kv_transfer_params") if isinstance(obj, dict) else None
                    end = loop.time()
                    reservation.first_token(end)
                    reservation.outcome(True, end)
                    reservation.release(end, 1)
                    if isinstance(params, dict):
                        return params
                    log.warning("prefill backend %s returned no kv_transfer_params; falling back", name)
                    return None
                reason = f"status_{status}"
            except (aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError) as e:
                reason = "connect" if isinstance(e, aiohttp.ClientConnectorError) else type(e).__name__
            finally:
                reservation.release(loop.time())
            self.metrics.child(self.metrics.upstream_errors, name, reason).inc()
            excluded.add(name)
        return None

    async def _read_error_body(self, resp: aiohttp.ClientResponse) -> bytes:
        try:
            return await resp.content.read(_MAX_ERROR_BODY_BYTES)
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            return b""

    async def _relay_whole(self, ex: Exchange, up: UpstreamExchange, data: bytes,
                           reservation: Reservation) -> None:
        usage = None
        if b'"usage"' in data:
            try:
                obj = orjson.loads(data)
                usage = obj.get("usage") if isinstance(obj, dict) else None
            except orjson.JSONDecodeError:
                pass
        now = asyncio.get_running_loop().time()
        self._observe_ttft(ex, now - ex.arrival)
        self._settle(ex, reservation, usage, 0, whole=True)
        self._finish(ex, 200)
        ex.down.respond(200, data, {
            "Content-Type": up.headers.get("content-type", "application/json"), BACKEND_HEADER: ex.backend,
            REQUEST_ID_HEADER: ex.request_id, ROUTE_HEADER: self.route_header(ex.decision)})

    # ---- settling ----------------------------------------------------------------

    def _settle(self, ex: Exchange, reservation: Reservation, usage: Any, events: int, whole: bool = False) -> None:
        """A response completed: count its tokens, teach the estimator and the load
        model, and release the reservation."""
        m = self.metrics
        model = ex.parsed.model
        served = ex.served or self._served(ex)
        completion: int | None = events or None
        prompt: int | None = None
        if isinstance(usage, dict):
            pt, ct = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(pt, int):
                prompt = pt
                served.prompt_tokens.inc(pt)
            if isinstance(ct, int):
                completion = ct
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                m.child(m.cached_tokens, model).inc(details["cached_tokens"])
                if ex.decision is not None:
                    predicted = ex.decision.detail.get("matched_tokens", 0)
                    m.child(m.predicted_cached_tokens, model).inc(predicted)
                    m.child(m.reported_prompt_tokens, model).inc(prompt or 0)
        if completion:
            served.completion_tokens.inc(completion)
        if ex.estimate is not None:
            self.estimator.observe_usage(model, ex.estimate.size_bytes, prompt, completion)
        now = asyncio.get_running_loop().time()
        reservation.outcome(True, now)
        ex.tokens = int(prompt if prompt is not None else (ex.estimate.prompt_tokens if ex.estimate else 0)) + (completion or 0)
        if whole:  # no token timing for a whole response: learn no TTFT or ITL from it
            reservation.release(now)
        else:
            reservation.release(now, completion)

    def _pool(self, ex: Exchange) -> str:
        b = self.router.fleet.backends.get(ex.backend) if ex.backend else None
        return b.spec.pool if b is not None else "none"

    def _served(self, ex: Exchange) -> _ServedMetrics:
        """The metric children of the backend that answered ``ex`` (cached per model,
        backend and pool: a reload may move a backend to another pool)."""
        key = (ex.parsed.model, ex.backend)
        pool = self._pool(ex)
        served = self._served_cache.get(key)
        if served is None or served.pool != pool:
            served = self._served_cache[key] = _ServedMetrics(self.metrics, ex.parsed.model, ex.backend or "none", pool)
        ex.served = served
        return served

    def _observe_ttft(self, ex: Exchange, seconds: float) -> None:
        served = self._served(ex)  # the answering backend is known from here on
        served.ttft.observe(seconds)
        served.pool_ttft.observe(seconds)

    def _finish(self, ex: Exchange, status: int) -> None:
        if status == 200:
            served = ex.served or self._served(ex)
            served.ok.inc()
            served.pool_ok.inc()
            served.e2e.observe(asyncio.get_running_loop().time() - ex.arrival)
            return
        m = self.metrics
        m.child(m.requests, ex.parsed.model, ex.backend or "none", str(status)).inc()
        m.child(m.pool_requests, self._pool(ex), str(status)).inc()

    async def _end_stream_with_error(self, ex: Exchange, err: UpstreamError) -> None:
        self.metrics.child(self.metrics.stream_errors, err.backend, err.reason).inc()
        prefix = b"\n\n" if ex.scan is not None and ex.scan.tail else b""
        log.warning("stream %s from %s failed after the first byte: %s", ex.request_id, err.backend, err.message)
        try:
            await ex.down.end_stream(prefix + sse_error_event(err.message, err.reason))
        except ClientGone:
            pass
        self._finish(ex, err.status)

    def _final_failure(self, ex: Exchange, err: UpstreamError | None,
                       no_backend: NoBackendAvailable | None = None) -> None:
        headers = {"Content-Type": "application/json", REQUEST_ID_HEADER: ex.request_id}
        if ex.backend:
            headers[BACKEND_HEADER] = ex.backend
        if isinstance(err, BackendStatus):
            if err.retry_after_s is not None:
                headers["Retry-After"] = str(max(int(err.retry_after_s + 0.999), 1))
            body = err.body
            try:
                ok = isinstance(orjson.loads(body), dict)
            except orjson.JSONDecodeError:
                ok = False
            if not ok:
                body = error_body(f"Backend {err.backend} answered HTTP {err.backend_status}.", err.status,
                                  code=f"backend_status_{err.backend_status}")
            self._finish(ex, err.status)
            ex.down.respond(err.status, body, headers)
            return
        if err is not None:
            self._finish(ex, err.status)
            ex.down.respond(err.status, error_body(err.message, err.status, code=err.reason), headers)
            return
        assert no_backend is not None
        if no_backend.retry_after_s is not None:
            headers["Retry-After"] = str(max(int(no_backend.retry_after_s + 0.999), 1))
        self._finish(ex, 503)
        ex.down.respond(503, error_body(str(no_backend), 503, code="no_backend_available"), headers)
