"""LoRA adapter affinity benchmark: many adapters over a few simulated vLLM backends.

``python -m loadtest.lora_bench [--duration 20] [--adapters 20] [--backends 4] [--max-lora 4]``

A simulated fleet (``--backends`` demo engines, started here as a child process), each
serving one base model with every one of ``--adapters`` LoRA adapters registered (as
``--lora-modules`` does), ``max_lora`` adapters per batch, as many adapters' weights in
host memory (vLLM's default ``max_cpu_loras``), ``--load-s`` emulated seconds to read
one adapter's weights. The gateway discovers the adapters (``models: auto``) and scrapes
the engines' ``vllm:lora_requests_info``. ``--streams`` clients keep one streamed
completion open each (closed loop), each request naming an adapter drawn uniformly, with
a prompt of ``--words`` random words and ``--output-tokens`` tokens (``ignore_eos``).

The same workload (same seed) runs once per phase, each on a fresh fleet and gateway:
``round_robin`` and ``least_requests`` (blind to adapters), ``estimated_ttft`` with
``hints.lora_load_s: 0`` (adapter loads cost nothing in the estimate; only a full batch
of adapters does), and ``estimated_ttft`` with the default load cost (adapter affinity).
Printed per phase: requests per second, TTFT mean/p50/p99 (as the client sees it),
adapter weight reads per request (``sim:lora_loads_total`` summed over the fleet) and
the distinct backends that served each adapter (mean and max over the adapters). Talks to the gateway over HTTP
only; the first ``--warmup`` seconds of a phase are not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import tempfile
import time
from typing import Any

import aiohttp

from loadtest.metrics import percentile
from loadtest.procs import start_gateway, start_sim, stop
from loadtest.report import emit_row, print_rows

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()
PHASES = (("round_robin", "round_robin", None), ("least_requests", "least_requests", None),
          ("estimated_ttft, no load cost", "estimated_ttft", 0.0),
          ("estimated_ttft (affinity)", "estimated_ttft", None))


async def _stream(http: aiohttp.ClientSession, url: str, model: str, prompt: str, output_tokens: int,
                  ) -> tuple[float | None, str | None]:
    """One streamed completion: (TTFT s or None on failure, the backend that served it)."""
    body = {"model": model, "stream": True, "max_tokens": output_tokens, "ignore_eos": True, "prompt": prompt}
    t0 = time.perf_counter()
    ttft = None
    try:
        async with http.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                await r.read()
                return None, None
            backend = r.headers.get("x-turbo-backend")
            async for line in r.content:
                if ttft is None and line.startswith(b"data: {"):
                    ttft = time.perf_counter() - t0
    except (TimeoutError, aiohttp.ClientError):
        return None, None
    return ttft, backend


async def _lora_loads(http: aiohttp.ClientSession, urls: dict[str, str]) -> float:
    total = 0.0
    for u in urls.values():
        async with http.get(u + "/metrics") as r:
            for line in (await r.text()).splitlines():
                if line.startswith("sim:lora_loads_total"):
                    total += float(line.rsplit(" ", 1)[1])
    return total


async def _phase(label: str, policy: str, lora_load_s: float | None, args, workdir: str) -> dict[str, Any]:
    procs: list[subprocess.Popen] = []
    adapters = [f"adapter-{i:02d}" for i in range(args.adapters)]
    try:
        lora = {"adapters": adapters, "max_lora": args.max_lora, "load_s": args.load_s}
        spec = [{"name": f"sim-{i}", "models": ["base"], "profile": "demo", "speed": args.speed, "lora": lora}
                for i in range(args.backends)]
        sim, urls = start_sim(spec)
        procs.append(sim)
        hints = {} if lora_load_s is None else {"hints": {"lora_load_s": lora_load_s}}
        cfg = {"backends": [{"name": n, "url": u, "models": "auto", **hints} for n, u in urls.items()],
               "routing": {"policy": policy, "scrape_interval_s": args.scrape_interval},
               "health": {"interval_s": 1}}
        gw, url, _ = start_gateway(cfg, workdir=workdir)
        procs.append(gw)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=600)) as http:
            for _ in range(300):  # until the gateway lists every adapter (discovered at start)
                async with http.get(url + "/v1/models") as r:
                    listed = {m["id"] for m in (await r.json())["data"]}
                if listed >= set(adapters):
                    break
                await asyncio.sleep(0.1)
            else:
                raise RuntimeError("the gateway never listed the adapters")
            results: list[tuple[float, float, str, str]] = []  # (start, TTFT, adapter, backend)
            failures = 0
            t_count = time.perf_counter() + args.warmup
            t_end = t_count + args.duration
            loads_at_count: list[float] = []

            async def worker(n: int) -> None:
                nonlocal failures
                rng = random.Random(f"{args.seed}-{n}")
                while time.perf_counter() < t_end:
                    adapter = rng.choice(adapters)
                    prompt = " ".join(rng.choice(WORDS) for _ in range(args.words))
                    t0 = time.perf_counter()
                    ttft, backend = await _stream(http, url, adapter, prompt, args.output_tokens)
                    if ttft is None or backend is None:
                        failures += 1
                        continue
                    results.append((t0, ttft, adapter, backend))

            async def mark() -> None:
                await asyncio.sleep(max(0.0, t_count - time.perf_counter()))
                loads_at_count.append(await _lora_loads(http, urls))

            await asyncio.gather(mark(), *(worker(n) for n in range(args.streams)))
            loads = await _lora_loads(http, urls) - loads_at_count[0]
        counted = [r for r in results if t_count <= r[0] <= t_end]
        ttfts = [r[1] for r in counted]
        spread: dict[str, set[str]] = {}
        for _, _, a, b in counted:
            spread.setdefault(a, set()).add(b)
        per_adapter = [len(s) for s in spread.values()]
        return {"phase": label, "requests": len(counted), "requests_per_s": len(counted) / args.duration,
                "ttft_mean_ms": 1000 * sum(ttfts) / max(len(ttfts), 1),
                "ttft_p50_ms": percentile(ttfts, 50) * 1000, "ttft_p99_ms": percentile(ttfts, 99) * 1000,
                "lora_loads_per_request": loads / max(len(counted), 1),
                "backends_per_adapter": sum(per_adapter) / max(len(per_adapter), 1),
                "backends_per_adapter_max": max(per_adapter, default=0),
                "failures": failures}
    finally:
        for p in reversed(procs):
            stop(p)


def _table(rows: list[dict[str, Any]]) -> str:
    head = ("| routing | requests/s | TTFT mean (ms) | TTFT p50 (ms) | TTFT p99 (ms) | adapter loads / request "
            "| backends / adapter (mean) | backends / adapter (max) | failures |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    return head + "".join(
        f"| {r['phase']} | {r['requests_per_s']:.1f} | {r['ttft_mean_ms']:.0f} | {r['ttft_p50_ms']:.0f} "
        f"| {r['ttft_p99_ms']:.0f} | {r['lora_loads_per_request']:.3f} | {r['backends_per_adapter']:.2f} "
        f"| {r['backends_per_adapter_max']} | {r['failures']} |\n" for r in rows)


async def _run(args) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="lora-bench-", ignore_cleanup_errors=True) as workdir:
        rows = []
        for label, policy, lora_load_s in PHASES:
            row = await _phase(label, policy, lora_load_s, args, workdir)
            emit_row(row)
            rows.append(row)
        return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.lora_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=20.0, help="counted seconds per phase")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds per phase before counting")
    ap.add_argument("--streams", type=int, default=32, help="requests kept open")
    ap.add_argument("--adapters", type=int, default=20)
    ap.add_argument("--backends", type=int, default=4)
    ap.add_argument("--max-lora", type=int, default=4, help="adapters per batch (and in host memory)")
    ap.add_argument("--load-s", type=float, default=0.2, help="emulated seconds to read one adapter's weights")
    ap.add_argument("--words", type=int, default=100, help="prompt words")
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--scrape-interval", type=float, default=0.5, help="routing.scrape_interval_s")
    ap.add_argument("--speed", type=float, default=1.0, help="simulated GPU speed factor")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    if args.adapters < 1 or args.backends < 1 or args.streams < 1:
        ap.error("--adapters, --backends and --streams must be >= 1")
    rows = asyncio.run(_run(args))
    print_rows(rows, _table(rows), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
