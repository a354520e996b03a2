"""``python -m loadtest.sim``: start simulated vLLM-like backends on loopback ports.

    python -m loadtest.sim --spec '[{"name": "sim-a", "models": ["demo-model"], "profile": "demo"}]'
    python -m loadtest.sim --fleet loadtest/fleets/hetero6.yaml --write-gateway-config /tmp/gw.yaml

Prints one JSON line ``{"sim-a": "http://127.0.0.1:PORT", ...}`` on standard output once
every backend listens (a human-readable table goes to standard error), then serves until
SIGINT/SIGTERM, or until standard input closes when ``--exit-on-stdin-eof`` is given
(how the gateway ties a demo fleet to its own life). ``--spec`` entries and fleet-file
backends take the fields of :class:`loadtest.sim.spec.SimBackendConfig`. The gateway
starts its demo fleet with ``--gateway-backends``: each backend's name, models and
``simulate:`` section, which this process validates itself
(:func:`loadtest.sim.spec.check_simulate`), so that the gateway imports nothing from
``loadtest``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
from pathlib import Path

from loadtest.sim.fleet import Fleet, dump_gateway_config, gateway_config, load_fleet
from loadtest.sim.server import SimBackend, SimBackendConfig, start_backends
from loadtest.sim.spec import check_simulate


async def _serve(configs: list[SimBackendConfig], exit_on_eof: bool, fleet: Fleet | None,
                 write_config: str | None) -> None:
    backends, urls = await start_backends(configs)
    if fleet is not None and write_config:
        header = ("# Written by `python -m loadtest.sim --fleet`: the gateway config fronting that\n"
                  "# simulated fleet. Valid while that process runs.\n")
        kv_sources = {b.cfg.name: {"endpoint": b.kv_publisher.endpoint, "topic": b.kv_publisher.cfg.topic,
                                   "replay_endpoint": b.kv_publisher.replay_endpoint}
                      for b in backends if b.kv_publisher is not None}
        Path(write_config).write_text(dump_gateway_config(gateway_config(fleet, urls, kv_sources), header),
                                      encoding="utf-8")
    print(json.dumps(urls), flush=True)
    _describe(backends, fleet, write_config)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if exit_on_eof:
        # A daemon thread, not connect_read_pipe: works for pipes, files and /dev/null
        # alike (uvloop aborts on a non-pipe stdin) and never blocks the exit.
        def watch() -> None:
            try:
                fd = sys.stdin.fileno()
                while os.read(fd, 4096):  # not sys.stdin: its buffer lock would
                    pass                  # abort interpreter shutdown on a signal
            except (OSError, ValueError):
                pass
            loop.call_soon_threadsafe(stop.set)

        threading.Thread(target=watch, name="stdin-eof", daemon=True).start()
    await stop.wait()
    for b in backends:
        await b.cleanup()


def _describe(backends: list[SimBackend], fleet: Fleet | None, write_config: str | None) -> None:
    pools = {b.sim.name: b.pool for b in fleet.backends} if fleet else {}
    for b in backends:
        print(f"  {b.cfg.name:<16} {b.url:<24} profile={b.profile.name} role={b.role} "
              f"pool={pools.get(b.cfg.name, '-')} speed={b.cfg.speed:g}", file=sys.stderr)
        if b.kv_publisher is not None:
            print(f"  {'':<16} kv events {b.kv_publisher.endpoint}, replay {b.kv_publisher.replay_endpoint}",
                  file=sys.stderr)
    if write_config:
        print(f"gateway config written to {write_config}: python -m gateway --config {write_config}",
              file=sys.stderr)
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.sim", description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--spec", help="JSON list of backend objects (SimBackendConfig fields)")
    src.add_argument("--fleet", help="fleet YAML file (see loadtest/fleets/)")
    src.add_argument("--gateway-backends", metavar="JSON",
                     help="JSON list of a gateway's simulated backends ({name, models, simulate}: the "
                     "`simulate:` section of each); an invalid section is reported as one JSON line on "
                     "standard output, {\"invalid\": {\"backend\": NAME, \"message\": ...}}, exit code 2")
    ap.add_argument("--write-gateway-config", metavar="OUT.yaml",
                    help="with --fleet: write a gateway config fronting the fleet")
    ap.add_argument("--speed", type=float, help="override every backend's speed factor")
    ap.add_argument("--exit-on-stdin-eof", action="store_true")
    ap.add_argument("--loop", choices=("auto", "uvloop", "asyncio"), default="auto",
                    help="event loop (auto: uvloop when installed)")
    args = ap.parse_args(argv)
    if args.write_gateway_config and not args.fleet:
        ap.error("--write-gateway-config needs --fleet")
    if args.speed is not None and args.speed <= 0:
        ap.error("--speed must be > 0")
    fleet = None
    try:
        if args.fleet:
            fleet = load_fleet(args.fleet)
            configs = [b.sim for b in fleet.backends]
        elif args.gateway_backends:
            configs = []
            for b in json.loads(args.gateway_backends):
                try:
                    configs.append(check_simulate(b["name"], b["models"], b["simulate"]))
                except ValueError as e:
                    print(json.dumps({"invalid": {"backend": b["name"], "message": str(e)}}), flush=True)
                    return 2
        else:
            spec = json.loads(args.spec)
            if not isinstance(spec, list):
                raise ValueError("--spec must be a JSON list of backend objects")
            configs = [SimBackendConfig.from_dict(b) for b in spec]
        if args.speed is not None:
            for c in configs:
                c.speed = args.speed
    except (ValueError, TypeError) as e:
        print(f"python -m loadtest.sim: invalid {'--fleet' if args.fleet else '--spec'}: {e}", file=sys.stderr)
        return 2
    run = asyncio.run
    if args.loop != "asyncio":
        try:
            import uvloop
            run = uvloop.run
        except ImportError:
            if args.loop == "uvloop":
                raise
    try:
        run(_serve(configs, args.exit_on_stdin_eof, fleet, args.write_gateway_config))
    except OSError as e:
        print(f"python -m loadtest.sim: cannot listen: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
