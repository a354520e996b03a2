"""``python -m loadtest.sim``: start simulated backends on loopback ports.

    python -m loadtest.sim --spec '[{"name": "sim-a", "models": ["demo-model"]}]'

prints one JSON line ``{"sim-a": "http://127.0.0.1:PORT", ...}`` once every backend
listens, then serves until SIGINT/SIGTERM, or until standard input closes when
``--exit-on-stdin-eof`` is given (how the gateway ties a demo fleet to its own life).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

from loadtest.sim.server import SimBackendConfig, start_backends


async def _serve(configs: list[SimBackendConfig], exit_on_eof: bool) -> None:
    runners, urls = await start_backends(configs)
    print(json.dumps(urls), flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if exit_on_eof:
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

        async def watch() -> None:
            while await reader.read(4096):
                pass
            stop.set()

        watcher = asyncio.create_task(watch())
    await stop.wait()
    if exit_on_eof:
        watcher.cancel()
    for r in runners:
        await r.cleanup()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.sim", description=__doc__.split("\n")[0])
    ap.add_argument("--spec", required=True, help="JSON list of backend objects (name, models, timing fields)")
    ap.add_argument("--exit-on-stdin-eof", action="store_true")
    args = ap.parse_args(argv)
    try:
        configs = [SimBackendConfig(**b) for b in json.loads(args.spec)]
    except (ValueError, TypeError) as e:
        print(f"python -m loadtest.sim: invalid --spec: {e}", file=sys.stderr)
        return 2
    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    run(_serve(configs, args.exit_on_stdin_eof))
    return 0


if __name__ == "__main__":
    sys.exit(main())
