"""``python -m gateway --config backends.yaml [--host H] [--port P] [--epp [--grpc-port G]] [--log-level L]``.

``--epp`` also serves the endpoint picker behind Envoy (gRPC ext_proc, see
:mod:`gateway.epp.picker`) on ``--grpc-port`` (``listen.epp`` in the config).

Exit codes: 0 after a clean shutdown (SIGINT/SIGTERM), 2 for a user error (bad
config, address in use), 1 for anything unexpected.

Signals: SIGTERM (or SIGINT) drains: the listening socket closes at once, in-flight
requests and streams finish for up to ``lifecycle.drain_timeout_s`` (then they are
cut), and the process exits 0; a second SIGTERM/SIGINT stops at once. SIGHUP reloads
the config file (see :mod:`gateway.ops.config_reload`).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import errno
import logging
import os
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

from gateway.config import ConfigError, GatewayConfig, load_config
from gateway.ops.demo_fleet import DemoFleetError, InvalidSimulateSection
from gateway.server.app import create_app
from gateway.server.run import serve, setup_logging

log = logging.getLogger("gateway")


def prog_name() -> str:
    """How the user started the gateway: ``turbo-gateway`` (the installed command) or
    ``python -m gateway``, for the usage line and ``--help``."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "python -m gateway" if name in ("", "__main__.py", "-c") else name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog_name(),
                                 description="turbo-gateway: an OpenAI-compatible, traffic-aware LLM gateway")
    ap.add_argument("--config", required=True, help="path to backends.yaml")
    ap.add_argument("--host", help="listen address (overrides listen.host; default 127.0.0.1)")
    ap.add_argument("--port", type=int, help="listen port (overrides listen.port; default 8080)")
    ap.add_argument("--epp", action="store_true",
                    help="also serve as Envoy's endpoint picker (gRPC ext_proc; sets listen.epp.enabled)")
    ap.add_argument("--grpc-port", type=int, help="the endpoint picker's gRPC port (overrides listen.epp.port)")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    ap.add_argument("--workers", type=int, default=1,
                    help="processes sharing the listening port (SO_REUSEPORT); share state via state.url")
    args = ap.parse_args(argv)
    setup_logging(args.log_level)
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    epp = cfg.listen.epp
    if args.epp or args.grpc_port is not None:
        if args.grpc_port is not None and not 0 <= args.grpc_port <= 65535:
            print(f"error: --grpc-port {args.grpc_port} is not a valid TCP port", file=sys.stderr)
            return 2
        epp = epp.model_copy(update={"enabled": epp.enabled or args.epp,
                                     "port": epp.port if args.grpc_port is None else args.grpc_port})
        cfg = cfg.model_copy(update={"listen": cfg.listen.model_copy(update={"epp": epp})})
    if epp.enabled and args.workers > 1:
        print("error: the endpoint picker serves from one process; run replicas sharing state.url instead "
              "of --workers", file=sys.stderr)
        return 2
    host = args.host or cfg.listen.host
    port = cfg.listen.port if args.port is None else args.port
    if not 0 <= port <= 65535:
        print(f"error: --port {port} is not a valid TCP port", file=sys.stderr)
        return 2
    run: Callable[[Coroutine[Any, Any, None]], None]
    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    started = time.monotonic()
    if args.workers > 1:
        from gateway.server.workers import run_workers
        try:
            return run_workers(cfg, args.config, host, port, args.workers, args.log_level)
        except OSError as e:
            print(f"error: cannot listen on {host}:{port}: {e.strerror}", file=sys.stderr)
            return 2
        except InvalidSimulateSection as e:
            print(f"error: {_invalid_section(args.config, cfg, e)}", file=sys.stderr)
            return 2
        except DemoFleetError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    try:
        run(serve(create_app(cfg, config_path=args.config), host, port))
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            print(f"error: cannot listen on {host}:{port}: the address is already in use "
                  "(another process holds that port; pick another with --port)", file=sys.stderr)
            return 2
        if e.errno in (errno.EADDRNOTAVAIL, errno.EACCES):
            print(f"error: cannot listen on {host}:{port}: {e.strerror}", file=sys.stderr)
            return 2
        if e.errno is None:  # the endpoint picker's gRPC port (gateway.epp.picker says which)
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise
    except InvalidSimulateSection as e:
        print(f"error: {_invalid_section(args.config, cfg, e)}", file=sys.stderr)
        return 2
    except DemoFleetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    log.debug("ran for %.1f s", time.monotonic() - started)
    return 0


def _invalid_section(path: str, cfg: GatewayConfig, e: InvalidSimulateSection) -> str:
    """A ``simulate:`` section the simulator refused, said as a config error is."""
    i = next((i for i, b in enumerate(cfg.backends) if b.name == e.backend), None)
    return f"{path}: invalid config at `backends.{i}.simulate`: {e.message}"


def cli() -> None:
    """The command (``turbo-gateway``, ``python -m gateway``): :func:`main`, then exit at
    once. Everything the gateway opened is closed by then; the interpreter's own
    teardown of every imported module would only keep the process alive for a second
    or so after its last log line. The exit handlers (log flush, coverage) still run.
    Under a profiler (``python -m cProfile -o OUT -m gateway``) the interpreter exits
    normally, so that the profiler writes its output."""
    code = main()
    if sys.getprofile() is not None:
        sys.exit(code)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    cli()
