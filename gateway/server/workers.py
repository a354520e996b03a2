"""``python -m gateway --workers N``: one listening port served by N processes.

Each worker is a full gateway process (its own event loop, upstream connection
pools and routing state) bound to the same address with ``SO_REUSEPORT``, so the
kernel spreads incoming connections across them. Workers share the routing view
through the configured shared store (``state.url``, see :mod:`gateway.store.routing_state`),
exactly as replicas on different machines do; without one, each worker routes on its
private view and a warning says so. A demo fleet (``simulate:`` backends) is started
once, by the parent, and shared by every worker.

The parent forwards SIGINT/SIGTERM to the workers and exits with the first non-zero
worker exit code, or 0.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import sys
from typing import Any

log = logging.getLogger("gateway.server.workers")


def _worker(config_path: str, host: str, port: int, log_level: str, urls: dict[str, str], index: int) -> None:
    from gateway.config import load_config
    from gateway.server.app import create_app
    from gateway.server.run import serve, setup_logging

    setup_logging(log_level)
    cfg = load_config(config_path)
    try:
        import uvloop
        run: Any = uvloop.run
    except ImportError:
        import asyncio
        run = asyncio.run
    try:
        run(serve(create_app(cfg, urls), host, port, reuse_port=True))
    except OSError as e:
        print(f"error: worker {index} cannot listen on {host}:{port}: {e.strerror}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        pass


def run_workers(cfg, config_path: str, host: str, port: int, n: int, log_level: str) -> int:
    """Start ``n`` workers on ``host:port`` and wait for them. Returns the exit code."""
    with socket.socket() as probe:  # say "address in use" once, before forking
        probe.bind((host, port))
    demo = None
    urls: dict[str, str] = {}
    if any(b.simulate for b in cfg.backends):  # first: it validates the `simulate:` sections
        from gateway.ops.demo_fleet import start_demo_fleet_sync
        demo, urls = start_demo_fleet_sync([b for b in cfg.backends if b.simulate])
    if cfg.state.url is None:
        log.warning("--workers %d without state.url: each worker routes on its own private view; "
                    "set state.url (Redis) to share load and prefix placement between them", n)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(config_path, host, port, log_level, urls, i), name=f"worker-{i}")
             for i in range(n)]
    for p in procs:
        p.start()

    def forward(sig: int, _frame: object) -> None:
        for p in procs:
            if p.pid and p.is_alive():
                os.kill(p.pid, sig)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    code = 0
    for p in procs:
        p.join()
        if p.exitcode and not code:
            code = p.exitcode if p.exitcode > 0 else 0
    if demo is not None:
        if demo.stdin is not None:
            demo.stdin.close()
        demo.wait(10)
    return code
