"""The demo fleet: simulated backends (``simulate:`` in ``backends.yaml``) that the
gateway starts itself, as a ``python -m loadtest.sim`` child process.

The gateway does not import ``loadtest`` (DESIGN.md section 2): it talks to the child
over its standard streams and to the backends over HTTP. The child exits when the
gateway closes its standard input, so a killed gateway leaves no orphans behind.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from gateway.config import Backend

START_TIMEOUT_S = 30.0


class DemoFleetError(Exception):
    """The simulated fleet did not start; the message says why."""


def start_demo_fleet_sync(backends: list[Backend]) -> tuple[subprocess.Popen, dict[str, str]]:
    """Blocking variant of :meth:`DemoFleet.start` for a parent process without an
    event loop (``--workers``). Close the child's stdin to stop it. Raises
    :class:`DemoFleetError`."""
    spec = [{"name": b.name, "models": b.models, **b.simulate} for b in backends if b.simulate]
    proc = subprocess.Popen([sys.executable, "-m", "loadtest.sim", "--spec", json.dumps(spec), "--exit-on-stdin-eof"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    try:
        urls = json.loads(line) if line else None
    except ValueError:
        urls = None
    if not isinstance(urls, dict):
        proc.kill()
        proc.wait()
        raise DemoFleetError("the simulated demo fleet (python -m loadtest.sim) failed to start")
    return proc, urls


class DemoFleet:
    """A running child process serving the simulated backends."""

    def __init__(self, proc: asyncio.subprocess.Process, urls: dict[str, str]) -> None:
        self.proc = proc
        self.urls = urls

    @classmethod
    async def start(cls, backends: list[Backend]) -> "DemoFleet":
        """Start every backend with a ``simulate`` section on a free loopback port.
        Returns the fleet with ``urls`` = ``{name: base_url}``. Raises
        :class:`DemoFleetError`."""
        spec = [{"name": b.name, "models": b.models, **b.simulate} for b in backends if b.simulate]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "loadtest.sim", "--spec", json.dumps(spec), "--exit-on-stdin-eof",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)  # type: ignore[union-attr]
            urls = json.loads(line) if line else None
        except (asyncio.TimeoutError, ValueError):
            urls = None
        if not isinstance(urls, dict):
            err = b""
            if proc.returncode is None:
                proc.kill()
            else:
                err = await proc.stderr.read()  # type: ignore[union-attr]
            await proc.wait()
            raise DemoFleetError("the simulated demo fleet (python -m loadtest.sim) failed to start"
                                 + (f": {err.decode(errors='replace').strip()[-500:]}" if err else ""))
        return cls(proc, urls)

    async def stop(self) -> None:
        """Close the child's stdin (it exits), then wait; kill after 5 s."""
        if self.proc.returncode is not None:
            return
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 5.0)
        except asyncio.TimeoutError:
            self.proc.kill()
            await self.proc.wait()
