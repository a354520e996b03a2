"""Gateway CPU per 1,000 requests, and where it goes.

    python -m loadtest.cpu_profile [--policy estimated_ttft] [--requests 2000] [--profile OUT.prof]

Starts two zero-delay backends (:mod:`loadtest.zero`) and ``python -m gateway`` in
front of them (under ``cProfile`` with ``--profile``), then drives, from this process,
the two scenarios of the data-plane issue: chat completions streamed with 64 tokens at
64 concurrent, and non-streamed with ``max_tokens`` 16 at 64 concurrent. Prints the
gateway process's CPU seconds (utime + stime from ``/proc``) per 1,000 requests. The
profile, when asked for, can be read with ``python -m pstats OUT.prof``. Traffic stays
on 127.0.0.1; each scenario is bounded by ``--requests``.

``--callgrind`` runs the gateway under ``valgrind --tool=callgrind`` instead and prints
user-space **instructions per request** of each scenario (32 concurrent; a third
scenario streams 64 tokens from backends with 50 ms TTFT and 10 ms between tokens at
8 concurrent, one event per read). Counters are zeroed after a warm-up batch
(``callgrind_control -z``) and dumped after the measured one, so start-up is not
counted. Instruction counts do not move with the machine's load or clock (repeat runs
agree within about 1%), which CPU seconds on a shared VM do not: use it to compare two
versions of the code; use the CPU seconds, or ``python -m loadtest.peers``, for the
absolute cost (kernel time, which callgrind does not see, is about a fifth of it).
Needs the ``valgrind`` binary (Debian: ``valgrind``); about 5 minutes. ``--apis`` adds
two scenarios: the streamed shape as a Responses and as an Anthropic Messages request
(the zero backends answer them in each API's typed-event grammar).

``--tracing RATIO`` runs the gateway with OpenTelemetry tracing on (``tracing`` in
``backends.yaml``, sample ratio ``RATIO``; needs the ``otel`` extra), exporting over
OTLP/HTTP to a sink in this process that answers every export with 200, so that the
cost of making, batching and encoding the spans is counted with the gateway's.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from loadtest.procs import cpu_seconds, free_port, start_zero, stop, wait_http

CHAT = "/v1/chat/completions"


async def _load(url: str, n: int, concurrency: int, stream: bool, tokens: int, model: str = "m",
                path: str = "/v1/chat/completions") -> None:
    messages = [{"role": "user", "content": "hello " * 50}]
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": tokens, "stream": stream}
    if path == "/v1/responses":
        body = {"model": model, "input": messages, "max_output_tokens": tokens, "stream": stream, "store": False}
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def one() -> None:
            async with sem:
                async with s.post(url + path, json=body) as r:
                    if r.status != 200:
                        raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
                    async for _ in r.content.iter_any():
                        pass

        await asyncio.gather(*(one() for _ in range(n)))


class _Sink(BaseHTTPRequestHandler):
    """Takes an OTLP/HTTP export and answers 200 with an empty (valid) response."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


@contextmanager
def _tracing(cfg: dict[str, Any], ratio: float | None) -> Iterator[None]:
    """With ``ratio``, ``cfg`` traces at that sample ratio to an OTLP sink on 127.0.0.1
    served from a thread of this process while the context is open."""
    if ratio is None:
        yield
        return
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    cfg["tracing"] = {"enabled": True, "sample_ratio": ratio,
                      "endpoint": f"http://127.0.0.1:{server.server_address[1]}/v1/traces"}
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


def _callgrind_total(out_prefix: str) -> int:
    """The instruction total of the newest callgrind dump ``OUT_PREFIX*``."""
    files = sorted(glob.glob(out_prefix + "*"), key=os.path.getmtime)
    if not files:
        raise RuntimeError("callgrind wrote no dump")
    m = re.search(r"^(?:summary|totals): (\d+)", Path(files[-1]).read_text(errors="replace"), re.M)
    if m is None:
        raise RuntimeError(f"no instruction total in {files[-1]}")
    return int(m.group(1))


def callgrind(args: argparse.Namespace) -> int:
    """The ``--callgrind`` mode (see the module doc)."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("valgrind is not installed (`apt-get install valgrind`)", file=sys.stderr)
        return 2
    zeros = [start_zero(), start_zero()]
    slow = [start_zero(ttft_ms=50, itl_ms=10), start_zero(ttft_ms=50, itl_ms=10)]
    tmp = Path(tempfile.mkdtemp(prefix="tg-cg-"))
    out = str(tmp / "callgrind.out")
    cfg = {"routing": {"policy": args.policy, "scrape_interval_s": 0}, "health": {"interval_s": 3600},
           "backends": [{"name": f"z{i}", "url": u, "models": ["m"]} for i, (_, u) in enumerate(zeros)]
           + [{"name": f"s{i}", "url": u, "models": ["slow"]} for i, (_, u) in enumerate(slow)]}
    with _tracing(cfg, args.tracing):
        return _callgrind(args, cfg, tmp, out, zeros + slow)


def _callgrind(args: argparse.Namespace, cfg: dict[str, Any], tmp: Path, out: str,
               backends: list[tuple[subprocess.Popen, str]]) -> int:
    (tmp / "gw.yaml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    gw = subprocess.Popen(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--dump-instr=no",
                           sys.executable, "-m", "gateway", "--config", str(tmp / "gw.yaml"), "--port", str(port),
                           "--log-level", "warning"], stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    n = args.requests
    traced = f", tracing at {args.tracing:g}" if args.tracing is not None else ""
    try:
        wait_http(url + "/ready", 300.0, gw)
        print(f"| scenario (policy {args.policy}{traced}, under callgrind) | requests | instructions per request |")
        print("|---|---|---|")
        for label, model, stream, tokens, conc, count, path in (
                ("non-streaming, max_tokens 16, 32 concurrent", "m", False, 16, 32, n, CHAT),
                ("streaming, 64 tokens, 32 concurrent", "m", True, 64, 32, n, CHAT),
                ("streaming, 64 tokens at 10 ms ITL, 8 concurrent", "slow", True, 64, 8, max(n // 16, 16), CHAT),
                *(((f"{name} streaming, 64 tokens, 32 concurrent", "m", True, 64, 32, n, p)
                   for name, p in (("Responses", "/v1/responses"), ("Messages", "/v1/messages"))) if args.apis
                  else ())):
            asyncio.run(_load(url, min(200, count), conc, stream, tokens, model, path))  # warm-up
            subprocess.run(["callgrind_control", "-z", str(gw.pid)], capture_output=True, timeout=60)
            asyncio.run(_load(url, count, conc, stream, tokens, model, path))
            before = len(glob.glob(out + "*"))
            subprocess.run(["callgrind_control", "-d", str(gw.pid)], capture_output=True, timeout=60)
            deadline = time.monotonic() + 60
            while len(glob.glob(out + "*")) <= before and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(0.5)  # let the dump finish writing
            print(f"| {label} | {count} | {_callgrind_total(out) / count / 1000:.1f}k |", flush=True)
    finally:
        gw.send_signal(signal.SIGINT)
        try:
            gw.wait(120)
        except subprocess.TimeoutExpired:
            gw.kill()
            gw.wait(10)
        for p, _ in backends:
            stop(p)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.cpu_profile", description=__doc__.split("\n")[0])
    ap.add_argument("--policy", default="estimated_ttft")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--profile", help="write the gateway's cProfile output here")
    ap.add_argument("--callgrind", action="store_true",
                    help="count the gateway's instructions per request under valgrind instead (see above)")
    ap.add_argument("--apis", action="store_true",
                    help="with --callgrind: also stream Responses and Messages requests (64 tokens, 32 concurrent)")
    ap.add_argument("--tracing", type=float, metavar="RATIO",
                    help="trace with OpenTelemetry at this sample ratio (0..1) to an OTLP sink (see above)")
    args = ap.parse_args(argv)
    if args.callgrind:
        return callgrind(args)
    zeros = [start_zero(), start_zero()]
    tmp = Path(tempfile.mkdtemp(prefix="tg-cpu-"))
    cfg = {"routing": {"policy": args.policy, "scrape_interval_s": 0}, "health": {"interval_s": 60},
           "backends": [{"name": f"z{i}", "url": u, "models": ["m"]} for i, (_, u) in enumerate(zeros)]}
    with _tracing(cfg, args.tracing):
        return _cpu_seconds(args, cfg, tmp, zeros)


def _cpu_seconds(args: argparse.Namespace, cfg: dict[str, Any], tmp: Path,
                 zeros: list[tuple[subprocess.Popen, str]]) -> int:
    (tmp / "gw.yaml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    prof = ["-m", "cProfile", "-o", args.profile] if args.profile else []
    gw = subprocess.Popen([sys.executable, *prof, "-m", "gateway", "--config", str(tmp / "gw.yaml"), "--port",
                           str(port), "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/ready", 60.0, gw)
        print(f"| scenario (policy {args.policy}) | requests | gateway CPU s per 1,000 requests |")
        print("|---|---|---|")
        for label, stream, tokens in (("streaming, 64 tokens, 64 concurrent", True, 64),
                                      ("non-streaming, max_tokens 16, 64 concurrent", False, 16)):
            asyncio.run(_load(url, 200, 64, stream, tokens))  # warm-up: connections, caches
            c0 = cpu_seconds(gw.pid)
            asyncio.run(_load(url, args.requests, 64, stream, tokens))
            cpu = cpu_seconds(gw.pid) - c0
            print(f"| {label} | {args.requests} | {cpu / args.requests * 1000:.2f} |", flush=True)
    finally:
        gw.send_signal(signal.SIGINT)  # a clean exit, so that cProfile writes its file
        gw.wait(60)
        for p, _ in zeros:
            stop(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
