"""The demo fleet: simulated backends (``simulate:`` in ``backends.yaml``) that the
gateway starts itself, as a ``python -m loadtest.sim`` child process.

The gateway does not import ``loadtest`` to run them (DESIGN.md section 2; only the
config loader checks ``simulate:`` sections with :mod:`loadtest.sim.spec`): it talks to
the child over its standard streams and to the backends over HTTP. The child exits when the
gateway closes its standard input, so a killed gateway leaves no orphans behind.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys

from gateway.config import Backend

START_TIMEOUT_S = 30.0

log = logging.getLogger("gateway.demo")


class DemoFleetError(Exception):
    """The simulated fleet did not start; the message says why."""


def _failed(stderr: bytes | None) -> DemoFleetError:
    """The error of a child that did not start, with the end of what it said on its
    standard error (its own message, or the last lines of a traceback)."""
    lines = (stderr or b"").decode(errors="replace").strip().splitlines()
    why = "\n".join(lines[-5:])
    return DemoFleetError("the simulated demo fleet (python -m loadtest.sim) failed to start"
                          + (f": {why}" if why else " and said nothing on its standard error"))


def start_demo_fleet_sync(backends: list[Backend]) -> tuple[subprocess.Popen, dict[str, str]]:
    """Blocking variant of :meth:`DemoFleet.start` for a parent process without an
    event loop (``--workers``). Close the child's stdin to stop it. Raises
    :class:`DemoFleetError`."""
    spec = [{"name": b.name, "models": b.static_models, **b.simulate} for b in backends if b.simulate]
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
        # the child's standard error is this process's: its message is already printed
        raise DemoFleetError("the simulated demo fleet (python -m loadtest.sim) failed to start "
                             "(its message is above)")
    return proc, urls


class DemoFleet:
    """A running child process serving the simulated backends."""

    def __init__(self, proc: asyncio.subprocess.Process, urls: dict[str, str]) -> None:
        self.proc = proc
        self.urls = urls
        # Read the child's standard error for its whole life: an undrained pipe that
        # fills up would block the simulator at its next write.
        self._stderr_task = asyncio.get_running_loop().create_task(self._drain_stderr())

    async def _drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        async for line in self.proc.stderr:
            log.debug("demo fleet: %s", line.decode(errors="replace").rstrip())

    @classmethod
    async def start(cls, backends: list[Backend]) -> "DemoFleet":
        """Start every backend with a ``simulate`` section on a free loopback port.
        Returns the fleet with ``urls`` = ``{name: base_url}``. Raises
        :class:`DemoFleetError`."""
        spec = [{"name": b.name, "models": b.static_models, **b.simulate} for b in backends if b.simulate]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "loadtest.sim", "--spec", json.dumps(spec), "--exit-on-stdin-eof",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)  # type: ignore[union-attr]
            urls = json.loads(line) if line else None
        except (asyncio.TimeoutError, ValueError):
            urls = None
        if not isinstance(urls, dict):
            # the child may have exited without being reaped yet: returncode says nothing
            if proc.returncode is None:
                proc.kill()
            err = await proc.stderr.read()  # type: ignore[union-attr]
            await proc.wait()
            raise _failed(err)
        return cls(proc, urls)

    async def stop(self) -> None:
        """Close the child's stdin (it exits), then wait; kill after 5 s."""
        if self.proc.returncode is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 5.0)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        await self._stderr_task  # ends at the pipe's end of file, once the child is gone
