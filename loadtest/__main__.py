"""``python -m loadtest``: the benchmark client of turbo-gateway.

    python -m loadtest run --target URL --workload NAME [--rate R ... | --concurrency C ...]
                           [--num-requests N | --duration S] [--seed K] --out DIR
    python -m loadtest compare --target URL --target URL ... | --config GW.yaml ... [run options]
    python -m loadtest overhead [--backend zero realistic] [--concurrency 1 64 256] [--out DIR]

Measures any OpenAI-compatible endpoint (the gateway, a backend directly, another
router) with vLLM's serving-benchmark metrics; see ``loadtest/README.md`` ("Benchmark
client") for every option, the workloads and the output files. Exit codes: 0 done,
2 bad arguments, 1 the target could not be benchmarked.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp

from loadtest import procs, report
from loadtest.client import PATHS, ClientOptions
from loadtest.metrics import parse_slo, percentile
from loadtest.runner import LoadSpec, RunResult, Target, run_load
from loadtest.workloads import WORKLOADS, make_workload, parse_params

DEFAULT_CONCURRENCY = 8  # closed loop, when neither --rate nor --concurrency is given and the workload has no arrivals


def _rate(v: str) -> float:
    return math.inf if v.lower() in ("inf", "infinity") else float(v)


def _add_load_args(ap: argparse.ArgumentParser, sweep: bool) -> None:
    w = ap.add_argument_group("workload")
    w.add_argument("--workload", default="fixed", choices=sorted(WORKLOADS), help="default: fixed")
    w.add_argument("--param", "-p", action="append", metavar="KEY=VALUE",
                   help="workload parameter (repeatable, or comma-separated); see README")
    w.add_argument("--input-len", type=int, help="shortcut for -p input_len=N")
    w.add_argument("--output-len", type=int, help="shortcut for -p output_len=N")
    w.add_argument("--seed", type=int, help="seed of prompts and arrivals (default: random, recorded)")
    ld = ap.add_argument_group("load")
    nargs = "+" if sweep else None
    ld.add_argument("--rate", type=_rate, nargs=nargs,
                    help="open loop: mean requests/s per target (inf: all at once)"
                    + ("; several: a sweep" if sweep else ""))
    ld.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrivals (1 = Poisson)")
    ld.add_argument("--concurrency", type=int, nargs=nargs,
                    help="closed loop: requests in flight per target (with --rate: a cap; without either, and "
                    f"for a workload without arrival times: {DEFAULT_CONCURRENCY})"
                    + ("; several: a sweep" if sweep else ""))
    ld.add_argument("--num-requests", "-n", type=int, help="requests per target (default 200 without --duration)")
    ld.add_argument("--duration", type=float, help="seconds of sending")
    c = ap.add_argument_group("requests")
    c.add_argument("--model", help="model id (default: the first of GET /v1/models)")
    c.add_argument("--endpoint", choices=tuple(PATHS), default="chat")
    c.add_argument("--no-stream", action="store_true", help="non-streamed requests (no TTFT/ITL)")
    c.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos: true")
    c.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request (default 300)")
    c.add_argument("--api-key-env", help="environment variable holding a Bearer token")
    o = ap.add_argument_group("output")
    o.add_argument("--slo", help="goodput SLOs in ms, e.g. ttft_ms=500,tpot_ms=50")
    o.add_argument("--percentiles", default="50,90,99", help="default 50,90,99")
    o.add_argument("--sample-interval", type=float, default=1.0, help="gateway /metrics sampling period, s")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--quiet", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="benchmark one target")
    run.add_argument("--target", required=True, help="base URL, e.g. http://127.0.0.1:8080")
    run.add_argument("--out", required=True, help="output folder")
    _add_load_args(run, sweep=True)
    cmp_ = sub.add_parser("compare", help="the same workload against several targets, interleaved")
    cmp_.add_argument("--target", action="append", default=[], metavar="[LABEL=]URL")
    cmp_.add_argument("--config", action="append", default=[], metavar="GATEWAY.yaml",
                      help="start `python -m gateway --config` on a free port and use it as a target")
    cmp_.add_argument("--interleave", choices=("request", "batch"), default="request",
                      help="request: targets share the time window, arrival i to target i mod k; "
                           "batch: alternating batches")
    cmp_.add_argument("--batch-size", type=int, default=32, help="sessions per batch (--interleave batch)")
    cmp_.add_argument("--same-prompts", action="store_true",
                      help="send identical prompts to every target (default: each target its own, "
                           "so targets sharing backends share no cache)")
    cmp_.add_argument("--out", help="output folder (default: print only)")
    _add_load_args(cmp_, sweep=False)
    ov = sub.add_parser("overhead", help="gateway overhead: direct vs through the gateway (vs nginx)")
    ov.add_argument("--backend", nargs="+", choices=("zero", "realistic"), default=["zero", "realistic"])
    ov.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    ov.add_argument("--requests", type=int, help="measured requests per target, level and repetition "
                                                 "(default max(200, 4 x concurrency))")
    ov.add_argument("--reps", type=int, default=2, help="alternating direct/gateway batches per level (default 2)")
    ov.add_argument("--input-len", type=int, default=128)
    ov.add_argument("--output-len", type=int, default=16)
    ov.add_argument("--realistic-profile", default="h100-llama3-8b",
                    help="simulator profile of the realistic backend (default h100-llama3-8b)")
    ov.add_argument("--policy", default="estimated_ttft",
                    help="gateway routing policy (default: the gateway default, estimated_ttft)")
    ov.add_argument("--request-timeout", type=float, default=120.0)
    ov.add_argument("--out", help="output folder (default: print only)")
    ov.add_argument("--quiet", action="store_true")
    return ap


async def discover_model(url: str) -> str | None:
    """The first model id of ``GET {url}/v1/models``, or ``None``."""
    try:
        async with aiohttp.ClientSession() as http:
            async with asyncio.timeout(10):
                async with http.get(url.rstrip("/") + "/v1/models") as r:
                    if r.status == 200:
                        data = (await r.json()).get("data") or []
                        return data[0]["id"] if data else None
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
        return None
    return None


def _workload_params(args: argparse.Namespace) -> dict[str, str]:
    params = parse_params(args.param)
    if args.input_len is not None:
        params["input_len"] = str(args.input_len)
    if args.output_len is not None:
        params["output_len"] = str(args.output_len)
    return params


def _client_options(args: argparse.Namespace, model: str) -> ClientOptions:
    key = os.environ.get(args.api_key_env) if args.api_key_env else None
    return ClientOptions(model=model, endpoint=args.endpoint, stream=not args.no_stream,
                         ignore_eos=not args.no_ignore_eos, timeout_s=args.request_timeout, api_key=key)


def _percentiles(text: str) -> tuple[float, ...]:
    ps = tuple(float(p) for p in text.split(",") if p.strip())
    if not ps or any(not 0 <= p <= 100 for p in ps):
        raise ValueError("--percentiles must be numbers in [0, 100]")
    return ps


def _settings(args: argparse.Namespace, opts: ClientOptions, seed: int) -> dict[str, Any]:
    return {"model": opts.model, "endpoint": opts.endpoint, "stream": opts.stream, "ignore_eos": opts.ignore_eos,
            "request_timeout_s": opts.timeout_s, "seed": seed, "burstiness": args.burstiness,
            "sample_interval_s": args.sample_interval}


def _print_runs(doc: dict[str, Any]) -> None:
    for run in doc["runs"]:
        for lane in run["lanes"]:
            print(report.text_summary(lane, f"{lane['target']['label']} @ {run['label']}"))
    for run, rts in zip(doc["runs"], doc.get("ratios") or []):
        print(f"\nRatios to the first target ({run['label']}):\n")
        print(report.ratio_table(run, rts))


def _print_written(paths: dict[str, Path], plots: bool) -> None:
    print(f"\nwrote {', '.join(str(p) for p in paths.values())}")
    if plots and not report.can_plot():
        print(report.PLOTS_HINT)


def _default_concurrency(args: argparse.Namespace) -> int | None:
    """The concurrency a run uses when none is given: :data:`DEFAULT_CONCURRENCY` for a
    workload without arrival times of its own (and no ``--rate``), else ``None``."""
    if args.rate or args.concurrency or WORKLOADS[args.workload][2]:  # (build, defaults, has_arrivals)
        return None
    return DEFAULT_CONCURRENCY


async def cmd_run(args: argparse.Namespace, argv: list[str]) -> int:
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2 ** 31)
    rates = args.rate or [None]
    if args.concurrency is None and (conc := _default_concurrency(args)) is not None:
        args.concurrency = [conc]
    concs = args.concurrency or [None]
    if len(rates) > 1 and len(concs) > 1:
        raise ValueError("sweep either --rate or --concurrency, not both")
    model = args.model or await discover_model(args.target)
    if not model:
        print(f"error: cannot list models at {args.target}/v1/models; give --model", file=sys.stderr)
        return 1
    opts = _client_options(args, model)
    slo = parse_slo(args.slo)
    pct = _percentiles(args.percentiles)
    params = _workload_params(args)
    runs: list[RunResult] = []
    points = [(r, c) for r in rates for c in concs]
    for i, (rate, conc) in enumerate(points):
        wl = make_workload(args.workload, params, seed)
        if len(points) > 1:
            wl.salt = f"point{i}"  # each point its own prompts: no cache carried over from the last one
        if wl.has_arrivals and rate is not None:
            wl.target_rate = rate
        load = LoadSpec(rate=rate, burstiness=args.burstiness, concurrency=conc, num_requests=args.num_requests,
                        duration_s=args.duration)
        if not args.quiet:
            print(f"{args.workload} -> {args.target} ({load.label()})", file=sys.stderr)
        runs.append(await run_load([Target(args.target, args.target)], [wl], load, opts, seed=seed,
                                   sample_interval_s=args.sample_interval, show_progress=not args.quiet))
    doc = report.build_document("run", report.machine_context(argv), _settings(args, opts, seed), runs, slo, pct)
    _print_runs(doc)
    paths = report.write_outputs(doc, args.out, plots=not args.no_plots)
    _print_written(paths, plots=not args.no_plots)
    return 0


def _parse_target(text: str, i: int) -> Target:
    label, sep, url = text.partition("=")
    if sep and not label.startswith("http"):
        return Target(label, url)
    return Target(text, text)


async def cmd_compare(args: argparse.Namespace, argv: list[str]) -> int:
    if len(args.target) + len(args.config) < 2:
        raise ValueError("compare needs at least two --target/--config")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2 ** 31)
    started: list[Any] = []
    try:
        targets = [_parse_target(t, i) for i, t in enumerate(args.target)]
        for cfg in args.config:
            proc, url, _ = procs.start_gateway(cfg)
            started.append(proc)
            targets.append(Target(Path(cfg).stem, url))
        model = args.model or await discover_model(targets[0].url)
        if not model:
            print(f"error: cannot list models at {targets[0].url}/v1/models; give --model", file=sys.stderr)
            return 1
        opts = _client_options(args, model)
        params = _workload_params(args)
        wls = []
        for j in range(len(targets)):
            wl = make_workload(args.workload, params, seed)
            wl.salt = "" if args.same_prompts else f"target{j}"
            if wl.has_arrivals and args.rate is not None:
                wl.target_rate = args.rate
            wls.append(wl)
        load = LoadSpec(rate=args.rate, burstiness=args.burstiness,
                        concurrency=args.concurrency or _default_concurrency(args),
                        num_requests=args.num_requests, duration_s=args.duration)
        run = await run_load(targets, wls, load, opts, seed=seed, interleave=args.interleave,
                             batch_size=args.batch_size, sample_interval_s=args.sample_interval,
                             show_progress=not args.quiet)
    finally:
        for p in started:
            procs.stop(p)
    settings = {**_settings(args, opts, seed), "interleave": args.interleave, "same_prompts": args.same_prompts}
    if args.interleave == "batch":
        settings["batch_size"] = args.batch_size
    doc = report.build_document("compare", report.machine_context(argv), settings, [run], parse_slo(args.slo),
                                _percentiles(args.percentiles))
    _print_runs(doc)
    if args.out:
        paths = report.write_outputs(doc, args.out, plots=not args.no_plots)
        _print_written(paths, plots=not args.no_plots)
    return 0


# --- gateway overhead ------------------------------------------------------------------------


async def overhead(backends: list[str], concurrencies: list[int], *, requests: int | None = None, reps: int = 2,
                   input_len: int = 128, output_len: int = 16, realistic_profile: str = "h100-llama3-8b",
                   policy: str = "least_requests", timeout_s: float = 120.0, quiet: bool = False,
                   workdir: str | None = None) -> dict[str, Any]:
    """Benchmark 1 of the loadtest issue: TTFT direct to a backend against through
    ``python -m gateway`` (and a plain nginx when installed), streaming, closed loop at
    each concurrency, on a zero-delay backend (:mod:`loadtest.zero`) and/or a realistic
    simulated one (``realistic_profile`` at speed 1). Direct and proxied batches
    alternate (``reps`` times), never overlap, and each starts after a warm-up batch.
    The gateway's CPU is ``/proc/PID/stat`` utime+stime read around its batches.
    Returns ``{"rows": [...], "nginx": bool, "records": {...}}``; "added" TTFT is the
    difference of the percentiles, not a percentile of differences."""
    rows: list[dict[str, Any]] = []
    runs: list[tuple[str, int, RunResult]] = []
    own_workdir = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="loadtest-overhead-")
    nginx_available = shutil.which("nginx") is not None
    for kind in backends:
        children: list[Any] = []
        try:
            if kind == "zero":
                proc, url = procs.start_zero(output_len)
                model = "zero"
            else:
                proc, urls = procs.start_sim([{"name": "sim", "models": ["demo-model"], "profile": realistic_profile,
                                               "speed": 1.0}])
                url = urls["sim"]
                model = "demo-model"
            children.append(proc)
            gw_cfg = {"listen": {"host": "127.0.0.1", "port": 0}, "routing": {"policy": policy},
                      "health": {"interval_s": 30},
                      "backends": [{"name": "b0", "url": url, "models": [model]}]}
            gw_proc, gw_url, _ = procs.start_gateway(gw_cfg, workdir=workdir)
            children.append(gw_proc)
            targets = {"direct": (url, None), "gateway": (gw_url, gw_proc)}
            if nginx_available:
                ng = procs.start_nginx(url, workdir)
                if ng:
                    children.append(ng[0])
                    targets["nginx"] = (ng[1], ng[0])
            opts = ClientOptions(model=model, timeout_s=timeout_s)
            for conc in concurrencies:
                n = requests or max(200, 4 * conc)
                recs: dict[str, list] = {k: [] for k in targets}
                cpu: dict[str, float] = dict.fromkeys(targets, 0.0)
                counted: dict[str, int] = dict.fromkeys(targets, 0)
                for rep in range(reps):
                    for name, (turl, tproc) in targets.items():
                        warm = make_workload("fixed", {"input_len": input_len, "output_len": output_len},
                                             seed=rep)
                        warm.salt = f"{kind}-{conc}-{name}-warm"
                        await run_load([Target(name, turl)], [warm], LoadSpec(concurrency=conc,
                                       num_requests=min(n, max(conc, 32))), opts, show_progress=False)
                        wl = make_workload("fixed", {"input_len": input_len, "output_len": output_len}, seed=rep)
                        wl.salt = f"{kind}-{conc}-{name}"
                        before = procs.cpu_seconds(tproc.pid) if tproc else 0.0
                        res = await run_load([Target(name, turl)], [wl], LoadSpec(concurrency=conc, num_requests=n),
                                             opts, show_progress=False)
                        if tproc:
                            cpu[name] += procs.cpu_seconds(tproc.pid) - before
                        recs[name] += res.lanes[0].records
                        counted[name] += len(res.lanes[0].records)
                        runs.append((kind, conc, res))
                row: dict[str, Any] = {"backend": kind, "concurrency": conc, "requests": n * reps}
                for name, rs in recs.items():
                    ttft = [r.ttft_s * 1000 for r in rs if r.ok and r.ttft_s is not None]
                    row[f"{name}_ttft_p50_ms"] = percentile(ttft, 50)
                    row[f"{name}_ttft_p99_ms"] = percentile(ttft, 99)
                    row[f"{name}_errors"] = sum(1 for r in rs if not r.ok)
                    if name != "direct":
                        row[f"{name}_added_p50_ms"] = row[f"{name}_ttft_p50_ms"] - row["direct_ttft_p50_ms"]
                        row[f"{name}_added_p99_ms"] = row[f"{name}_ttft_p99_ms"] - row["direct_ttft_p99_ms"]
                        row[f"{name}_cpu_s_per_1k"] = cpu[name] / counted[name] * 1000 if counted[name] else math.nan
                rows.append(row)
                if not quiet:
                    print(format_overhead([row], nginx_available, header=not any(r is not row for r in rows)),
                          file=sys.stderr)
        finally:
            for p in reversed(children):
                procs.stop(p)
    if own_workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return {"rows": rows, "nginx": nginx_available, "runs": runs,
            "settings": {"backends": backends, "concurrency": concurrencies, "requests": requests, "reps": reps,
                         "input_len": input_len, "output_len": output_len, "realistic_profile": realistic_profile,
                         "policy": policy}}


def format_overhead(rows: list[dict[str, Any]], nginx: bool, header: bool = True) -> str:
    cols = [("backend", "backend", "{}"), ("concurrency", "C", "{}"), ("requests", "req", "{}"),
            ("direct_ttft_p50_ms", "direct p50", "{:.2f}"), ("direct_ttft_p99_ms", "direct p99", "{:.2f}"),
            ("gateway_ttft_p50_ms", "gateway p50", "{:.2f}"), ("gateway_ttft_p99_ms", "gateway p99", "{:.2f}"),
            ("gateway_added_p50_ms", "added p50", "{:+.2f}"), ("gateway_added_p99_ms", "added p99", "{:+.2f}"),
            ("gateway_cpu_s_per_1k", "gw CPU s/1k req", "{:.2f}")]
    if nginx:
        cols += [("nginx_added_p50_ms", "nginx added p50", "{:+.2f}"),
                 ("nginx_added_p99_ms", "nginx added p99", "{:+.2f}"),
                 ("nginx_cpu_s_per_1k", "nginx CPU s/1k", "{:.2f}")]
    cols.append(("gateway_errors", "gw errors", "{}"))
    out = []
    if header:
        out.append("| " + " | ".join(c[1] for c in cols) + " |")
        out.append("|" + "---|" * len(cols))
    for r in rows:
        cells = []
        for key, _, f in cols:
            v = r.get(key)
            cells.append("-" if v is None or (isinstance(v, float) and math.isnan(v)) else f.format(v))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


async def cmd_overhead(args: argparse.Namespace, argv: list[str]) -> int:
    res = await overhead(args.backend, args.concurrency, requests=args.requests, reps=args.reps,
                         input_len=args.input_len, output_len=args.output_len,
                         realistic_profile=args.realistic_profile, policy=args.policy,
                         timeout_s=args.request_timeout, quiet=args.quiet)
    print("\nGateway overhead: TTFT in ms (client-measured, streaming, closed loop); added = gateway - direct "
          "(difference of percentiles); CPU = gateway process utime+stime per 1,000 requests\n")
    print(format_overhead(res["rows"], res["nginx"]))
    if not res["nginx"]:
        print("\nnginx column skipped: `nginx` is not on PATH")
    if args.out:
        ctx = report.machine_context(argv)
        runs = [r for _, _, r in res["runs"]]
        labels = [f"{k} C={c} {r.lanes[0].target.label}" for k, c, r in res["runs"]]
        # one run per measured batch (labelled backend, C, target): every record is kept
        doc = report.build_document("overhead", ctx, res["settings"], runs, None, (50.0, 90.0, 99.0), labels)
        doc["overhead"] = res["rows"]
        paths = report.write_outputs(doc, args.out, plots=False)
        md = Path(paths["report"])
        md.write_text("# Gateway overhead\n\n" + format_overhead(res["rows"], res["nginx"]) + "\n\n"
                      + md.read_text())
        print(f"\nwrote {', '.join(str(p) for p in paths.values())}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    cmd = {"run": cmd_run, "compare": cmd_compare, "overhead": cmd_overhead}[args.cmd]
    runner: Callable[[Coroutine[Any, Any, int]], int]
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        return runner(cmd(args, ["python -m loadtest", *argv]))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
