"""Child processes of the benchmarks: simulated backends, gateways, nginx; their CPU time.

Every child listens on 127.0.0.1 only, is waited for with a time bound, and is
stopped by its own PID (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def free_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (``/proc/PID/stat`` fields 14 and
    15, in clock ticks) plus those of its live children; raises OSError when it is gone."""
    total = _stat_cpu(pid)
    for child in _children(pid):
        try:
            total += _stat_cpu(child)
        except OSError:
            pass
    return total


def _stat_cpu(pid: int) -> float:
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2:].split()  # after "pid (comm) ": state is fields[0] (field 3)
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                out += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    except OSError:
        pass
    return out


def stop(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM ``proc`` (by its PID), SIGKILL after ``grace_s``; waits for it."""
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=grace_s)
    except ProcessLookupError:
        pass


def wait_http(url: str, timeout_s: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    """Poll ``GET url`` until it answers 200; raises RuntimeError on timeout or when
    ``proc`` exits first."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.pid} exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError) as e:
            last = e
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer within {timeout_s} s ({last})")


def start_sim(spec: list[dict[str, Any]], timeout_s: float = 30.0) -> tuple[subprocess.Popen, dict[str, str]]:
    """``python -m loadtest.sim --spec ...`` in a child process; returns it and
    ``{name: url}`` (its first stdout line)."""
    proc = subprocess.Popen([sys.executable, "-m", "loadtest.sim", "--spec", json.dumps(spec), "--exit-on-stdin-eof"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = _readline(proc, timeout_s)
        urls = json.loads(line)
        for u in urls.values():
            wait_http(u + "/health", timeout_s, proc)
        return proc, urls
    except BaseException:
        stop(proc)
        raise


def start_zero(output_tokens: int = 16, timeout_s: float = 30.0) -> tuple[subprocess.Popen, str]:
    """The zero-delay backend (:mod:`loadtest.zero`) in a child process; returns it and its URL."""
    proc = subprocess.Popen([sys.executable, "-m", "loadtest.zero", "--tokens", str(output_tokens),
                             "--exit-on-stdin-eof"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = json.loads(_readline(proc, timeout_s))["zero"]
        wait_http(url + "/health", timeout_s, proc)
        return proc, url
    except BaseException:
        stop(proc)
        raise


def _readline(proc: subprocess.Popen, timeout_s: float) -> str:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        if not sel.select(timeout_s):
            raise RuntimeError(f"process {proc.pid} printed nothing within {timeout_s} s")
        line = proc.stdout.readline()
    finally:
        sel.close()
    if not line:
        raise RuntimeError(f"process {proc.pid} exited before printing its URLs")
    return line


def start_gateway(config: dict[str, Any] | str | Path, timeout_s: float = 30.0,
                  workdir: str | None = None) -> tuple[subprocess.Popen, str, Path]:
    """``python -m gateway --config X --port P`` on a free loopback port; ``config``
    is a path or a config mapping (written to a temporary YAML). Returns the process,
    its URL and the config path."""
    if isinstance(config, dict):
        fd, name = tempfile.mkstemp(prefix="loadtest-gw-", suffix=".yaml", dir=workdir)
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(config, f, sort_keys=False)
        path = Path(name)
    else:
        path = Path(config)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "--config", str(path), "--host", "127.0.0.1",
                             "--port", str(port), "--log-level", "warning"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", timeout_s, proc)
    except BaseException:
        stop(proc)
        raise
    return proc, url, path


NGINX_CONF = """worker_processes 1;
error_log {dir}/error.log warn;
pid {dir}/nginx.pid;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {dir}/body;
  proxy_temp_path {dir}/proxy;
  fastcgi_temp_path {dir}/fastcgi;
  uwsgi_temp_path {dir}/uwsgi;
  scgi_temp_path {dir}/scgi;
  upstream backend {{ server {upstream}; keepalive 512; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://backend;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
      proxy_read_timeout 600s;
    }}
  }}
}}
"""


def start_nginx(upstream_url: str, workdir: str, timeout_s: float = 15.0) -> tuple[subprocess.Popen, str] | None:
    """A plain nginx reverse proxy (``proxy_buffering off``) in front of
    ``upstream_url``, or ``None`` when ``nginx`` is not on PATH."""
    exe = shutil.which("nginx")
    if not exe:
        return None
    port = free_port()
    host = upstream_url.split("://", 1)[1].rstrip("/")
    conf = Path(workdir) / "nginx.conf"
    conf.write_text(NGINX_CONF.format(dir=workdir, upstream=host, port=port))
    proc = subprocess.Popen([exe, "-c", str(conf), "-p", workdir, "-g", "daemon off;"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", timeout_s, proc)
    except BaseException:
        stop(proc)
        raise
    return proc, url
