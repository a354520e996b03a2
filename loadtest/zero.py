"""A zero-delay OpenAI-compatible backend: the floor under a proxy benchmark.

    python -m loadtest.zero [--port 0] [--tokens 16] [--ttft-ms 0] [--itl-ms 0]

Answers ``POST /v1/chat/completions`` and ``/v1/completions`` at once (and, streamed
only, ``/v1/responses`` and ``/v1/messages`` in their typed-event grammars): streamed, a
role chunk, ``max_tokens`` one-word text chunks (default ``--tokens``), a usage chunk
(``stream_options.include_usage``) and ``[DONE]``, each written as soon as the
previous one (no model, no sleeping); or one JSON body. Also ``GET /health``,
``/v1/models`` and ``/metrics``. Prints ``{"zero": "http://127.0.0.1:PORT"}``
on stdout once listening; serves until SIGTERM/SIGINT (or, with ``--exit-on-stdin-eof``, until standard input closes).

``--ttft-ms`` and ``--itl-ms`` (default 0: no sleeping at all) turn it into a fixed-latency
backend: the response (headers, role chunk and first token together) waits ``ttft-ms``,
then each further token ``itl-ms``; a non-streamed answer waits ``ttft + (n-1) * itl``.
``/metrics`` counts the completions served (``zero_requests_total``), so a benchmark can
check how a proxy spread its requests.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, cast

import orjson
from aiohttp import web

MAX_TOKENS_CAP = 4096


def make_app(default_tokens: int = 16, ttft_s: float = 0.0, itl_s: float = 0.0) -> web.Application:
    served = [0]
    tick: dict[str, Any] = {"fut": None, "at": 0.0}

    async def next_step() -> None:
        """Wait for the next decode step: one shared timer every ``itl_s`` for all
        running streams (like an engine's batch step, and far cheaper than a timer per
        token on a loaded core); the first gap of a stream can be shorter than ``itl_s``."""
        fut = tick["fut"]
        if fut is None or fut.done():
            loop = asyncio.get_running_loop()
            fut = tick["fut"] = loop.create_future()
            tick["at"] = at = max(loop.time(), tick["at"] + itl_s)
            loop.call_at(at, _resolve, fut)
        await fut

    async def completions(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        chat = request.path.endswith("/chat/completions")
        n = max(1, min(int(body.get("max_tokens") or body.get("max_completion_tokens") or default_tokens),
                       MAX_TOKENS_CAP))
        model = body.get("model", "zero")
        served[0] += 1
        head = {"id": "cmpl-zero", "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": model}
        usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        if not body.get("stream"):
            if ttft_s or itl_s:
                await asyncio.sleep(ttft_s + itl_s * (n - 1))
            choice = ({"index": 0, "message": {"role": "assistant", "content": " x" * n}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": " x" * n, "finish_reason": "length"})
            return web.json_response({**head, "object": "chat.completion" if chat else "text_completion",
                                      "choices": [choice], "usage": usage}, dumps=lambda o: orjson.dumps(o).decode())
        if ttft_s:
            await asyncio.sleep(ttft_s)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        role = b""
        if chat:
            role = b"data: " + orjson.dumps({**head, "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}) + b"\n\n"
            if not ttft_s:
                await resp.write(role)
                role = b""
        token = last = b""
        for i in range(n):
            if i < n - 1 and not token:
                token = b"data: " + orjson.dumps({**head, "choices": [
                    {"index": 0, "delta": {"content": " x"}, "finish_reason": None} if chat
                    else {"index": 0, "text": " x", "finish_reason": None}]}) + b"\n\n"
            if i == n - 1:
                last = b"data: " + orjson.dumps({**head, "choices": [
                    {"index": 0, "delta": {"content": " x"}, "finish_reason": "length"} if chat
                    else {"index": 0, "text": " x", "finish_reason": "length"}]}) + b"\n\n"
            if i and itl_s:
                await next_step()
            await resp.write(role + (last or token))
            role = b""
        tail = b""
        if (body.get("stream_options") or {}).get("include_usage"):
            tail = b"data: " + orjson.dumps({**head, "choices": [], "usage": usage}) + b"\n\n"
        await resp.write(tail + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def typed_events(request: web.Request) -> web.StreamResponse:
        """``/v1/responses`` and ``/v1/messages``, streamed: the events of each API's
        grammar (an opening event, one delta per token, the closing events with usage)."""
        body = orjson.loads(await request.read())
        n = max(1, min(int(body.get("max_output_tokens") or body.get("max_tokens") or default_tokens),
                       MAX_TOKENS_CAP))
        served[0] += 1
        if not body.get("stream"):
            raise web.HTTPBadRequest(text="zero serves these APIs streamed only")
        first, token, last = (_responses_events if request.path == "/v1/responses" else _messages_events)(
            body.get("model", "zero"), n)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        await resp.write(first)
        for i in range(n):
            await resp.write(token + (last if i == n - 1 else b""))
        await resp.write_eof()
        return resp

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "zero", "object": "model"}]})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=f"zero_requests_total {served[0]}\n", content_type="text/plain")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/responses", typed_events)
    app.router.add_post("/v1/messages", typed_events)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    return app


def _event(kind: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **obj}) + b"\n\n"


def _responses_events(model: str, n: int) -> tuple[bytes, bytes, bytes]:
    """A Responses stream's opening events, one token's delta, its closing events."""
    response = {"id": "resp_zero", "object": "response", "model": model, "status": "in_progress", "output": []}
    usage = {"input_tokens": 1, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": n,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n + 1}
    where = {"item_id": "msg_zero", "output_index": 0, "content_index": 0}
    part = {"type": "output_text", "text": " x" * n, "annotations": []}
    item = {"id": "msg_zero", "type": "message", "role": "assistant", "status": "completed", "content": [part]}
    first = _event("response.created", {"response": response}) + \
        _event("response.in_progress", {"response": response}) + \
        _event("response.output_item.added", {"output_index": 0, "item": {**item, "status": "in_progress",
                                                                           "content": []}}) + \
        _event("response.content_part.added", {**where, "part": {**part, "text": ""}})
    token = _event("response.output_text.delta", {**where, "delta": " x"})
    last = _event("response.output_text.done", {**where, "text": " x" * n}) + \
        _event("response.content_part.done", {**where, "part": part}) + \
        _event("response.output_item.done", {"output_index": 0, "item": item}) + \
        _event("response.completed", {"response": {**response, "status": "completed", "output": [item],
                                                   "usage": usage}})
    return first, token, last


def _messages_events(model: str, n: int) -> tuple[bytes, bytes, bytes]:
    """A Messages stream's opening events, one token's delta, its closing events."""
    message: dict[str, Any] = {"id": "msg_zero", "type": "message", "role": "assistant", "model": model, "content": [],
               "stop_reason": None, "usage": {"input_tokens": 1, "output_tokens": 0}}
    first = _event("message_start", {"message": message}) + \
        _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    token = _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": " x"}})
    last = _event("content_block_stop", {"index": 0}) + \
        _event("message_delta", {"delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": n}}) + \
        _event("message_stop", {})
    return first, token, last


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


async def _serve(port: int, tokens: int, exit_on_eof: bool, ttft_s: float = 0.0, itl_s: float = 0.0) -> None:
    runner = web.AppRunner(make_app(tokens, ttft_s, itl_s), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, backlog=1024)
    await site.start()
    print(json.dumps({"zero": f"http://127.0.0.1:{runner.addresses[0][1]}"}), flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    def watch() -> None:
        stdin = cast(io.BufferedReader, sys.stdin.buffer)
        try:
            while stdin.read1(4096):
                pass
        except (OSError, ValueError):
            pass
        loop.call_soon_threadsafe(stop.set)

    if exit_on_eof:
        threading.Thread(target=watch, daemon=True).start()
    await stop.wait()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.zero", description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=16, help="output tokens when the request sets no max_tokens")
    ap.add_argument("--ttft-ms", type=float, default=0.0, help="wait this long before the first token")
    ap.add_argument("--itl-ms", type=float, default=0.0, help="wait this long between tokens")
    ap.add_argument("--exit-on-stdin-eof", action="store_true", help="exit when standard input closes")
    args = ap.parse_args(argv)
    run: Callable[[Coroutine[Any, Any, None]], None]
    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    run(_serve(args.port, args.tokens, args.exit_on_stdin_eof, args.ttft_ms / 1000, args.itl_ms / 1000))
    return 0


if __name__ == "__main__":
    sys.exit(main())
