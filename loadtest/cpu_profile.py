"""Gateway CPU per 1,000 requests, and where it goes.

    python -m loadtest.cpu_profile [--policy estimated_ttft] [--requests 2000] [--profile OUT.prof]

Starts two zero-delay backends (:mod:`loadtest.zero`) and ``python -m gateway`` in
front of them (under ``cProfile`` with ``--profile``), then drives, from this process,
the two scenarios of the data-plane issue: chat completions streamed with 64 tokens at
64 concurrent, and non-streamed with ``max_tokens`` 16 at 64 concurrent. Prints the
gateway process's CPU seconds (utime + stime from ``/proc``) per 1,000 requests. The
profile, when asked for, can be read with ``python -m pstats OUT.prof``. Traffic stays
on 127.0.0.1; each scenario is bounded by ``--requests``.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp
import yaml

from loadtest.procs import cpu_seconds, free_port, start_zero, stop, wait_http


async def _load(url: str, n: int, concurrency: int, stream: bool, tokens: int) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello " * 50}], "max_tokens": tokens,
            "stream": stream}
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def one() -> None:
            async with sem:
                async with s.post(url + "/v1/chat/completions", json=body) as r:
                    if r.status != 200:
                        raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
                    async for _ in r.content.iter_any():
                        pass

        await asyncio.gather(*(one() for _ in range(n)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.cpu_profile", description=__doc__.split("\n")[0])
    ap.add_argument("--policy", default="estimated_ttft")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--profile", help="write the gateway's cProfile output here")
    args = ap.parse_args(argv)
    zeros = [start_zero(), start_zero()]
    tmp = Path(tempfile.mkdtemp(prefix="tg-cpu-"))
    cfg = {"routing": {"policy": args.policy, "scrape_interval_s": 0}, "health": {"interval_s": 60},
           "backends": [{"name": f"z{i}", "url": u, "models": ["m"]} for i, (_, u) in enumerate(zeros)]}
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
