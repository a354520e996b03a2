"""What both rigs of ``python -m loadtest.peers`` use: :mod:`loadtest.peers` (the Python rig
and the command) and :mod:`loadtest.native_rig` (the native rig) import this module and
not each other's internals, so that neither imports the other back.

The request they send (model, prompt), the cores they pin to, a bounded gather, a core's
busy time from ``/proc/stat``, a percentile, the cells' number format, and starting a
proxy process and waiting until a chat completion through it answers.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from loadtest import procs

MODEL = "zero"  # the id the zero backend lists in /v1/models (smg routes by it)
PROMPT = "hello " * 50
CLIENT_CORE = 0
PROXY_CORE = 1


async def gather_bounded(coros: list, timeout_s: float) -> bool:
    """Run ``coros`` as tasks for at most ``timeout_s`` seconds; past it, cancel those
    still running and wait for them to end. Returns ``True`` when the bound was hit."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        async with asyncio.timeout(timeout_s):
            await asyncio.gather(*tasks)
        return False
    except TimeoutError:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return True


def core_busy(core: int) -> float | None:
    """Busy seconds of one core so far (``/proc/stat``: all but idle and iowait)."""
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith(f"cpu{core} "):
                    v = [int(x) for x in line.split()[1:]]
                    return (sum(v[:8]) - v[3] - v[4]) / procs.CLK_TCK
    except OSError:
        pass
    return None


def percentile(xs: list[float], q: float) -> float:
    """The ``q``-th percentile of ``xs``, linearly interpolated; NaN for no values."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def fmt(v: Any, f: str = "{:.2f}") -> str:
    """A table cell: numbers through ``f``, ``None`` and NaN as "n/a", anything else as is."""
    if v is None or (isinstance(v, float) and v != v):
        return "n/a"
    return f.format(v) if isinstance(v, (int, float)) else str(v)


def wait_chat(url: str, proc: subprocess.Popen, timeout_s: float, log: Path | None) -> None:
    """Until one small chat completion through ``url`` answers 200 (a router's /health can
    answer before its workers are registered); bounded by ``timeout_s``."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}{log_tail(log)}")
        try:
            req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    return
        except Exception as e:
            last = str(e)
        time.sleep(0.2)
    raise RuntimeError(f"no 200 within {timeout_s} s ({last}){log_tail(log)}")


def log_tail(log: Path | None) -> str:
    """"; log: " and the last three non-blank lines of ``log`` (colour codes removed), or ""."""
    if not log or not log.exists():
        return ""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", ln) for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return "; log: " + " | ".join(ln[:200] for ln in lines[-3:])


def spawn(argv: list[str], workdir: str, tag: str, cpus: set[int] | None, ready_s: float = 60.0
          ) -> tuple[subprocess.Popen, str]:
    """Start a proxy: ``{port}`` (and ``{mport}``, a second port) in ``argv`` become free
    ports, output goes to ``workdir/TAG.log``, the process is pinned to ``cpus``; returns
    (process, url) once a chat completion through it answers, or stops it and raises."""
    port = procs.free_port()
    argv = [a.replace("{port}", str(port)).replace("{mport}", str(procs.free_port())) for a in argv]
    log = Path(workdir) / f"{tag}.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                preexec_fn=procs.pin_to(cpus))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_chat(url, proc, ready_s, log)
    except BaseException:
        procs.stop(proc)
        raise
    return proc, url


def cpu_split(pid: int | None, before: dict[str, float] | None, count: int) -> dict[str, float] | None:
    """CPU seconds per 1,000 of ``count`` requests that each part of the proxy's process
    tree used since ``before`` (:func:`loadtest.procs.tree_cpu_by_process` of ``pid``
    then); ``None`` without a proxy, a reading or requests."""
    if not pid or before is None or not count:
        return None
    try:
        after = procs.tree_cpu_by_process(pid)
    except OSError:
        return None
    return {k: (v - before.get(k, 0.0)) / count * 1000 for k, v in sorted(after.items())}


def split_text(split: dict[str, float] | None) -> str:
    """``"envoy 0.612, gateway 1.204"`` (CPU s/1k per part), or "" for one part or none."""
    if not split or len(split) < 2:
        return ""
    return ", ".join(f"{k} {v:.3f}" for k, v in split.items())


def print_split_table(results: dict[str, dict[str, Any]], ttft_rows: list[dict[str, Any]]) -> None:
    """The Markdown table of :func:`cpu_split` for every target and scenario whose proxy
    has several processes (Envoy + the endpoint picker), on stdout; nothing otherwise."""
    rows = [(r["label"], k, r[k]["cpu_by_process"]) for r in results.values() if not r.get("missing")
            for k in ("a", "b") if isinstance(r.get(k), dict) and split_text(r[k].get("cpu_by_process"))]
    rows += [(r["label"], f"c, {r['concurrency']} streams", r["cpu_by_process"]) for r in ttft_rows
             if split_text(r.get("cpu_by_process"))]
    if not rows:
        return
    print("\nWhere the CPU of a proxy with several processes went, CPU s/1k by process (`python -m X` by its "
          "module, else the executable):\n")
    print("| target | scenario | CPU s/1k by process |")
    print("|---|---|---|")
    for label, scen, split in rows:
        print(f"| {label} | {scen} | {split_text(split)} |")
