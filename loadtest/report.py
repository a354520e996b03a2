"""Results a person can read at a glance: the run's context, ``results.json`` (every
per-request record), ``report.md``, and PNG plots (matplotlib, Agg backend; the ``bench``
extra installs it, and without it the rest is written all the same).

Files written into the output folder:

* ``results.json``: ``{"schema", "kind", "context", "settings", "runs": [{"label",
  "load", "interleave", "started_at_unix", "wall_s", "lanes": [{"target", "workload",
  "gateway", "summary", "groups", "backend_samples", "records"}]}], "ratios"}``.
  NaN is written as ``null``.
* ``report.md``: context, one table per run and target, ratios (compare), plot links.
* ``ttft_cdf.png``, ``e2e_cdf.png``: CDFs per run and target;
  ``latency_vs_load.png``: TTFT/E2E mean and p99 and throughput against the offered
  load, when several loads were run; ``backend_load*.png``: the gateway's
  ``turbo_gateway_backend_in_flight`` per backend over time.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import shutil
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from loadtest.metrics import HEADLINE, fmt, summarize, summarize_groups
from loadtest.runner import RunResult

SCHEMA = "turbo-gateway/loadtest-results/v1"
LIBRARIES = ("aiohttp", "orjson", "matplotlib", "uvloop", "turbo-gateway", "numpy")


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _mem_total_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def gpu_info() -> list[dict[str, str]] | None:
    """GPUs from ``nvidia-smi`` (name, memory, driver), or ``None`` when it is absent
    or fails."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    gpus = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3:
            gpus.append({"name": parts[0], "memory": parts[1], "driver": parts[2]})
    return gpus or None


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parents[1]
    try:  # read-only
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_context(argv: list[str] | None = None) -> dict[str, Any]:
    """Where and how the benchmark ran: machine (platform, CPU model and count,
    memory), Python, library versions, GPU (``nvidia-smi``), the client checkout's
    commit, the command line and the UTC start time."""
    libs: dict[str, str | None] = {}
    for name in LIBRARIES:
        try:
            libs[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            libs[name] = None
    return {
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": argv if argv is not None else sys.argv,
        "machine": {"platform": platform.platform(), "machine": platform.machine(), "cpu_model": _cpu_model(),
                    "cpu_count": os.cpu_count(), "memory_bytes": _mem_total_bytes()},
        "python": {"version": platform.python_version(), "implementation": platform.python_implementation()},
        "libraries": libs,
        "gpu": gpu_info(),
        "client_commit": _git_commit(),
    }


def _clean(o: Any) -> Any:
    if isinstance(o, float):
        return None if math.isnan(o) else ("inf" if math.isinf(o) else o)
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def build_document(kind: str, context: dict[str, Any], settings: dict[str, Any], runs: list[RunResult],
                   slo_ms: dict[str, float] | None = None, percentiles: tuple[float, ...] = (50.0, 90.0, 99.0),
                   run_labels: list[str] | None = None) -> dict[str, Any]:
    """The ``results.json`` document (summaries computed here, NaN kept until
    :func:`write_outputs` cleans it)."""
    doc_runs = []
    for i, run in enumerate(runs):
        lanes = []
        for lane in run.lanes:
            # alternating batches: a target's throughput counts only the time its batches ran
            dur = lane.active_s if run.interleave == "batch" else None
            lanes.append({
                "target": {"label": lane.target.label, "url": lane.target.url},
                "workload": lane.workload, "gateway": lane.gateway,
                "summary": summarize(lane.records, duration=dur, slo_ms=slo_ms, percentiles=percentiles),
                "groups": summarize_groups(lane.records, duration=dur, slo_ms=slo_ms, percentiles=percentiles),
                "active_s": lane.active_s,
                "backend_samples": lane.backend_samples,
                "records": [r.to_json() for r in lane.records],
            })
        doc_runs.append({"label": run_labels[i] if run_labels else run.load.label(), "load": run.load.to_json(),
                         "interleave": run.interleave, "started_at_unix": run.started_at_unix, "wall_s": run.wall_s,
                         "lanes": lanes})
    doc = {"schema": SCHEMA, "kind": kind, "context": context,
           "settings": {**settings, "slo_ms": slo_ms or {}, "percentiles": list(percentiles)}, "runs": doc_runs}
    if kind == "compare":
        doc["ratios"] = [ratios(r) for r in doc_runs]
    return doc


def ratios(doc_run: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Each headline metric of each target divided by the first target's:
    ``{target label: {metric: ratio}}`` (``None`` when undefined)."""
    base = doc_run["lanes"][0]["summary"]
    out: dict[str, dict[str, float | None]] = {}
    for lane in doc_run["lanes"]:
        s = lane["summary"]
        row: dict[str, float | None] = {}
        for key, _, _ in HEADLINE:
            a, b = s.get(key), base.get(key)
            ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and b != 0 and not (
                math.isnan(a) or math.isnan(b))
            row[key] = a / b if ok else None
        out[lane["target"]["label"]] = row
    return out


def text_summary(lane: dict[str, Any], title: str) -> str:
    """A vLLM-style result block for one target of one run."""
    s = lane["summary"]
    lines = [f"{(' ' + title + ' '):=^64}"]
    lines.append(f"{'Successful requests:':<40}{s['completed']:>12}")
    lines.append(f"{'Failed requests:':<40}{s['failed']:>12}" + (f"  {s['errors']}" if s["errors"] else ""))
    lines.append(f"{'Benchmark duration (s):':<40}{s['duration_s']:>12.2f}")
    lines.append(f"{'Total input tokens:':<40}{s['total_input_tokens']:>12}")
    lines.append(f"{'Total generated tokens:':<40}{s['total_output_tokens']:>12}")
    lines.append(f"{'Request throughput (req/s):':<40}{fmt(s['request_throughput']):>12}")
    if "goodput" in s:
        lines.append(f"{'Request goodput (req/s):':<40}{fmt(s['goodput']):>12}  SLO {s['slo_ms']} ms")
    lines.append(f"{'Output token throughput (tok/s):':<40}{fmt(s['output_throughput']):>12}")
    lines.append(f"{'Total token throughput (tok/s):':<40}{fmt(s['total_token_throughput']):>12}")
    if s.get("prefix_cache_hit_ratio") is not None:
        lines.append(f"{'Prefix cache hit ratio:':<40}{s['prefix_cache_hit_ratio']:>12.3f}")
    for name, head in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{head:-^64}")
        for key in sorted(k for k in s if k.endswith(f"_{name}_ms") and not k.startswith(("std", "p50_"))):
            stat = key.split("_")[0]
            lines.append(f"{stat.capitalize() + ' ' + name.upper() + ' (ms):':<40}{fmt(s[key]):>12}")
    if lane.get("gateway"):
        g = lane["gateway"]
        lines.append(f"gateway: policy={g.get('policy', '?')} backends={len(g.get('backends', []))} "
                     f"version={g.get('version') or 'not exported'}")
    if s.get("requests_by_backend"):
        lines.append(f"requests by backend: {s['requests_by_backend']}")
    lines.append("=" * 64)
    return "\n".join(lines)


def ratio_table(doc_run: dict[str, Any], rts: dict[str, dict[str, float | None]]) -> str:
    """Markdown: one row per headline metric, the first target's value, then each
    other target's value and its ratio to the first."""
    lanes = doc_run["lanes"]
    head = "| metric | " + " | ".join(
        [lanes[0]["target"]["label"]] + [f"{ln['target']['label']} (x first)" for ln in lanes[1:]]) + " |"
    out = [head, "|---" * (len(lanes) + 1) + "|"]
    for key, label, unit in _present(lanes):
        v0 = lanes[0]["summary"].get(key)
        cells = [fmt(v0)]
        for ln in lanes[1:]:
            r = rts[ln["target"]["label"]].get(key)
            cells.append(f"{fmt(ln['summary'].get(key))} ({'-' if r is None else f'{r:.3f}'})")
        out.append(f"| {label}{' (' + unit + ')' if unit else ''} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _present(lanes: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    return [h for h in HEADLINE if any(ln["summary"].get(h[0]) is not None for ln in lanes)]


def _md_summary_table(doc_run: dict[str, Any]) -> str:
    lanes = doc_run["lanes"]
    out = ["| metric | " + " | ".join(ln["target"]["label"] for ln in lanes) + " |", "|---" * (len(lanes) + 1) + "|"]
    for key, label, unit in _present(lanes):
        out.append(f"| {label}{' (' + unit + ')' if unit else ''} | "
                   + " | ".join(fmt(ln["summary"].get(key)) for ln in lanes) + " |")
    return "\n".join(out)


def render_markdown(doc: dict[str, Any], plots: list[str]) -> str:
    ctx = doc["context"]
    m = ctx["machine"]
    out = [f"# Load test report ({doc['kind']})", ""]
    out.append(f"- started: {ctx['started_at']}; command: `{' '.join(map(str, ctx['command']))}`")
    out.append(f"- machine: {m['platform']}, {m['cpu_count']} CPUs ({m['cpu_model']}), "
               f"{(m['memory_bytes'] or 0) / 2**30:.1f} GiB; GPU: "
               + (", ".join(g["name"] for g in ctx["gpu"]) if ctx["gpu"] else "none (no nvidia-smi)"))
    out.append(f"- Python {ctx['python']['version']}; "
               + ", ".join(f"{k} {v}" for k, v in ctx["libraries"].items() if v)
               + (f"; client commit {ctx['client_commit'][:12]}" if ctx.get("client_commit") else ""))
    st = doc["settings"]
    out.append("- settings: " + ", ".join(f"{k}={v}" for k, v in st.items() if v not in (None, {}, [])))
    out.append("- metric definitions: vLLM's serving benchmark (TTFT, TPOT = (e2e - TTFT)/(output tokens - 1), "
               "ITL pooled over requests, E2E to the last token; percentiles interpolated linearly)")
    out.append("")
    for run in doc["runs"]:
        out.append(f"## {run['label']}")
        out.append("")
        for ln in run["lanes"]:
            wl = ln["workload"]
            g = ln.get("gateway")
            out.append(f"- **{ln['target']['label']}** `{ln['target']['url']}`: workload `{wl['name']}` "
                       f"seed {wl['seed']} {wl['params']}"
                       + (f"; turbo-gateway policy `{g.get('policy', '?')}`, {len(g.get('backends', []))} backends, "
                          f"version {g.get('version') or 'not exported'}" if g else ""))
            s = ln["summary"]
            if s["errors"]:
                out.append(f"  - errors: {s['errors']}")
            if s.get("requests_by_backend"):
                out.append(f"  - requests by backend: {s['requests_by_backend']}")
        out.append("")
        out.append(_md_summary_table(run))
        out.append("")
        for ln in run["lanes"]:
            if ln["groups"]:
                out.append(f"Per group ({ln['target']['label']}):")
                out.append("")
                keys = [("completed", "n"), ("mean_ttft_ms", "mean TTFT ms"), ("p99_ttft_ms", "p99 TTFT ms"),
                        ("mean_tpot_ms", "mean TPOT ms"), ("mean_e2el_ms", "mean E2E ms"),
                        ("prefix_cache_hit_ratio", "cache hit")]
                out.append("| group | " + " | ".join(k[1] for k in keys) + " |")
                out.append("|---" * (len(keys) + 1) + "|")
                for gname, gs in ln["groups"].items():
                    out.append(f"| {gname} | " + " | ".join(fmt(gs.get(k)) for k, _ in keys) + " |")
                out.append("")
    if doc.get("ratios"):
        out.append("## Ratios to the first target")
        out.append("")
        for run, rts in zip(doc["runs"], doc["ratios"]):
            out.append(f"### {run['label']}")
            out.append("")
            out.append(ratio_table(run, rts))
            out.append("")
    if plots:
        out.append("## Plots")
        out.append("")
        out += [f"![{p}]({p})" for p in plots]
        out.append("")
    return "\n".join(out)


def make_plots(doc: dict[str, Any], out_dir: Path) -> list[str]:
    """Draw the PNGs into ``out_dir``; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names: list[str] = []
    curves = []  # (label, ttfts_ms, e2es_ms)
    multi_run = len(doc["runs"]) > 1
    for run in doc["runs"]:
        for ln in run["lanes"]:
            ok = [r for r in ln["records"] if r["error"] is None]
            label = ln["target"]["label"] + (f" @ {run['label']}" if multi_run else "")
            curves.append((label, sorted(r["ttft_s"] * 1000 for r in ok if r["ttft_s"] is not None),
                           sorted(r["e2e_s"] * 1000 for r in ok if r["e2e_s"] is not None)))
    for idx, (fname, title) in ((1, ("ttft_cdf.png", "TTFT")), (2, ("e2e_cdf.png", "End-to-end latency"))):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for c in curves:
            xs = c[idx]
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=c[0])
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{title} CDF")
        ax.grid(alpha=0.3)
        if any(c[idx] for c in curves):
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=110)
        plt.close(fig)
        names.append(fname)
    if multi_run:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
        by_target: dict[str, list[tuple[float, dict]]] = {}
        xlabel = "offered load"
        for run in doc["runs"]:
            load = run["load"]
            if load.get("rate") is not None:
                x = float(load["rate"]) if load["rate"] != "inf" else math.inf
                xlabel = "offered rate (req/s per target)"
            else:
                x = float(load.get("concurrency") or 0)
                xlabel = "concurrency"
            for ln in run["lanes"]:
                by_target.setdefault(ln["target"]["label"], []).append((x, ln["summary"]))
        for label, pts in by_target.items():
            pts = sorted((p for p in pts if math.isfinite(p[0])), key=lambda p: p[0])
            xs = [p[0] for p in pts]
            for key, style, name in (("mean_ttft_ms", "-o", "mean TTFT"), ("p99_ttft_ms", "--o", "p99 TTFT"),
                                     ("mean_e2el_ms", "-s", "mean E2E"), ("p99_e2el_ms", "--s", "p99 E2E")):
                ax1.plot(xs, [p[1].get(key) for p in pts], style, label=f"{label}: {name}")
            ax2.plot(xs, [p[1].get("output_throughput") for p in pts], "-o", label=f"{label}: output tok/s")
        ax1.set_xlabel(xlabel)
        ax1.set_ylabel("latency (ms)")
        ax1.set_yscale("log")
        ax1.set_title("Latency against offered load")
        ax1.grid(alpha=0.3)
        ax1.legend(fontsize=7)
        ax2.set_xlabel(xlabel)
        ax2.set_ylabel("output tokens/s")
        ax2.set_title("Throughput against offered load")
        ax2.grid(alpha=0.3)
        ax2.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / "latency_vs_load.png", dpi=110)
        plt.close(fig)
        names.append("latency_vs_load.png")
    sampled = [(ri, run, ln) for ri, run in enumerate(doc["runs"]) for ln in run["lanes"] if ln["backend_samples"]]
    for ri, run, ln in sampled:
        fname = "backend_load.png" if len(sampled) == 1 else \
            f"backend_load_{ri}_{''.join(ch if ch.isalnum() else '_' for ch in ln['target']['label'])}.png"
        fig, ax = plt.subplots(figsize=(8, 4.5))
        backends = sorted({b for s in ln["backend_samples"] for b in s["backends"]})
        for b in backends:
            steps = [(s["t_s"], s["backends"][b].get("in_flight", 0.0)) for s in ln["backend_samples"]
                   if b in s["backends"]]
            ax.step([p[0] for p in steps], [p[1] for p in steps], where="post", label=b)
        ax.set_xlabel("time since run start (s)")
        ax.set_ylabel("requests in flight (turbo_gateway_backend_in_flight)")
        ax.set_title(f"Per-backend load: {ln['target']['label']} @ {run['label']}")
        ax.grid(alpha=0.3)
        if backends:
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=110)
        plt.close(fig)
        names.append(fname)
    return names


PLOTS_HINT = "no plots: matplotlib is not installed (pip install -e '.[bench]' adds it)"


def can_plot() -> bool:
    """Whether matplotlib imports (it comes with the ``bench`` and ``test`` extras)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_outputs(doc: dict[str, Any], out_dir: str | Path, plots: bool = True) -> dict[str, Path]:
    """Write ``results.json`` and ``report.md`` into ``out_dir`` (created), then the
    plots, if asked and matplotlib is installed (``report.md`` is then rewritten to link
    them): a failed plot never costs the results. Returns ``{"json", "report", plot
    names...}`` -> paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {"json": out / "results.json", "report": out / "report.md"}
    paths["json"].write_text(json.dumps(_clean(doc), indent=1, allow_nan=False))
    paths["report"].write_text(render_markdown(doc, []))
    if plots and can_plot():
        names = make_plots(doc, out)
        for n in names:
            paths[n] = out / n
        if names:
            paths["report"].write_text(render_markdown(doc, names))
    return paths


def emit_row(row: dict[str, Any]) -> None:
    """One benchmark row as a JSON line on stderr, as soon as it is measured."""
    print(json.dumps(row), file=sys.stderr, flush=True)


def print_rows(rows: list[dict[str, Any]], table: str, json_path: str | None) -> None:
    """A benchmark's end: its markdown ``table`` on stdout and, with ``json_path``, its
    ``rows`` written there as JSON."""
    print(table)
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=2))
