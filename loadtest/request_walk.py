"""Which source files of ``gateway/`` and ``routing/`` one streamed chat completion passes through.

    python -m loadtest.request_walk [--warmup 3] [--timeout 60] [--json OUT]

Starts one zero-delay backend (:mod:`loadtest.zero`) and the gateway in front of it as
``python -m gateway --config TMP.yaml --port P`` (model ``m``, health checks once an
hour, no metrics scraping, no config watching), run by this module's ``--tracee`` mode:
a wrapper that installs two signal handlers and then runs the gateway's ``__main__``
unchanged. SIGUSR1 turns a profile hook on (``sys.setprofile`` on the main thread, where
the handler runs, and ``threading.setprofile`` for threads started while recording;
``threading.setprofile_all_threads`` where Python has it); SIGUSR2 turns it off and writes
what it saw as JSON to the path in ``$TG_WALK_OUT``. Nothing is recorded outside that
window, so start-up, warm-up and shutdown are not in it.

The walk: after ``--warmup`` streamed requests (each on a new connection; the first one
also waits for the gateway to be ready) and a quiet ``--settle-ms`` (the gateway's
bookkeeping after a stream's ``[DONE]`` ends), recording starts, exactly one streamed chat
completion is sent on a new connection (``max_tokens`` 8, ``stream_options.include_usage``)
and read to its end, then after another ``--settle-ms`` recording stops (and only then is
the connection closed: its end is not part of the walk). The
gateway's background tasks are idle in that window (health checks hourly, scraping and
config watching off), so what it records is the request: its connection accepted, the
request parsed and routed, sent to the backend, the stream relayed back.

It prints the number of distinct files under ``gateway/`` and ``routing/`` that were
entered and, per file in first-entry order, its number of **entries** and the functions
called in it in first-call order. An entry into file F is a Python call into F (a
function call, or a coroutine or generator resumed) from a frame that is not in F:
another file of the project, a library, or no Python frame at all (the event loop
resuming a coroutine from C). Calls within a file are not entries, nor are returns: a
coroutine of director.py that calls routing/router.py twice and is resumed by the event loop
three times adds 2 entries to router.py and 3 to director.py. Then the sequence of all
entries, in order. The counts of the files that relay the stream vary from run to run:
they follow how the backend's events happen to be grouped into reads (whether the whole
stream came in the read that brought its head, or went through the relay loop).
Measured walks: docs/results/cpu_profile.md.

It relies only on ``python -m gateway --config X --port P`` and the OpenAI HTTP API, so
it runs on any version of the code (run it from a checkout: the gateway is imported from
the same source tree as this module). Every wait has a time bound; both child processes
are stopped by their PIDs at the end. All traffic is on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ENV_OUT = "TG_WALK_OUT"
MODEL = "m"
DIRS = ("gateway", "routing")
ROOT = Path(__file__).resolve().parent.parent  # the source tree this module (and so the gateway) runs from


# --- the tracee: runs inside the gateway's process ---------------------------------------------------------


class _Recorder:
    """The profile hook and what it has seen. Only ``call`` events matter (a Python frame
    starting or resuming); everything else returns at once."""

    def __init__(self, dirs: dict[str, str]) -> None:
        self.prefixes = tuple((d.rstrip(os.sep) + os.sep, name) for name, d in dirs.items())
        self._rel: dict[str, str] = {}  # co_filename -> "gateway/x.py", or "" when outside
        self.reset()

    def reset(self) -> None:
        self.files: dict[str, dict[str, Any]] = {}  # first-entry order (dicts keep insertion order)
        self.sequence: list[str] = []  # the file of every entry, in order
        self.edges: dict[str, int] = {}  # "from -> to" entry counts
        self.calls = 0
        self.threads: set[int] = set()

    def rel(self, filename: str) -> str:
        r = self._rel.get(filename)
        if r is None:
            r = ""
            for prefix, name in self.prefixes:
                if filename.startswith(prefix):
                    r = name + "/" + filename[len(prefix):].replace(os.sep, "/")
                    break
            self._rel[filename] = r
        return r

    def hook(self, frame, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        fn = code.co_filename
        rel = self._rel.get(fn)
        if rel is None:
            rel = self.rel(fn)
        if not rel:
            return
        self.calls += 1
        self.threads.add(threading.get_ident())
        back = frame.f_back
        back_fn = back.f_code.co_filename if back is not None else None
        f = self.files.get(rel)
        if back_fn != fn:
            if f is None:
                f = self.files[rel] = {"entries": 0, "calls": 0, "functions": {}}
            f["entries"] += 1
            self.sequence.append(rel)
            src = (self.rel(back_fn) or "(outside)") if back_fn is not None else "(event loop)"
            key = f"{src} -> {rel}"
            self.edges[key] = self.edges.get(key, 0) + 1
        elif f is None:  # cannot happen (a same-file caller entered first); kept safe
            f = self.files[rel] = {"entries": 0, "calls": 0, "functions": {}}
        f["calls"] += 1
        name = getattr(code, "co_qualname", code.co_name)
        f["functions"][name] = f["functions"].get(name, 0) + 1

    def result(self) -> dict[str, Any]:
        return {"files": [{"file": k, "entries": v["entries"], "calls": v["calls"],
                           "functions": list(v["functions"]), "function_calls": v["functions"]}
                          for k, v in self.files.items()],
                "sequence": self.sequence, "edges": self.edges, "calls": self.calls,
                "threads": len(self.threads), "dirs": {n: p[:-1] for p, n in self.prefixes}}


def _set_profile(fn) -> None:
    if hasattr(threading, "setprofile_all_threads"):  # Python 3.12+
        threading.setprofile_all_threads(fn)
    else:
        threading.setprofile(fn)  # threads started from now on
        sys.setprofile(fn)  # this thread: the main one, where signal handlers run


def _tracee(gateway_argv: list[str]) -> None:
    """Run ``python -m gateway GATEWAY_ARGV`` in this process with the SIGUSR1 / SIGUSR2
    recording switch installed."""
    import importlib.util
    import runpy

    out = os.environ[ENV_OUT]
    dirs = {}
    for name in DIRS:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            dirs[name] = os.path.realpath(next(iter(spec.submodule_search_locations)))
    rec = _Recorder(dirs)

    def start(signum, frame) -> None:
        rec.reset()
        _set_profile(rec.hook)
        Path(out + ".on").write_text("on")  # tells the driver the hook is in place

    def stop(signum, frame) -> None:
        _set_profile(None)
        tmp = out + ".tmp"
        Path(tmp).write_text(json.dumps(rec.result()))
        os.replace(tmp, out)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    sys.argv = ["gateway", *gateway_argv]
    runpy.run_module("gateway", run_name="__main__", alter_sys=True)


# --- the driver ---------------------------------------------------------------------------------------------


def _chat(port: int, timeout_s: float, keep: list | None = None) -> bytes:
    """One streamed chat completion on a new connection, read to its end; raises unless
    it is a 200 event stream that ends with ``data: [DONE]`` and carries the usage. With
    ``keep`` the connection is appended to it, open, for the caller to close."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello " * 20}], "max_tokens": 8,
                       "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        raw = r.read()
    finally:
        if keep is None:
            conn.close()
        else:
            keep.append(conn)
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {raw[:300]!r}")
    if not raw.rstrip().endswith(b"data: [DONE]") or b'"usage"' not in raw:
        raise RuntimeError(f"not a complete stream with usage: {raw[-300:]!r}")
    return raw


def _wait_ready(port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway exited with {proc.returncode}")
        try:
            _chat(port, 5.0)
            return
        except (OSError, RuntimeError, http.client.HTTPException) as e:
            last = f"{type(e).__name__}: {e}"
        time.sleep(0.1)
    raise RuntimeError(f"the gateway did not answer a chat completion within {timeout_s} s ({last})")


def _wait_file(path: Path, proc: subprocess.Popen, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway exited with {proc.returncode} before {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {timeout_s} s")
        time.sleep(0.01)


def _log_tail(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return ("; gateway log: " + " | ".join(ln[:300] for ln in lines[-5:])) if lines else ""


def walk(warmup: int = 3, timeout_s: float = 60.0, settle_ms: float = 200.0) -> dict[str, Any]:
    """Start the backend and the traced gateway, warm up, record one streamed request;
    returns the tracee's JSON (see :meth:`_Recorder.result`) plus ``response_bytes``."""
    import yaml  # here, not at the top: the tracee (same module) imports no more than it needs

    from loadtest import procs

    tmp = Path(tempfile.mkdtemp(prefix="tg-walk-"))
    out = tmp / "walk.json"
    log = tmp / "gateway.log"
    zero = gw = None
    try:
        zero, zurl = procs.start_zero(timeout_s=timeout_s)
        cfg = {"listen": {"host": "127.0.0.1"},
               "routing": {"scrape_interval_s": 0}, "health": {"interval_s": 3600},
               "lifecycle": {"watch_config_s": 0},
               "backends": [{"name": "z0", "url": zurl, "models": [MODEL]}]}
        (tmp / "gw.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        port = procs.free_port()
        env = {**os.environ, ENV_OUT: str(out),
               "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
        with open(log, "wb") as lf:
            gw = subprocess.Popen([sys.executable, "-m", "loadtest.request_walk", "--tracee", "--",
                                   "--config", str(tmp / "gw.yaml"), "--port", str(port)],
                                  cwd=str(ROOT), env=env, stdin=subprocess.DEVNULL, stdout=lf, stderr=subprocess.STDOUT)
        try:
            _wait_ready(port, gw, timeout_s)
            for _ in range(max(0, warmup - 1)):
                _chat(port, timeout_s)
            time.sleep(settle_ms / 1000)  # the last warm-up's bookkeeping after its [DONE] ends first
            gw.send_signal(signal.SIGUSR1)
            _wait_file(Path(str(out) + ".on"), gw, timeout_s, "recording start")
            kept: list[http.client.HTTPConnection] = []
            try:
                raw = _chat(port, timeout_s, kept)
                time.sleep(settle_ms / 1000)
                gw.send_signal(signal.SIGUSR2)
                _wait_file(out, gw, timeout_s, "recording")
            finally:
                for c in kept:  # closed after recording: the connection's end is not part of the walk
                    c.close()
        except RuntimeError as e:
            raise RuntimeError(f"{e}{_log_tail(log)}") from None
        res = json.loads(out.read_text())
        res["response_bytes"] = len(raw)
        res["root"] = str(ROOT)
        return res
    finally:
        if gw is not None:
            procs.stop(gw)
        if zero is not None:
            procs.stop(zero)
        for p in (out, Path(str(out) + ".on"), tmp / "gw.yaml", log):
            p.unlink(missing_ok=True)
        try:
            tmp.rmdir()
        except OSError:
            pass


def _source_state() -> str:
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = [ln for ln in subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", *DIRS],
                                             capture_output=True, text=True, timeout=10).stdout.split("\n")
                 if ln.strip()]
    except (OSError, subprocess.TimeoutExpired):
        return "not a git checkout"
    if not head:
        return "not a git checkout"
    return head + (f" + uncommitted changes in {len(dirty)} path(s) of gateway/ routing/" if dirty else "")


def report(res: dict[str, Any]) -> str:
    files = res["files"]
    entries = sum(f["entries"] for f in files)
    lines = [(f"# one streamed chat completion (max_tokens 8, include_usage, new connection) through the gateway "
              f"at {res['root']} ({_source_state()}); {res['response_bytes']} bytes of response"),
             (f"{len(files)} distinct files of gateway/ and routing/ entered; {entries} entries, {res['calls']} "
              f"Python calls in them, on {res['threads']} thread(s)"),
             "", "entries  calls  file: functions called in it, in first-call order"]
    width = max([len(f["file"]) for f in files] + [4])
    for f in files:
        lines.append(f"{f['entries']:7d}  {f['calls']:5d}  {f['file']:<{width}}  {', '.join(f['functions'])}")
    lines += ["", "entries in order:"]
    line = " "
    for s in res["sequence"]:
        piece = f" {s.removesuffix('.py')} >"
        if len(line) + len(piece) > 110:
            lines.append(line)
            line = " "
        line += piece
    lines.append(line.rstrip(" >"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--tracee"]:
        rest = argv[1:]
        _tracee(rest[1:] if rest[:1] == ["--"] else rest)
        return 0
    ap = argparse.ArgumentParser(prog="python -m loadtest.request_walk", description=__doc__.split("\n")[0])
    ap.add_argument("--warmup", type=int, default=3, help="streamed requests before the recorded one")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds; bounds every wait")
    ap.add_argument("--settle-ms", type=float, default=200.0,
                    help="quiet time before recording starts and after the response ended before it stops")
    ap.add_argument("--json", help="write the raw record here")
    args = ap.parse_args(argv)
    try:
        res = walk(args.warmup, args.timeout, args.settle_ms)
    except RuntimeError as e:
        print(f"request walk failed: {e}", file=sys.stderr)
        return 1
    print(report(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
