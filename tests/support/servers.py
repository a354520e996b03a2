"""Real servers on 127.0.0.1 for the tests: the gateway in-process, and a scripted
OpenAI-style backend whose misbehaviour each test chooses."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from gateway.config import parse_config
from gateway.server.app import STATE, create_app
from gateway.server.listener import listen


def free_port() -> int:
    """A loopback port that nothing listens on (bound then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sse_chunk(i: int, text: str, *, model: str = "m", finish: str | None = None) -> bytes:
    obj = {"id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 0, "model": model,
           "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def completion_body(text: str = "hello", model: str = "m") -> dict[str, Any]:
    return {"id": "chatcmpl-test", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}


Handler = Callable[["ScriptedBackend", web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]


@dataclass
class ScriptedBackend:
    """An aiohttp backend on a loopback port. ``handler(backend, request, body)``
    decides each answer; the default streams ``n_chunks`` events or returns JSON.

    Records every request: ``attempt_times`` (``time.monotonic()`` at arrival) and
    ``bodies`` (raw bytes); ``disconnected`` is set when a streaming client went away.
    """

    handler: Handler | None = None
    n_chunks: int = 3
    attempt_times: list[float] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)  # of the requests to other paths than the completions'
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.attempt_times.append(time.monotonic())
        raw = await request.read()
        self.bodies.append(raw)
        self.headers.append(dict(request.headers))
        body = orjson.loads(raw)
        try:
            if self.handler is not None:
                return await self.handler(self, request, body)
            return await default_answer(self, request, body)
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnected.set()
            raise

    async def _other(self, request: web.Request) -> web.Response:
        self.headers.append(dict(request.headers))
        self.paths.append(request.path)
        return web.Response(text="ok")

    @asynccontextmanager
    async def running(self) -> AsyncIterator[ScriptedBackend]:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_get("/health", _ok)
        app.router.add_get("/version", self._other)  # an engine path the gateway does not serve itself
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            yield self
        finally:
            await runner.cleanup()


async def default_answer(backend: ScriptedBackend, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    if not body.get("stream"):
        return web.json_response(completion_body(model=body.get("model", "m")))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(backend.n_chunks):
        await resp.write(sse_chunk(i, f"t{i} ", model=body.get("model", "m")))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def gateway_config(backends: list[dict[str, Any]], **overrides: Any):
    """A validated config for tests: fast retries, the given backends."""
    data: dict[str, Any] = {
        "routing": {"policy": "round_robin"},
        "retries": {"max_attempts": 3, "base_backoff_s": 0.001, "max_backoff_s": 0.01},
        "health": {"interval_s": 60},
        "backends": backends,
    }
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(data.get(k), dict):
            data[k] = {**data[k], **v}
        else:
            data[k] = v
    return parse_config(data)


@dataclass
class RunningGateway:
    url: str
    app: web.Application

    @property
    def state(self):
        return self.app[STATE]

    def in_flight(self, backend: str) -> int:
        return self.state.fleet.backends[backend].in_flight

    def idle(self, backend: str) -> bool:
        """Every load counter of ``backend`` is back to exactly zero."""
        b = self.state.fleet.backends[backend]
        load = b.load
        return (b.in_flight, load.queued, load.running, load.queued_prefill_tokens, load.kv_tokens,
                load.decode_tokens_remaining) == (0, 0, 0, 0.0, 0.0, 0.0)

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples called ``name`` in the gateway's Prometheus registry
        whose labels include ``labels`` (a label not given is summed over, as
        ``sum without`` it; 0 when none)."""
        return sum(s.value for family in self.state.metrics.registry.collect() for s in family.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


AIOHTTP_MARK = "x-test-served-by-aiohttp"


def mark_aiohttp_answers(app: web.Application) -> None:
    """Test instrument: every answer aiohttp's server prepares for the app carries the
    header :data:`AIOHTTP_MARK`, where the data plane's own answers do not (both say
    ``Server: turbo-gateway``). What aiohttp's parser refuses (its 400 to a malformed
    head) never reaches the app: that answer keeps aiohttp's ``Server`` header instead."""
    async def mark(request: web.Request, response: web.StreamResponse) -> None:
        response.headers[AIOHTTP_MARK] = "1"

    app.on_response_prepare.append(mark)


@asynccontextmanager
async def running_gateway(cfg, backend_urls: dict[str, str] | None = None, *,
                          mark_aiohttp: bool = False) -> AsyncIterator[RunningGateway]:
    """The gateway app on a real loopback port, as ``python -m gateway`` runs it;
    ``mark_aiohttp``: see :func:`mark_aiohttp_answers`."""
    app = create_app(cfg, backend_urls)
    if mark_aiohttp:
        mark_aiohttp_answers(app)
    server = await listen(app, "127.0.0.1", 0)
    try:
        yield RunningGateway(f"http://127.0.0.1:{server.addresses[0][1]}", app)
    finally:
        await server.shutdown(app[STATE].cfg.lifecycle.drain_timeout_s)


async def wait_until(predicate: Callable[[], bool], *, timeout_s: float = 10.0) -> None:
    """Wait for a condition that an event elsewhere makes true (not a timing check):
    fails the test if it never becomes true."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)


Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def raw_backend(script: Script) -> AsyncIterator[str]:
    """A loopback server running ``script(reader, writer)`` per connection."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await script(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the gateway went away, or the test ended with the connection still open
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """``app`` on a free loopback port for the duration; yields its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
