"""The HTTP side of the benchmark client: one OpenAI request with SSE timing, and the
probes that read a turbo-gateway's ``/metrics``.

Talks to any OpenAI-compatible server over HTTP only (``aiohttp``, one session per run,
no connection limit). Each streamed text chunk is timestamped with
``time.perf_counter()`` as its line is read, like vLLM's benchmark request functions.

Error kinds recorded in :attr:`RequestRecord.error`:

| kind | meaning |
|---|---|
| ``http_<status>`` | the server answered with that non-200 status |
| ``connect`` | the TCP connection could not be made |
| ``timeout`` | the request exceeded ``timeout_s`` (total, send to last byte) |
| ``disconnected`` | the connection was cut mid-response (truncated body) |
| ``stream_error`` | an SSE event carried an OpenAI ``error`` object |
| ``incomplete`` | the stream ended without ``data: [DONE]`` |
| ``bad_response`` | a body or event that is not the expected JSON |
| ``client_error`` | any other ``aiohttp`` client error |
| ``cancelled`` | the run's time bound cancelled the request |
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from loadtest.metrics import RequestRecord
from loadtest.workloads import Session

BACKEND_HEADER = "x-turbo-backend"
ROUTE_HEADER = "x-turbo-route"
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses",
         "responses_chained": "/v1/responses", "embeddings": "/v1/embeddings"}


@dataclass(slots=True)
class ClientOptions:
    """How requests are made. ``endpoint``: ``chat``, ``completions``, ``responses``
    (each turn sends the whole conversation), ``responses_chained`` (each turn sends
    its own input and the previous turn's ``previous_response_id``: the server keeps
    the conversation) or ``embeddings`` (the turn's prompt embedded, never streamed); ``model``:
    the model id sent; ``stream`` (default) with ``stream_options.include_usage`` so the
    last event carries ``usage`` (and ``cached_tokens``); ``ignore_eos`` makes the
    server generate exactly ``max_tokens``; ``timeout_s``: total time bound of one
    request (seconds); ``api_key`` sent as a Bearer token; ``extra_body`` merged into
    every request body."""

    model: str = "demo-model"
    endpoint: str = "chat"
    stream: bool = True
    ignore_eos: bool = True
    timeout_s: float = 300.0
    api_key: str | None = None
    extra_body: dict[str, Any] | None = None


def build_body(opts: ClientOptions, session: Session, turn: int, history: list[str],
               previous_id: str | None = None) -> dict[str, Any]:
    """The request body of ``session.turns[turn]``; ``history`` holds the previous
    turns' answers (multi-turn: user, assistant, ..., user); ``previous_id``: the
    previous turn's response id (``responses_chained``)."""
    t = session.turns[turn]
    if opts.endpoint.startswith("responses") or opts.endpoint == "embeddings":
        return _other_api_body(opts, session, turn, history, previous_id)
    body: dict[str, Any] = {"model": opts.model, "max_tokens": t.output_tokens, "stream": opts.stream}
    if opts.ignore_eos:
        body["ignore_eos"] = True
    if opts.stream:
        body["stream_options"] = {"include_usage": True}
    if opts.endpoint == "chat":
        msgs: list[dict[str, str]] = []
        if session.system:
            msgs.append({"role": "system", "content": session.system})
        for i in range(turn):
            msgs.append({"role": "user", "content": session.turns[i].text})
            msgs.append({"role": "assistant", "content": history[i]})
        msgs.append({"role": "user", "content": t.text})
        body["messages"] = msgs
    else:
        parts = [session.system or ""]
        for i in range(turn):
            parts += [session.turns[i].text, history[i]]
        parts.append(t.text)
        body["prompt"] = "".join(parts)
    if opts.extra_body:
        body.update(opts.extra_body)
    return body


def _other_api_body(opts: ClientOptions, session: Session, turn: int, history: list[str],
                    previous_id: str | None) -> dict[str, Any]:
    t = session.turns[turn]
    body: dict[str, Any] = {"model": opts.model}
    if opts.endpoint == "embeddings":
        body["input"] = (session.system or "") + t.text
    else:
        body.update(max_output_tokens=t.output_tokens, stream=opts.stream)
        if opts.ignore_eos:
            body["ignore_eos"] = True
        if session.system:
            body["instructions"] = session.system
        if opts.endpoint == "responses_chained" and previous_id is not None:
            body.update(previous_response_id=previous_id, input=t.text)
        else:
            items: list[dict[str, str]] = []
            for i in range(turn):
                items += [{"role": "user", "content": session.turns[i].text},
                          {"role": "assistant", "content": history[i]}]
            body["input"] = [*items, {"role": "user", "content": t.text}]
    if opts.extra_body:
        body.update(opts.extra_body)
    return body


_RESPONSES_USAGE = ("input", "output")


def _text_chunk(rec: RequestRecord, st: float, last: float | None) -> float:
    """A text chunk arrived now (the request was sent at ``st``, the previous chunk at
    ``last``): its TTFT or inter-token gap goes to ``rec``. Returns now."""
    now = time.perf_counter()
    if last is None:
        rec.ttft_s = now - st
    else:
        rec.itl_s.append(now - last)
    rec.chunks += 1
    return now


def _response_text(obj: dict[str, Any]) -> str:
    return "".join(c.get("text") or "" for item in obj.get("output") or () if isinstance(item, dict)
                   for c in item.get("content") or () if isinstance(c, dict))


async def _read_other(resp: aiohttp.ClientResponse, opts: ClientOptions, rec: RequestRecord, st: float,
                      keep_text: bool) -> None:
    """Read a Responses or embeddings answer into ``rec``."""
    if opts.endpoint == "embeddings" or not opts.stream:
        data = orjson.loads(await resp.read())
        rec.e2e_s = rec.ttft_s = time.perf_counter() - st
        if opts.endpoint == "embeddings":
            _take_usage(rec, data.get("usage"))
            rec.output_tokens = 0
            return
        text = _response_text(data)
        rec.chunks = 1 if text else 0
        _take_usage(rec, data.get("usage"), _RESPONSES_USAGE)
        rec.response_id = data.get("id")
        if keep_text:
            rec.output_text = text
        return
    parts: list[str] = []
    last = None
    done = False
    async for line in resp.content:
        if not line.startswith(b"data:"):
            continue
        obj = orjson.loads(line[5:].strip())
        kind = obj.get("type")
        if kind == "error" or ("error" in obj and kind is None):
            rec.error, rec.error_detail = "stream_error", str(obj)[:500]
            return
        if kind == "response.output_text.delta":
            last = _text_chunk(rec, st, last)
            if keep_text:
                parts.append(obj.get("delta") or "")
        elif kind in ("response.completed", "response.incomplete", "response.failed"):
            response = obj.get("response") or {}
            _take_usage(rec, response.get("usage"), _RESPONSES_USAGE)
            rec.response_id = response.get("id")
            done = kind != "response.failed"
    rec.e2e_s = (last if last is not None else time.perf_counter()) - st
    if not done:
        rec.error = "incomplete"
    if keep_text:
        rec.output_text = "".join(parts)


def _chunk_text(obj: dict[str, Any]) -> str:
    out = ""
    for c in obj.get("choices") or ():
        if c.get("text"):
            out += c["text"]
        delta = c.get("delta") or {}
        out += (delta.get("content") or "") + (delta.get("reasoning_content") or delta.get("reasoning") or "")
    return out


def _take_usage(rec: RequestRecord, usage: Any, prefix: tuple[str, str] = ("prompt", "completion")) -> None:
    """``rec``'s token counts from a ``usage`` object: OpenAI's ``prompt_tokens``,
    ``completion_tokens`` and ``prompt_tokens_details.cached_tokens``, or, with
    ``prefix`` ``("input", "output")``, the Responses API's names for them."""
    if not isinstance(usage, dict):
        return
    prompt, completion = prefix
    if isinstance(usage.get(f"{prompt}_tokens"), int):
        rec.prompt_tokens = usage[f"{prompt}_tokens"]
    if isinstance(usage.get(f"{completion}_tokens"), int):
        rec.output_tokens = usage[f"{completion}_tokens"]
    details = usage.get(f"{prompt}_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        rec.cached_tokens = details["cached_tokens"]


async def send(http: aiohttp.ClientSession, base_url: str, opts: ClientOptions, body: dict[str, Any],
               rec: RequestRecord, t0: float, keep_text: bool = False) -> None:
    """Send one request and fill ``rec`` (times relative to ``t0``, a
    ``time.perf_counter()`` value). Never raises except CancelledError (then ``rec``
    says ``cancelled``)."""
    headers = {"Content-Type": "application/json"}
    if opts.api_key:
        headers["Authorization"] = f"Bearer {opts.api_key}"
    text_parts: list[str] = []
    st = time.perf_counter()
    rec.start_s = st - t0
    try:
        async with asyncio.timeout(opts.timeout_s):
            async with http.post(base_url.rstrip("/") + PATHS[opts.endpoint], data=orjson.dumps(body),
                                 headers=headers) as resp:
                rec.status = resp.status
                rec.backend = resp.headers.get(BACKEND_HEADER)
                rec.route = resp.headers.get(ROUTE_HEADER)
                if resp.status != 200:
                    rec.error = f"http_{resp.status}"
                    rec.error_detail = (await resp.text(errors="replace"))[:500]
                    return
                if opts.endpoint not in ("chat", "completions"):
                    return await _read_other(resp, opts, rec, st, keep_text)
                if not opts.stream:
                    data = orjson.loads(await resp.read())
                    rec.e2e_s = time.perf_counter() - st
                    choices = data.get("choices") or [{}]
                    text = choices[0].get("text") or (choices[0].get("message") or {}).get("content") or ""
                    rec.chunks = 1 if text else 0
                    _take_usage(rec, data.get("usage"))
                    if keep_text:
                        rec.output_text = text
                    return
                last = None
                done = False
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                        break
                    obj = orjson.loads(payload)
                    if "error" in obj:
                        rec.error = "stream_error"
                        rec.error_detail = str(obj["error"])[:500]
                        return
                    text = _chunk_text(obj)
                    if text:
                        last = _text_chunk(rec, st, last)
                        if keep_text:
                            text_parts.append(text)
                    if obj.get("usage"):
                        _take_usage(rec, obj["usage"])
                if last is not None:
                    rec.e2e_s = last - st
                if not done:
                    rec.error = "incomplete"
                elif last is None:
                    rec.e2e_s = time.perf_counter() - st  # no text at all: TTFT stays unset
                if keep_text:
                    rec.output_text = "".join(text_parts)
    except TimeoutError:
        rec.error = "timeout"
    except asyncio.CancelledError:
        rec.error = "cancelled"
        raise
    except aiohttp.ClientConnectorError as e:
        rec.error, rec.error_detail = "connect", str(e)[:500]
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError) as e:
        rec.error, rec.error_detail = "disconnected", str(e)[:500]
    except aiohttp.ClientError as e:
        rec.error, rec.error_detail = "client_error", f"{type(e).__name__}: {e}"[:500]
    except (orjson.JSONDecodeError, ValueError, AttributeError, TypeError) as e:
        rec.error, rec.error_detail = "bad_response", f"{type(e).__name__}: {e}"[:500]


# --- turbo-gateway /metrics -----------------------------------------------------------------


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples of a Prometheus text exposition: ``(name, labels, value)``. Handles the
    subset prometheus_client writes (no escaped quotes inside label values)."""
    out = []
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        head, _, value = line.rpartition(" ")
        labels: dict[str, str] = {}
        name = head
        if "{" in head:
            name, _, rest = head.partition("{")
            for part in rest.rstrip("}").split('",'):
                k, _, v = part.partition("=")
                if k:
                    labels[k.strip()] = v.strip().strip('"')
        try:
            out.append((name, labels, float(value)))
        except ValueError:
            continue
    return out


BACKEND_GAUGES = ("in_flight", "queued_prefill_tokens", "running_streams", "kv_tokens")


async def fetch_metrics(http: aiohttp.ClientSession, base_url: str, timeout_s: float = 5.0) -> str | None:
    """``GET {base_url}/metrics`` as text, or ``None`` when it fails."""
    try:
        async with asyncio.timeout(timeout_s):
            async with http.get(base_url.rstrip("/") + "/metrics") as resp:
                if resp.status != 200:
                    return None
                return await resp.text()
    except (TimeoutError, aiohttp.ClientError, UnicodeDecodeError):
        return None


def backend_load(samples: list[tuple[str, dict[str, str], float]]) -> dict[str, dict[str, float]]:
    """Per-backend ``turbo_gateway_backend_*`` gauges of one scrape:
    ``{backend: {in_flight, queued_prefill_tokens, running_streams, kv_tokens}}``."""
    out: dict[str, dict[str, float]] = {}
    for name, labels, v in samples:
        if name.startswith("turbo_gateway_backend_") and "backend" in labels:
            key = name[len("turbo_gateway_backend_"):]
            if key in BACKEND_GAUGES:
                out.setdefault(labels["backend"], {})[key] = v
    return out


def gateway_info(samples: list[tuple[str, dict[str, str], float]]) -> dict[str, Any] | None:
    """What a turbo-gateway's ``/metrics`` says about itself (``None`` when the target
    is not one): its backends, the policy seen in routing decisions, and a version
    from its ``turbo_gateway_build_info`` metric."""
    if not any(n.startswith("turbo_gateway_") for n, _, _ in samples):
        return None
    info: dict[str, Any] = {"backends": sorted({lab["backend"] for n, lab, _ in samples
                                                if n == "turbo_gateway_backend_healthy" and "backend" in lab})}
    policies = sorted({lab["policy"] for n, lab, v in samples
                       if n.startswith("turbo_gateway_routing_decisions") and "policy" in lab and v > 0})
    if policies:
        info["policy"] = policies[0] if len(policies) == 1 else policies
    for n, lab, _ in samples:
        if n == "turbo_gateway_build_info":
            info["build_info"] = lab
            info["version"] = lab.get("version")
    return info


def policy_from_route(route: str | None) -> str | None:
    """``policy=...`` of an ``x-turbo-route`` header value."""
    for part in (route or "").split(";"):
        k, _, v = part.strip().partition("=")
        if k == "policy":
            return v
    return None
