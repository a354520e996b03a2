"""A simulated OpenAI-compatible inference server (aiohttp), for demos and tests.

It answers ``/v1/chat/completions`` and ``/v1/completions`` (streamed as SSE or not,
with ``usage``, also as a final chunk when ``stream_options.include_usage`` is true),
``/v1/models``, ``/health`` and ``/metrics``. Timing: the first token arrives after
``ttft_base_s + prefill_s_per_token * prompt_tokens`` seconds, then one token every
``itl_s`` seconds. A "token" here is 4 bytes of prompt text (rounded up), the usual
rule of thumb for English BPE vocabularies (OpenAI tokenizer docs: "one token
generally corresponds to ~4 characters of text").

The server speaks only HTTP; the gateway never imports it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

BYTES_PER_TOKEN = 4


@dataclass(slots=True)
class SimBackendConfig:
    """One simulated backend. Times in seconds; ``port`` 0 picks a free port."""

    name: str
    models: list[str] = field(default_factory=lambda: ["demo-model"])
    ttft_base_s: float = 0.02
    prefill_s_per_token: float = 0.00002
    itl_s: float = 0.01
    max_tokens_default: int = 64
    host: str = "127.0.0.1"
    port: int = 0


def count_prompt_tokens(data: dict[str, Any]) -> int:
    """Prompt length in simulator tokens (4 bytes each, at least 1)."""
    n = 0
    if "messages" in data:
        for m in data.get("messages") or []:
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, str):
                n += len(c.encode())
            elif isinstance(c, list):
                n += sum(len(p.get("text", "").encode()) for p in c if isinstance(p, dict))
    else:
        p = data.get("prompt")
        if isinstance(p, str):
            n += len(p.encode())
        elif isinstance(p, list):
            n += sum(len(x.encode()) if isinstance(x, str) else BYTES_PER_TOKEN for x in p)
    return max(1, -(-n // BYTES_PER_TOKEN))


def _word(i: int) -> str:
    return ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit")[i % 8] + " "


class SimBackend:
    """State and handlers of one simulated backend."""

    def __init__(self, cfg: SimBackendConfig) -> None:
        self.cfg = cfg
        self.running = 0
        self.requests_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._ids = itertools.count()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(self, request: web.Request) -> web.Response:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "loadtest.sim"} for m in self.cfg.models]
        return web.json_response({"object": "list", "data": data})

    async def metrics(self, request: web.Request) -> web.Response:
        lines = [
            "# TYPE sim_requests_running gauge", f"sim_requests_running {self.running}",
            "# TYPE sim_requests_total counter", f"sim_requests_total {self.requests_total}",
            "# TYPE sim_prompt_tokens_total counter", f"sim_prompt_tokens_total {self.prompt_tokens_total}",
            "# TYPE sim_generation_tokens_total counter", f"sim_generation_tokens_total {self.generation_tokens_total}",
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        try:
            data = orjson.loads(await request.read())
            assert isinstance(data, dict)
        except (orjson.JSONDecodeError, AssertionError):
            return _error(400, "invalid JSON body")
        model = data.get("model")
        if model not in self.cfg.models:
            return _error(404, f"The model `{model}` does not exist.")
        prompt_tokens = count_prompt_tokens(data)
        max_tokens = data.get("max_completion_tokens") or data.get("max_tokens") or self.cfg.max_tokens_default
        stream = bool(data.get("stream"))
        include_usage = bool((data.get("stream_options") or {}).get("include_usage"))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                 "total_tokens": prompt_tokens + max_tokens, "prompt_tokens_details": {"cached_tokens": 0}}
        ttft = self.cfg.ttft_base_s + self.cfg.prefill_s_per_token * prompt_tokens
        self.running += 1
        self.requests_total += 1
        self.prompt_tokens_total += prompt_tokens
        try:
            if not stream:
                await asyncio.sleep(ttft + self.cfg.itl_s * (max_tokens - 1))
                self.generation_tokens_total += max_tokens
                text = "".join(_word(i) for i in range(max_tokens))
                if chat:
                    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                              "finish_reason": "length"}
                    obj = "chat.completion"
                else:
                    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
                    obj = "text_completion"
                return web.json_response({"id": rid, "object": obj, "created": created, "model": model,
                                          "choices": [choice], "usage": usage}, dumps=lambda o: orjson.dumps(o).decode())
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            obj = "chat.completion.chunk" if chat else "text_completion"
            await asyncio.sleep(ttft)
            for i in range(max_tokens):
                if i:
                    await asyncio.sleep(self.cfg.itl_s)
                last = i == max_tokens - 1
                if chat:
                    delta: dict[str, Any] = {"content": _word(i)}
                    if i == 0:
                        delta["role"] = "assistant"
                    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": "length" if last else None}
                else:
                    choice = {"index": 0, "text": _word(i), "logprobs": None, "finish_reason": "length" if last else None}
                chunk = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
                if include_usage:
                    chunk["usage"] = None
                await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
                self.generation_tokens_total += 1
            if include_usage:
                await resp.write(b"data: " + orjson.dumps({"id": rid, "object": obj, "created": created, "model": model,
                                                           "choices": [], "usage": usage}) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            self.running -= 1


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
    return web.json_response(body, status=status)


async def start_backends(configs: list[SimBackendConfig]) -> tuple[list[web.AppRunner], dict[str, str]]:
    """Start each backend on its own loopback port. Returns the runners (clean them
    up to stop) and ``{name: base_url}``."""
    runners: list[web.AppRunner] = []
    urls: dict[str, str] = {}
    for cfg in configs:
        runner = web.AppRunner(SimBackend(cfg).app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, cfg.host, cfg.port)
        await site.start()
        port = runner.addresses[0][1]
        runners.append(runner)
        urls[cfg.name] = f"http://{cfg.host}:{port}"
    return runners, urls
