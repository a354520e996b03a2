"""Is the emulator keeping up? Drive a simulated fleet with many concurrent streams and
report the emulator's own health.

    python -m loadtest.sim.selfcheck                      # hetero6 fleet, 60 streams, 20 s
    python -m loadtest.sim.selfcheck --streams 80 --duration 30 --json

Starts ``python -m loadtest.sim --fleet FLEET`` as a child process (127.0.0.1 only),
holds ``--streams`` streaming requests in flight for ``--duration`` seconds (each worker
sends its next request as soon as the previous one ends; a worker bound to a
prefill/decode pair runs vLLM's two-step disaggregated flow), then stops everything.
Bounded: at most ``--streams`` requests in flight, at most ``--duration`` + 30 s in all.

What it reports, and what "not the bottleneck" means:

* **step overrun** (from each backend's ``/admin/stats``): how late each engine step's
  tokens were delivered versus the emulated timeline (event-loop lag plus Python cost
  of a step beyond its emulated duration). p50 / p99 / max, and the share of steps
  more than 1 ms late.
* **event-loop lag** of the fleet process (a 10 ms sleeper's oversleep) and of the
  client process.
* **fleet CPU**: CPU time of the fleet process over the run, in % of one core.
* **ITL ratio**: per backend, the mean inter-token gap the client saw over the mean
  the engine emulated (``vllm:inter_token_latency_seconds``); ~1.0 when the emulator
  delivers on time.

Verdict OK when the in-flight streams held >= 50 with no errors, the fleet process used
under 80% of one core (headroom: a saturated emulator would sit near 100%), and every
backend's ITL ratio is under 1.10 (the emulated timeline was held). Step overrun and
loop lag percentiles are reported as jitter: they include OS scheduling noise from
everything else on the machine (the client itself runs on the same 2 cores) and
uvloop's 1 ms timer granularity, which the runner absorbs (the next step starts on the
emulated timeline, not at the late wake-up). Exit status 0 when OK, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from loadtest.sim.engine import _Stat
from loadtest.sim.fleet import load_fleet

ROOT = Path(__file__).resolve().parents[2]
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")


def _cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` in seconds (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _prompt(worker: int, n: int, words: int) -> str:
    system = "You are a helpful assistant. " * 8  # shared prefix: prefix-cache hits
    body = " ".join(WORDS[(worker * 7 + n * 3 + i) % len(WORDS)] + str(i % 13) for i in range(words))
    return system + f"[worker {worker} request {n}] " + body


class Load:
    def __init__(self, args, urls: dict[str, str], targets: list[tuple[str, ...]], model: str):
        self.args = args
        self.urls = urls
        self.targets = targets
        self.model = model
        self.in_flight = 0
        self.in_flight_max = 0
        self.in_flight_samples: list[int] = []
        self.requests_done = 0
        self.errors: dict[str, int] = {}
        self.tokens = 0
        self.ttft = _Stat()
        self.gaps: dict[str, list[float]] = {}  # backend -> per-request mean ITL
        self.lag = _Stat()

    async def worker(self, session: aiohttp.ClientSession, i: int, deadline: float) -> None:
        target = self.targets[i % len(self.targets)]
        for n in itertools.count():
            if time.monotonic() >= deadline:
                return
            prompt = _prompt(i, n, self.args.prompt_words)
            self.in_flight += 1
            self.in_flight_max = max(self.in_flight_max, self.in_flight)
            try:
                if len(target) == 2:
                    await self._disagg(session, target, prompt)
                else:
                    await self._stream(session, target[0], prompt, None)
                self.requests_done += 1
            except (TimeoutError, aiohttp.ClientError, ValueError) as e:
                k = type(e).__name__
                self.errors[k] = self.errors.get(k, 0) + 1
            finally:
                self.in_flight -= 1

    async def _disagg(self, session, target, prompt) -> None:
        p, d = target
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "stream": False,
                "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                       "remote_engine_id": None, "remote_block_ids": None,
                                       "remote_host": None, "remote_port": None}}
        async with session.post(self.urls[p] + "/v1/completions", json=body) as r:
            r.raise_for_status()
            kvp = (await r.json())["kv_transfer_params"]
        await self._stream(session, d, prompt, kvp)

    async def _stream(self, session, backend: str, prompt: str, kvp) -> None:
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.args.max_tokens, "stream": True,
                "ignore_eos": True}
        if kvp:
            body["kv_transfer_params"] = kvp
        t0 = time.monotonic()
        first = last = None
        n = 0
        async with session.post(self.urls[backend] + "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                obj = orjson.loads(line[6:])
                if obj.get("choices") and obj["choices"][0].get("text"):
                    now = time.monotonic()
                    if first is None:
                        first = now
                        self.ttft.add(now - t0)
                    last = now
                    n += 1
        self.tokens += n
        if n > 1 and first is not None and last is not None:
            self.gaps.setdefault(backend, []).append((last - first) / (n - 1))

    async def monitor(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while time.monotonic() < deadline:
            t = loop.time()
            await asyncio.sleep(0.01)
            self.lag.add(max(0.0, loop.time() - t - 0.01))
            self.in_flight_samples.append(self.in_flight)


async def _scrape(session: aiohttp.ClientSession, url: str) -> tuple[dict, float | None]:
    async with session.get(url + "/admin/stats") as r:
        stats = await r.json()
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    itl = None
    for fam in text_string_to_metric_families(text):
        if fam.name == "vllm:inter_token_latency_seconds":
            s = {x.name: x.value for x in fam.samples if not x.name.endswith("_bucket")}
            c = s.get("vllm:inter_token_latency_seconds_count", 0)
            itl = s.get("vllm:inter_token_latency_seconds_sum", 0) / c if c else None
    return stats, itl


async def run(args) -> dict:
    fleet = load_fleet(args.fleet)
    cmd = [sys.executable, "-m", "loadtest.sim", "--fleet", str(args.fleet), "--exit-on-stdin-eof"]
    if args.speed:
        cmd += ["--speed", str(args.speed)]
    cmd += ["--loop", args.loop]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None  # stdout=PIPE
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
        urls = json.loads(line)
        roles = {b.sim.name: b.sim.role for b in fleet.backends}
        model = fleet.backends[0].sim.models[0]
        mixed = [n for n, r in roles.items() if r == "mixed"]
        pre = [n for n, r in roles.items() if r == "prefill"]
        dec = [n for n, r in roles.items() if r == "decode"]
        targets: list[tuple[str, ...]] = [(n,) for n in mixed]
        targets += [(p, d) for p, d in zip(pre, dec)]
        load = Load(args, urls, targets, model)
        conn = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=args.duration + 25)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
            cpu0, w0 = _cpu_seconds(proc.pid), time.monotonic()
            deadline = time.monotonic() + args.duration
            tasks = [asyncio.create_task(load.worker(session, i, deadline)) for i in range(args.streams)]
            await load.monitor(deadline)
            cpu1, w1 = _cpu_seconds(proc.pid), time.monotonic()
            scraped = {n: await _scrape(session, u) for n, u in urls.items()}
            _done, pending = await asyncio.wait(tasks, timeout=20)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    finally:
        if proc.stdin:
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    steady = sorted(load.in_flight_samples[len(load.in_flight_samples) // 5:]) or [0]
    backends = {}
    for name, (st, itl) in scraped.items():
        r = st["runner"]
        gaps = load.gaps.get(name, [])
        client_itl = sum(gaps) / len(gaps) if gaps else None
        backends[name] = {
            "profile": st["profile"], "role": st["role"], "steps": r["steps"],
            "step_compute_mean_ms": round(r["compute_s"]["mean"] * 1e3, 3),
            "overrun_p50_ms": round(r["overrun_s"]["p50"] * 1e3, 3),
            "overrun_p99_ms": round(r["overrun_s"]["p99"] * 1e3, 3),
            "overrun_max_ms": round(r["overrun_s"]["max"] * 1e3, 3),
            "late_steps_pct": round(100 * r["late_steps"] / r["steps"], 2) if r["steps"] else 0.0,
            "engine_itl_ms": round(itl * 1e3, 3) if itl else None,
            "client_itl_ms": round(client_itl * 1e3, 3) if client_itl else None,
            "itl_ratio": round(client_itl / itl, 3) if itl and client_itl else None,
        }
    fleet_lag = next(iter(scraped.values()))[0]["event_loop_lag_s"]
    report = {
        "fleet": str(args.fleet), "streams": args.streams, "duration_s": args.duration,
        "max_tokens": args.max_tokens, "prompt_words": args.prompt_words,
        "in_flight_max": load.in_flight_max, "in_flight_steady_min": steady[0],
        "in_flight_steady_median": steady[len(steady) // 2],
        "requests_done": load.requests_done, "errors": load.errors, "tokens_streamed": load.tokens,
        "tokens_per_s": round(load.tokens / (w1 - w0), 1),
        "fleet_cpu_pct_of_one_core": round(100 * (cpu1 - cpu0) / (w1 - w0), 1),
        "fleet_event_loop_lag_ms": {k: round(fleet_lag[k] * 1e3, 3) for k in ("p50", "p99", "max")},
        "client_event_loop_lag_ms": {k: round(v * 1e3, 3) for k, v in load.lag.summary().items()
                                     if k in ("p50", "p99", "max")},
        "client_ttft_ms": {k: round(v * 1e3, 2) for k, v in load.ttft.summary().items()
                           if k in ("p50", "p99", "max")},
        "backends": backends,
    }
    ok = (report["in_flight_steady_min"] >= 50 and not load.errors
          and report["fleet_cpu_pct_of_one_core"] < 80
          and all(b["itl_ratio"] is None or b["itl_ratio"] < 1.10 for b in backends.values()))
    report["verdict"] = "OK" if ok else "EMULATOR BEHIND (or load not held)"
    return report


def _print(report: dict) -> None:
    print(f"fleet {report['fleet']}: {report['streams']} streams for {report['duration_s']} s, "
          f"{report['max_tokens']} tokens each (ignore_eos), ~{report['prompt_words']}-word prompts")
    print(f"in flight: max {report['in_flight_max']}, steady min {report['in_flight_steady_min']}, "
          f"median {report['in_flight_steady_median']}; requests {report['requests_done']}, "
          f"errors {report['errors'] or 0}; {report['tokens_streamed']} tokens, {report['tokens_per_s']} tok/s")
    print(f"fleet process CPU: {report['fleet_cpu_pct_of_one_core']}% of one core; event-loop lag (ms) "
          f"fleet {report['fleet_event_loop_lag_ms']}, client {report['client_event_loop_lag_ms']}")
    print(f"client TTFT (ms): {report['client_ttft_ms']}")
    hdr = ("backend", "profile", "steps", "compute", "ovr p50", "ovr p99", "ovr max", "late%", "ITL eng",
           "ITL cli", "ratio")
    print("%-13s %-23s %6s %8s %8s %8s %8s %6s %8s %8s %6s" % hdr)
    for n, b in report["backends"].items():
        print("%-13s %-23s %6d %8.3f %8.3f %8.3f %8.3f %6.2f %8s %8s %6s" % (
            n, b["profile"], b["steps"], b["step_compute_mean_ms"], b["overrun_p50_ms"], b["overrun_p99_ms"],
            b["overrun_max_ms"], b["late_steps_pct"], b["engine_itl_ms"], b["client_itl_ms"], b["itl_ratio"]))
    print("(times in ms; compute = Python time per engine step; ovr = step delivery overrun)")
    print("verdict:", report["verdict"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.sim.selfcheck", description=__doc__.split("\n")[0])
    ap.add_argument("--fleet", type=Path, default=ROOT / "loadtest" / "fleets" / "hetero6.yaml")
    ap.add_argument("--streams", type=int, default=60, help="concurrent streams (1..500)")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of load (1..120)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompt-words", type=int, default=200)
    ap.add_argument("--speed", type=float, default=None, help="override the fleet's speed factor")
    ap.add_argument("--loop", choices=("auto", "uvloop", "asyncio"), default="auto",
                    help="event loop of the fleet process")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    if not 1 <= args.streams <= 500 or not 1 <= args.duration <= 120:
        ap.error("--streams must be in 1..500 and --duration in 1..120")
    runner: Callable[[Coroutine[Any, Any, dict]], dict]
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    report = runner(run(args))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return 0 if report["verdict"] == "OK" else 1


if __name__ == "__main__":
    sys.exit(main())
