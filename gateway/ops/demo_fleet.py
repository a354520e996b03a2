"""The demo fleet: simulated backends (``simulate:`` in ``backends.yaml``) that the
gateway starts itself, as a ``python -m loadtest.sim`` child process.

The gateway imports nothing from ``loadtest`` (DESIGN.md section 2): it tells the child
each backend's name, models and ``simulate:`` section (``--gateway-backends``), the
child validates them by the simulator's own rules, and the gateway talks to it over its
standard streams and to the backends over HTTP. An invalid section is reported as
:class:`InvalidSimulateSection`, a config error naming that backend. The child exits when
the gateway closes its standard input, so a killed gateway leaves no orphans behind.

A simulated backend that publishes KV-cache events binds free ports for them; once it
listens, :func:`simulated_kv_sources` reads where from its ``GET /kv_event_sources``
(vLLM's endpoint), and the gateway subscribes as to any engine's
(:meth:`gateway.config.GatewayConfig.with_kv_events`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from typing import overload
from urllib.parse import urlsplit

import aiohttp

from gateway.config import Backend, KVEvents

START_TIMEOUT_S = 30.0

log = logging.getLogger("gateway.ops.demo_fleet")


class DemoFleetError(Exception):
    """The simulated fleet did not start; the message says why."""


class InvalidSimulateSection(DemoFleetError):
    """The ``simulate:`` section of backend ``backend`` breaks the simulator's rules;
    ``message`` says how (the simulator's own words)."""

    def __init__(self, backend: str, message: str) -> None:
        super().__init__(f"backend {backend!r}: invalid `simulate` section: {message}")
        self.backend, self.message = backend, message


def _command(backends: list[Backend]) -> list[str]:
    """The child's command line for the simulated ``backends``."""
    entries = [b.simulate_entry() for b in backends if b.simulate]
    return [sys.executable, "-m", "loadtest.sim", "--gateway-backends", json.dumps(entries), "--exit-on-stdin-eof"]


def _urls(line: bytes | None) -> dict[str, str] | None:
    """The child's first line of output: the backends' URLs by name, or ``None`` when
    it said nothing readable. Raises :class:`InvalidSimulateSection` when it refused a
    section."""
    try:
        answer = json.loads(line) if line else None
    except ValueError:
        return None
    if isinstance(answer, dict) and isinstance(answer.get("invalid"), dict):
        bad = answer["invalid"]
        raise InvalidSimulateSection(str(bad.get("backend")), str(bad.get("message")))
    return answer if isinstance(answer, dict) else None


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
    proc = subprocess.Popen(_command(backends), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None  # stdout=PIPE
    try:
        urls = _urls(proc.stdout.readline())
    except InvalidSimulateSection:
        proc.wait()
        raise
    if urls is None:
        proc.kill()
        proc.wait()
        # the child's standard error is this process's: its message is already printed
        raise DemoFleetError("the simulated demo fleet (python -m loadtest.sim) failed to start "
                             "(its message is above)")
    return proc, urls


_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]")


@overload
def _reachable(endpoint: str, host: str) -> str: ...
@overload
def _reachable(endpoint: None, host: str) -> None: ...
def _reachable(endpoint: str | None, host: str) -> str | None:
    """A bound ZMQ address as a client reaches it: a wildcard host becomes ``host``."""
    if endpoint is None or not endpoint.startswith("tcp://"):
        return endpoint
    bound, _, port = endpoint[len("tcp://"):].rpartition(":")
    return f"tcp://{host}:{port}" if bound in _WILDCARD_HOSTS else endpoint


async def simulated_kv_sources(backends: list[Backend], urls: dict[str, str],
                               timeout_s: float = START_TIMEOUT_S) -> dict[str, KVEvents]:
    """The ``kv_events`` of every listening simulated backend whose events the gateway
    wires itself (:attr:`Backend.simulated_kv_events`; ``urls``: base URLs by name),
    from its ``GET {url}/kv_event_sources`` (vLLM's answer: ``{rank: {endpoint,
    replay_endpoint, topic, ...}}``, one rank per simulated backend, with the simulator's
    ``block_size`` and ``base_model``). Raises :class:`DemoFleetError` when one cannot be read."""
    wanted = [b for b in backends if b.simulated_kv_events and b.name in urls]
    out: dict[str, KVEvents] = {}
    if not wanted:
        return out
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        for b in wanted:
            url = urls[b.name]
            try:
                async with session.get(url + "/kv_event_sources") as r:
                    r.raise_for_status()
                    (src,) = (await r.json()).values()
                host = urlsplit(url).hostname or "127.0.0.1"
                out[b.name] = b.simulated_kv_source(_reachable(src["endpoint"], host),
                                                    _reachable(src.get("replay_endpoint"), host), src.get("topic", ""),
                                                    int(src["block_size"]), str(src["base_model"]))
            except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise DemoFleetError(f"simulated backend {b.name!r}: cannot read where it publishes its KV events "
                                     f"({url}/kv_event_sources): {e or type(e).__name__}") from None
    return out


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
    async def start(cls, backends: list[Backend]) -> DemoFleet:
        """Start every backend with a ``simulate`` section on a free loopback port.
        Returns the fleet with ``urls`` = ``{name: base_url}``. Raises
        :class:`DemoFleetError`."""
        proc = await asyncio.create_subprocess_exec(
            *_command(backends), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        assert proc.stdout is not None and proc.stderr is not None  # both PIPE
        try:
            urls = _urls(await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S))
        except TimeoutError:
            urls = None
        except InvalidSimulateSection:
            await proc.wait()
            raise
        if urls is None:
            # the child may have exited without being reaped yet: returncode says nothing
            if proc.returncode is None:
                proc.kill()
            err = await proc.stderr.read()
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
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        await self._stderr_task  # ends at the pipe's end of file, once the child is gone
