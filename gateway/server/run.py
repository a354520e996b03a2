"""Running one gateway process: JSON logs, serving until a signal, the drain, the
garbage collector's young-generation threshold (:data:`YOUNG_GC_THRESHOLD`).

Signals: SIGTERM (or SIGINT) drains: the listening socket closes at once, in-flight
requests and streams finish for up to ``lifecycle.drain_timeout_s`` (then they are
cut); a second SIGTERM/SIGINT stops at once. SIGHUP reloads the config file (see
:mod:`gateway.ops.config_reload`).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import signal
import sys

from aiohttp import web

from gateway.ops.config_reload import reload_from_file
from gateway.runtime import STATE
from gateway.server.listener import listen

log = logging.getLogger("gateway")

# CPython collects its youngest generation once the container objects made exceed those
# freed by ``threshold0`` (700 by default; gc.set_threshold in the Python docs). A request
# makes and frees a few hundred and keeps a few, so at 700 the collections follow the
# swings of the requests in flight: each one moves their live objects to the older
# generations, whose growth then brings on full collections of the whole heap (tens of
# millions of instructions each, every couple of thousand requests). From this many on,
# the collections follow what the process keeps; cyclic garbage waits at most that many
# objects longer to be freed.
YOUNG_GC_THRESHOLD = 10_000


class _JsonFormatter(logging.Formatter):
    """One JSON object a line: ``ts``, ``level``, ``logger``, ``msg``, and ``trace_id``
    and ``span_id`` (hex) when the record was made while a traced request's span was
    current (:mod:`gateway.ops.tracing`), ``exc`` with a traceback."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage()}
        trace_id = getattr(record, "trace_id", None)
        if trace_id is not None:
            out["trace_id"], out["span_id"] = trace_id, getattr(record, "span_id", "")
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(level: str) -> None:
    """JSON log lines on stderr at ``level`` (``debug``, ``info``, ``warning``, ``error``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


async def serve(app: web.Application, host: str, port: int, reuse_port: bool = False) -> None:
    """Serve ``app`` on ``host:port`` until SIGINT or SIGTERM, then drain (see the
    module doc); SIGHUP reloads the config file. Raises ``OSError`` when the address
    cannot be bound."""
    gc.set_threshold(YOUNG_GC_THRESHOLD, *gc.get_threshold()[1:])
    server = await listen(app, host, port, reuse_port=reuse_port)
    picker = None  # gateway.epp.grpc_server.EndpointPicker, with listen.epp
    try:
        addr = server.addresses[0]
        log.info("turbo-gateway listening on http://%s:%d", addr[0], addr[1])
        print(f"turbo-gateway listening on http://{addr[0]}:{addr[1]}", file=sys.stderr, flush=True)
        epp = app[STATE].cfg.listen.epp
        if epp.enabled:
            from gateway.epp.grpc_server import EndpointPicker  # grpc and Envoy's protos load only when used
            picker = EndpointPicker(app[STATE])
            epp_host = epp.host or host
            epp_port = await picker.start(epp_host, epp.port)
            log.info("endpoint picker (Envoy ext_proc, gRPC) listening on %s:%d", epp_host, epp_port)
            print(f"endpoint picker (Envoy ext_proc, gRPC) listening on {epp_host}:{epp_port}", file=sys.stderr,
                  flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        reloads: set[asyncio.Task] = set()

        def on_hup() -> None:
            t = loop.create_task(reload_from_file(app, "SIGHUP"))
            reloads.add(t)
            t.add_done_callback(reloads.discard)

        loop.add_signal_handler(signal.SIGHUP, on_hup)
        await stop.wait()
        drain_s = app[STATE].cfg.lifecycle.drain_timeout_s  # the value after any reload
        in_flight = sum(b.in_flight for b in app[STATE].fleet.backends.values())
        log.warning("draining: stopped accepting connections; waiting up to %.0f s for %d in-flight request(s)",
                    drain_s, in_flight)
        if picker is not None:
            await picker.drain()
        main = asyncio.current_task()
        assert main is not None  # a coroutine runs in a task
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal stops at once
            loop.add_signal_handler(sig, main.cancel)
    finally:
        try:
            drain_s = app[STATE].cfg.lifecycle.drain_timeout_s
            await asyncio.gather(server.shutdown(drain_s), *([picker.stop(drain_s)] if picker is not None else []))
        except asyncio.CancelledError:
            log.warning("second signal: stopped without finishing the drain")
        log.info("shut down")
