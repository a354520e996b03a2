"""Streams that survive their backend: a fault benchmark, with and without migration.

``python -m loadtest.migration_bench [--requests 200] [--time-scale 0.3] [--backends 3]``

The first ``--requests`` requests of the Mooncake conversation trace
(:func:`loadtest.traces.load_trace`; prompts capped at ``--max-input`` tokens, outputs at
``--max-output``, ``ignore_eos``), replayed open loop at their arrival times (scaled by
``--time-scale``) as streamed chat completions on a simulated fleet of ``--backends``
engines (``--profile``), one of which crashes (every connection dropped, its state lost) every
``--kill-every`` seconds and comes back ``--down`` seconds later. The same replay runs
twice, each phase on a fresh fleet and gateway with the same crash schedule: with
``migration.enabled: false`` (a stream cut mid-answer ends with an error event) and with
it on (the stream is continued on another backend).

Printed side by side per phase: streams completed and ended in error (cut after their
first byte, or refused before it), TTFT and TPOT p50/p99 of the completed ones (TPOT:
the time after the first token over the tokens after it), goodput (completed requests per
second that met ``--slo-ttft`` and ``--slo-tpot``) and the migrations the gateway
counted. Talks to the gateway over HTTP only.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from typing import Any

import aiohttp

from loadtest.client import parse_prometheus
from loadtest.metrics import percentile
from loadtest.procs import start_gateway, start_sim, stop
from loadtest.report import emit_row, print_rows
from loadtest.traces import load_trace, scale_time, trace_prompt_text

MODEL = "demo-model"


async def _stream(http: aiohttp.ClientSession, url: str, prompt: str, output_tokens: int) -> tuple[str, float, float]:
    """One streamed request: (outcome, TTFT s, TPOT s); outcome ``ok``, ``cut`` (ended
    without ``[DONE]`` after its first byte) or ``refused`` (no 200)."""
    body = {"model": MODEL, "stream": True, "max_tokens": output_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": prompt}]}
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    done = False
    try:
        async with http.post(url + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                await r.read()
                return "refused", 0.0, 0.0
            async for line in r.content:
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
                    last = time.perf_counter()
                    first = first or last
                    tokens += 1
    except (TimeoutError, aiohttp.ClientError):
        pass
    if not done or first is None or last is None:
        return "cut", 0.0, 0.0
    return "ok", first - t0, (last - first) / max(tokens - 1, 1)


async def _phase(migration: bool, args, workdir: str) -> dict[str, Any]:
    procs: list[subprocess.Popen] = []
    try:
        spec = [{"name": f"sim-{i}", "models": [MODEL], "profile": args.profile, "speed": args.speed}
                for i in range(args.backends)]
        sim, urls = start_sim(spec)
        procs.append(sim)
        cfg = {"backends": [{"name": n, "url": u, "models": [MODEL]} for n, u in urls.items()],
               "migration": {"enabled": migration}, "breaker": {"open_s": args.down}}
        gw, url, _ = start_gateway(cfg, workdir=workdir)
        procs.append(gw)
        trace = scale_time(load_trace("mooncake_conversation", args.requests, args.max_input), args.time_scale)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=900)) as http:
            faults = {"crash_after_s": args.kill_every, "crash_every_s": args.kill_every, "crash_down_s": args.down}
            async with http.post(urls["sim-0"] + "/admin/faults", json=faults) as r:
                assert r.status == 200, await r.text()
            t_start = time.perf_counter()

            async def one(i: int) -> tuple[str, float, float]:
                req = trace[i]
                await asyncio.sleep(max(req.arrival_s - (time.perf_counter() - t_start), 0.0))
                prompt = trace_prompt_text(req, i, salt=f"migration-bench-{args.seed}")
                return await _stream(http, url, prompt, min(req.output_tokens, args.max_output) or 1)

            results = await asyncio.gather(*(one(i) for i in range(len(trace))))
            elapsed = time.perf_counter() - t_start
            async with http.get(url + "/metrics") as r:
                metrics = parse_prometheus(await r.text())
        ok = [(ttft, tpot) for outcome, ttft, tpot in results if outcome == "ok"]
        good = [1 for ttft, tpot in ok if ttft <= args.slo_ttft and tpot <= args.slo_tpot]
        return {"migration": "on" if migration else "off", "requests": len(results), "completed": len(ok),
                "cut": sum(1 for o, _, _ in results if o == "cut"),
                "refused": sum(1 for o, _, _ in results if o == "refused"),
                "ttft_p50_ms": percentile([t for t, _ in ok], 50) * 1000,
                "ttft_p99_ms": percentile([t for t, _ in ok], 99) * 1000,
                "tpot_p50_ms": percentile([t for _, t in ok], 50) * 1000,
                "tpot_p99_ms": percentile([t for _, t in ok], 99) * 1000,
                "goodput_per_s": len(good) / elapsed,
                "migrations": sum(v for n, _, v in metrics if n == "turbo_gateway_stream_migrations_total"),
                "stream_errors": sum(v for n, _, v in metrics if n == "turbo_gateway_stream_errors_total")}
    finally:
        for p in reversed(procs):
            stop(p)


def _table(rows: list[dict[str, Any]]) -> str:
    head = ("| migration | requests | completed | ended in error after the first byte | refused | TTFT p50 (ms) "
            "| TTFT p99 (ms) | TPOT p50 (ms) | TPOT p99 (ms) | goodput (req/s) | migrations |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    return head + "".join(
        f"| {r['migration']} | {r['requests']} | {r['completed']} | {r['cut']} | {r['refused']} "
        f"| {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.1f} | {r['tpot_p99_ms']:.1f} "
        f"| {r['goodput_per_s']:.2f} | {r['migrations']:.0f} |\n" for r in rows)


async def _run(args) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="migration-bench-", ignore_cleanup_errors=True) as workdir:
        rows = []
        for migration in (False, True):
            row = await _phase(migration, args, workdir)
            emit_row(row)
            rows.append(row)
        return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.migration_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200, help="trace requests replayed per phase")
    ap.add_argument("--time-scale", type=float, default=0.3, help="arrival times multiplied by this")
    ap.add_argument("--max-input", type=int, default=4096, help="prompt tokens cap (the trace's prefix kept)")
    ap.add_argument("--max-output", type=int, default=256, help="output tokens cap")
    ap.add_argument("--backends", type=int, default=3)
    ap.add_argument("--kill-every", type=float, default=5.0, help="seconds between crashes of sim-0")
    ap.add_argument("--down", type=float, default=1.0, help="seconds sim-0 stays down after each crash")
    ap.add_argument("--profile", default="h100-llama3-8b", help="the simulated engines' profile")
    ap.add_argument("--speed", type=float, default=1.0, help="simulated GPU speed factor")
    ap.add_argument("--slo-ttft", type=float, default=5.0, help="goodput's TTFT bound (s)")
    ap.add_argument("--slo-tpot", type=float, default=0.2, help="goodput's TPOT bound (s)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    rows = asyncio.run(_run(args))
    print_rows(rows, _table(rows), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
