"""Fair shares benchmark: two tenants, one with 10x longer prompts, on a saturated fleet.

``python -m loadtest.fairness_bench [--duration 30] [--streams 16] [--backends 2]``

One simulated fleet (``--backends`` demo engines) behind the gateway with admission
control (``admission.max_in_flight_per_backend``), started here as child processes.
Two API keys keep ``--streams`` streamed chat requests open each (closed loop): ``short``
sends prompts of ``--short-words`` words, ``long`` of ten times as many, both ask for
``--output-tokens`` tokens (``ignore_eos``). Together they keep more requests open than
the fleet admits, so both always have requests waiting in the admission queue. The same
workload (same seed, so the same prompts) runs twice, one phase per
``admission.fairness``: ``round_robin`` (one request per key in turn) and ``tokens``
(the Virtual Token Counter). Each phase gets a fresh fleet and gateway; its first
``--warmup`` seconds are not counted.

Printed side by side per phase and key: requests completed per second, tokens per second
(prompt + output, from each stream's ``usage``), service per second (prompt + 2 x output:
what the token counter equalizes, with the default weights), TTFT p50/p99 (as the client
sees it: queueing included), and Jain's fairness index of the two keys' tokens and
service per second (1: equal shares, 0.5: one key gets everything). Talks to the gateway
over HTTP only.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import subprocess
import sys
import tempfile
import time
from typing import Any

import aiohttp
import orjson

from loadtest.metrics import jain_index, percentile
from loadtest.procs import start_gateway, start_sim, stop
from loadtest.report import emit_row, print_rows

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()
KEYS = ("short", "long")
W_PROMPT, W_OUTPUT = 1.0, 2.0  # the gateway's default admission.prompt_token_weight, output_token_weight


def _secret(key: str) -> str:
    return f"sk-fairness-bench-{key}"


async def _stream(http: aiohttp.ClientSession, url: str, key: str, prompt: str, output_tokens: int,
                  ) -> tuple[float | None, int, int]:
    """One streamed request: (TTFT s or None on failure, prompt tokens, completion tokens)."""
    body = {"model": "demo-model", "stream": True, "max_tokens": output_tokens, "ignore_eos": True,
            "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": prompt}]}
    t0 = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    try:
        async with http.post(url + "/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {_secret(key)}"}) as r:
            if r.status != 200:
                await r.read()
                return None, 0, 0
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                if ttft is None and b'"content"' in line and b'"content":""' not in line:
                    ttft = time.perf_counter() - t0
                if b'"usage"' in line:
                    usage = orjson.loads(line[6:]).get("usage") or usage
    except (TimeoutError, aiohttp.ClientError):
        return None, 0, 0
    if ttft is None or not usage:
        return None, 0, 0
    return ttft, int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)


async def _phase(fairness: str, args, workdir: str) -> list[dict[str, Any]]:
    """One fairness mode on a fresh fleet and gateway: a row per key."""
    procs: list[subprocess.Popen] = []
    try:
        spec = [{"name": f"sim-{i}", "models": ["demo-model"], "profile": "demo", "speed": args.speed}
                for i in range(args.backends)]
        sim, urls = start_sim(spec)
        procs.append(sim)
        cfg = {"backends": [{"name": n, "url": u, "models": ["demo-model"]} for n, u in urls.items()],
               "routing": {"scrape_interval_s": 1},
               "auth": {"keys": [{"name": k, "key_sha256": hashlib.sha256(_secret(k).encode()).hexdigest()}
                                 for k in KEYS]},
               "admission": {"max_in_flight_per_backend": args.max_in_flight, "fairness": fairness,
                             "queue_timeout_s": 600}}
        gw, url, _ = start_gateway(cfg, workdir=workdir)
        procs.append(gw)
        words = {"short": args.short_words, "long": 10 * args.short_words}
        # per key: (start, TTFT, prompt tokens, completion tokens, end), perf_counter seconds
        results: dict[str, list[tuple[float, float, int, int, float]]] = {k: [] for k in KEYS}
        failures = dict.fromkeys(KEYS, 0)
        t_start = time.perf_counter()
        t_count = t_start + args.warmup
        t_end = t_count + args.duration

        async def worker(key: str, n: int, http: aiohttp.ClientSession) -> None:
            rng = random.Random(f"{args.seed}-{key}-{n}")
            while time.perf_counter() < t_end:
                prompt = " ".join(rng.choice(WORDS) for _ in range(words[key]))
                t0 = time.perf_counter()
                ttft, p, c = await _stream(http, url, key, prompt, args.output_tokens)
                if ttft is None:
                    failures[key] += 1
                    continue
                results[key].append((t0, ttft, p, c, time.perf_counter()))

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=600)) as http:
            await asyncio.gather(*(worker(k, n, http) for k in KEYS for n in range(args.streams)))
        rows = []
        for key in KEYS:
            done = [r for r in results[key] if t_count <= r[4] <= t_end]  # completed in the window
            started = [r for r in results[key] if t_count <= r[0] <= t_end]
            ttfts = [r[1] for r in started]
            rows.append({"fairness": fairness, "key": key, "prompt_words": words[key],
                         "requests_per_s": len(done) / args.duration,
                         "tokens_per_s": sum(r[2] + r[3] for r in done) / args.duration,
                         "service_per_s": sum(W_PROMPT * r[2] + W_OUTPUT * r[3] for r in done) / args.duration,
                         "ttft_p50_ms": percentile(ttfts, 50) * 1000, "ttft_p99_ms": percentile(ttfts, 99) * 1000,
                         "failures": failures[key]})
        jain = jain_index([r["tokens_per_s"] for r in rows])
        jain_service = jain_index([r["service_per_s"] for r in rows])
        for r in rows:
            r["jain"], r["jain_service"] = jain, jain_service
        return rows
    finally:
        for p in reversed(procs):
            stop(p)


def _table(rows: list[dict[str, Any]]) -> str:
    head = ("| fairness | key | prompt words | requests/s | tokens/s | service/s | TTFT p50 (ms) | TTFT p99 (ms) "
            "| failures | Jain (tokens/s) | Jain (service/s) |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    return head + "".join(
        f"| {r['fairness']} | {r['key']} | {r['prompt_words']} | {r['requests_per_s']:.2f} | {r['tokens_per_s']:.0f} "
        f"| {r['service_per_s']:.0f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['failures']} "
        f"| {r['jain']:.3f} | {r['jain_service']:.3f} |\n" for r in rows)


async def _run(args) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="fairness-bench-", ignore_cleanup_errors=True) as workdir:
        rows = []
        for fairness in ("round_robin", "tokens"):
            phase = await _phase(fairness, args, workdir)
            for r in phase:
                emit_row(r)
            rows += phase
        return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.fairness_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=30.0, help="counted seconds per phase")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds per phase before counting")
    ap.add_argument("--streams", type=int, default=16, help="requests each key keeps open")
    ap.add_argument("--short-words", type=int, default=150, help="the short key's prompt words (long: 10x)")
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--backends", type=int, default=2)
    ap.add_argument("--max-in-flight", type=int, default=4, help="admission.max_in_flight_per_backend")
    ap.add_argument("--speed", type=float, default=1.0, help="simulated GPU speed factor")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    if args.streams <= args.backends * args.max_in_flight:
        ap.error("--streams must exceed --backends x --max-in-flight: each key keeps requests waiting")
    rows = asyncio.run(_run(args))
    print_rows(rows, _table(rows), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
