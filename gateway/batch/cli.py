"""Command line: queue consumers and the local (no Redis) mode.

``python -m gateway.batch --config backends.yaml [--workers N] [--gateway URL]``
    A consumer process: drains the batch queue named by the config (``batch.redis_url``
    or ``state.url``) with N lines in flight, sending each to the gateway
    (``--gateway``, else ``batch.gateway_url``, else the ``listen`` address) with the
    batch priority class. Run as many as you like on any machine. SIGTERM/SIGINT stop
    it: it takes no new line, gives the lines in flight ``batch.drain_timeout_s`` to
    finish, hands the rest back to the other consumers (who take them at once, not
    after ``visibility_timeout_s``) and exits 0; a second signal hands back at once.
    ``--no-priority`` sends lines as ordinary interactive requests (for comparison).

``python -m gateway.batch run input.jsonl --target URL -o output.jsonl [--concurrency 8]``
    The everyday case, one file and one endpoint, no Redis: sends every line of an
    OpenAI batch input file to ``URL`` (any OpenAI-compatible server or a gateway), with
    a progress bar, the same per-line timeout and retries, results appended to the
    output file as they come (OpenAI batch output format; failures to ``--errors``,
    default ``<output>.errors.jsonl``) and a summary. Run it again to resume: lines whose
    ``custom_id`` is already in the output are skipped.

Exit codes: 0 done (``run``: every line succeeded), 1 some lines failed, 2 usage or
configuration error.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import signal
import sys
import time
from pathlib import Path

import orjson

log = logging.getLogger("gateway.batch")


def _consumer_main(argv: list[str]) -> int:
    from gateway.batch.job_store import BatchStore
    from gateway.batch.senders import HttpSender
    from gateway.batch.worker import Consumer
    from gateway.config import ConfigError, load_config

    ap = argparse.ArgumentParser(
        prog="python -m gateway.batch",
        description="Drain the gateway's batch queue (see also: python -m gateway.batch run -h)")
    ap.add_argument("--config", required=True, help="backends.yaml (its batch: and state: sections)")
    ap.add_argument("--workers", type=int, default=8, help="lines in flight in this process (default 8)")
    ap.add_argument("--gateway", help="gateway base URL (default: batch.gateway_url, else the listen address)")
    ap.add_argument("--no-priority", action="store_true",
                    help="send lines as interactive requests (no batch priority class; for benchmarks)")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    url = cfg.batch.redis_url or cfg.state.url
    if not url:
        print(f"error: {args.config}: set batch.redis_url or state.url (the batch queue lives in Redis)",
              file=sys.stderr)
        return 2
    if args.workers < 1:
        print("error: --workers must be >= 1", file=sys.stderr)
        return 2
    host = cfg.listen.host if cfg.listen.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    gateway = args.gateway or cfg.batch.gateway_url or f"http://{host}:{cfg.listen.port}"

    async def main() -> None:
        store = BatchStore.from_url(url, cfg.state.namespace, cfg.batch.files_dir)
        sender = HttpSender(gateway, cfg.batch.request_timeout_s, priority=not args.no_priority,
                            api_key=os.environ.get("TURBO_GATEWAY_API_KEY"))
        consumer = Consumer(store, sender, cfg.batch, concurrency=args.workers)
        stop = asyncio.Event()
        hurry = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            if stop.is_set():
                print(f"batch consumer {consumer.name}: second signal: handing back the lines in flight now",
                      file=sys.stderr, flush=True)
                hurry.set()
                return
            print(f"batch consumer {consumer.name}: draining: no new lines; {len(consumer.held)} in flight get up "
                  f"to {cfg.batch.drain_timeout_s:g} s, then the rest is handed back", file=sys.stderr, flush=True)
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        print(f"batch consumer {consumer.name}: {args.workers} workers -> {gateway}", file=sys.stderr, flush=True)
        try:
            await consumer.run(stop, hurry=hurry)
        finally:
            await sender.close()
            await store.close()
        print(f"batch consumer {consumer.name}: stopped after {consumer.processed} lines; handed back "
              f"{consumer.handed_back} unfinished", file=sys.stderr, flush=True)

    asyncio.run(main())
    return 0


# ---- local mode ------------------------------------------------------------------


class Progress:
    """A one-line progress bar on stderr (a line every 5 s when stderr is not a TTY)."""

    def __init__(self, total: int, skipped: int) -> None:
        self.total, self.skipped = total, skipped
        self.ok = self.failed = 0
        self.start = time.monotonic()
        self.tty = sys.stderr.isatty()
        self._last = 0.0

    def update(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < (0.1 if self.tty else 5.0):
            return
        self._last = now
        done = self.ok + self.failed
        todo = self.total - self.skipped
        rate = done / max(now - self.start, 1e-9)
        eta = (todo - done) / rate if rate > 0 else 0.0
        width = 30
        filled = int(width * (done / todo if todo else 1.0))
        bar = "#" * filled + "." * (width - filled)
        text = (f"[{bar}] {done}/{todo}  ok {self.ok}  failed {self.failed}  {rate:.1f} lines/s  "
                f"ETA {int(eta // 60)}:{int(eta % 60):02d}")
        print(("\r" + text) if self.tty else text, end="" if self.tty else "\n", file=sys.stderr, flush=True)


def _done_ids(path: Path) -> set[str]:
    """custom_ids already in ``path``; a truncated last line (a crash mid-write) is cut."""
    if not path.exists():
        return set()
    raw = path.read_bytes()
    if raw and not raw.endswith(b"\n"):
        keep = raw.rfind(b"\n") + 1
        with open(path, "r+b") as f:
            f.truncate(keep)
        raw = raw[:keep]
    ids = set()
    for line in raw.splitlines():
        try:
            cid = orjson.loads(line).get("custom_id")
        except (orjson.JSONDecodeError, AttributeError):
            continue
        if isinstance(cid, str):
            ids.add(cid)
    return ids


def _run_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m gateway.batch run",
                                 description="Run an OpenAI batch input file against one endpoint (no Redis); "
                                             "resumable.")
    ap.add_argument("input", help="input .jsonl (OpenAI batch format: custom_id, method, url, body)")
    ap.add_argument("--target", required=True, help="base URL of an OpenAI-compatible server, e.g. http://host:8000")
    ap.add_argument("-o", "--output", required=True, help="output .jsonl (appended; lines in it are skipped)")
    ap.add_argument("--errors", help="error .jsonl (default: <output>.errors.jsonl; rewritten each run)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=180.0, help="per-request timeout in seconds (default 180)")
    ap.add_argument("--max-attempts", type=int, default=3)
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                    help="sent as Authorization: Bearer (default: $OPENAI_API_KEY)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    if args.concurrency < 1 or args.max_attempts < 1 or args.timeout <= 0:
        print("error: --concurrency and --max-attempts must be >= 1, --timeout > 0", file=sys.stderr)
        return 2
    try:
        raw = Path(args.input).read_bytes()
    except OSError as e:
        print(f"error: cannot read {args.input}: {e.strerror or e}", file=sys.stderr)
        return 2
    return asyncio.run(run_local(raw, args))


async def run_local(raw: bytes, args: argparse.Namespace) -> int:
    from gateway.batch.line_attempts import run_with_retries
    from gateway.batch.manager import parse_input
    from gateway.batch.output_lines import output_line
    from gateway.batch.senders import HttpSender
    from routing.core import RetryPolicy

    out_path = Path(args.output)
    err_path = Path(args.errors or f"{args.output}.errors.jsonl")
    valid, bad = parse_input(raw, None)
    done = _done_ids(out_path)
    todo = [v for v in valid if v[1] not in done]
    progress = Progress(len(valid) + len(bad), len(valid) - len(todo))
    sender = HttpSender(args.target, args.timeout, priority=False, api_key=args.api_key)
    policy = RetryPolicy(args.max_attempts, 0.5, 30.0, rng=random.Random())
    queue: asyncio.Queue = asyncio.Queue()
    for item in todo:
        queue.put_nowait(item)
    started = time.monotonic()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "ab") as out, open(err_path, "wb") as err:
        for _i, cid, message in bad:
            err.write(output_line(cid, None, None, None, {"code": "invalid_request", "message": message}) + b"\n")
            progress.failed += 1
        err.flush()

        async def work() -> None:
            while True:
                try:
                    _i, cid, url, body = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                res = await run_with_retries(sender, url, body, cid, request_timeout_s=args.timeout,
                                             policy=policy, request_id=f"run-{cid}")
                assert res is not None
                ok, line = res
                f = out if ok else err
                f.write(line + b"\n")
                f.flush()
                if ok:
                    progress.ok += 1
                else:
                    progress.failed += 1
                if not args.quiet:
                    progress.update()

        try:
            await asyncio.gather(*(work() for _ in range(min(args.concurrency, max(len(todo), 1)))))
        finally:
            await sender.close()
    if not args.quiet:
        progress.update(force=True)
        if progress.tty:
            print(file=sys.stderr)
    elapsed = time.monotonic() - started
    ran = progress.ok + progress.failed
    print(f"{len(valid) + len(bad)} lines: {progress.ok} ok, {progress.failed} failed, {progress.skipped} skipped "
          f"(already in {out_path}); {elapsed:.1f} s, {ran / max(elapsed, 1e-9):.1f} lines/s"
          + (f"; errors in {err_path}" if progress.failed else ""), file=sys.stderr)
    if not progress.failed and err_path.exists() and err_path.stat().st_size == 0:
        err_path.unlink()
    return 1 if progress.failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":
        return _run_main(argv[1:])
    return _consumer_main(argv)
