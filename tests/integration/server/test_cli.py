"""The two commands of README.md, end to end: `python -m gateway --config backends.yaml`
starts the demo fleet and the openai SDK streams through it; a bad config or a port in
use exits 2 with a message, not a traceback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.support.servers import free_port

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_shipped_config_serves_openai_sdk_stream():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "--config", "backends.yaml", "--port", str(port)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:  # wait for readiness (a condition, not a timing check)
            assert proc.poll() is None, proc.stderr.read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            assert time.monotonic() < deadline, "gateway did not become ready"
            time.sleep(0.1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        stream = client.chat.completions.create(model="demo-model", max_tokens=8, stream=True,
                                                messages=[{"role": "user", "content": "Hello!"}],
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert len(text.split()) == 8
        assert chunks[-1].usage.completion_tokens == 8
        # the demo backends are a child process that goes away with the gateway
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "Traceback" not in err


def _gateway(config: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway", "--config", str(config), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize("simulate, says", [
    ("{profile: demo, sped: 2.0}", "backend 'sim-a': unknown field(s) ['sped']; known: ['eos_after', 'faults'"),
    ("{profile: tpu}", "backend 'sim-a': unknown profile 'tpu'; known: ['a100-llama3-8b'"),
    ("{faults: {error_rate: 2}}", "faults.error_rate must be a number in [0, 1], got 2"),
    ("{faults: 3}", "backend 'sim-a': `faults` must be a mapping of fault fields"),
    ("{models: [other]}", "['models'] belong to the backend itself, not to its `simulate:` section"),
])
def test_a_bad_simulate_section_is_a_config_error_with_the_simulators_message(tmp_path, simulate, says):
    conf = tmp_path / "backends.yaml"
    conf.write_text(f"backends:\n  - name: sim-a\n    models: [demo-model]\n    simulate: {simulate}\n")
    for args in ((), ("--workers", "2")):
        r = _gateway(conf, *args)
        assert r.returncode == 2, r.stderr
        assert r.stderr.count("\n") == 1 and r.stderr.startswith(
            f"error: {conf}: invalid config at `backends.0.simulate`: "), r.stderr
        assert says in r.stderr


@pytest.mark.slow
def test_a_demo_fleet_that_cannot_start_shows_the_simulators_own_message(tmp_path):
    """A valid ``simulate:`` section whose fixed port is taken: the simulator starts and
    fails; its message reaches the user, whichever way the gateway runs it."""
    conf = tmp_path / "backends.yaml"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        conf.write_text(f"backends:\n  - name: sim-a\n    models: [demo-model]\n    simulate: {{port: {port}}}\n")
        for _ in range(3):  # the child may exit before or after the gateway reads its output
            r = _gateway(conf, "--port", "0")
            assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
            assert ("error: the simulated demo fleet (python -m loadtest.sim) failed to start: "
                    "python -m loadtest.sim: cannot listen: ") in r.stderr
            assert f"('127.0.0.1', {port}): address already in use" in r.stderr
        r = _gateway(conf, "--port", "0", "--workers", "2")  # started before the workers, child's stderr inherited
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert "python -m loadtest.sim: cannot listen: " in r.stderr
        assert "failed to start (its message is above)" in r.stderr


def _run_gateway(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.slow
def test_cli_bad_config_exits_2_without_traceback(tmp_path):
    bad = tmp_path / "backends.yaml"
    bad.write_text("backends:\n  - name: a\n    url: http://127.0.0.1:1\n    models: [m]\n    weight: -3\n")
    r = _run_gateway("--config", str(bad))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert f"{bad}: invalid config at `backends.0.weight`" in r.stderr


@pytest.mark.slow
def test_cli_port_in_use_says_so(tmp_path):
    conf = tmp_path / "backends.yaml"
    conf.write_text("backends:\n  - name: a\n    url: http://127.0.0.1:1\n    models: [m]\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _run_gateway("--config", str(conf), "--port", str(port))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert f"cannot listen on 127.0.0.1:{port}: the address is already in use" in r.stderr


@pytest.mark.parametrize("command", [["turbo-gateway"], ["python", "-m", "gateway"]])
def test_help_names_the_command_the_user_typed(command):
    if command[0] == "turbo-gateway":
        exe = Path(sys.executable).parent / "turbo-gateway"
        if not exe.exists():
            pytest.skip("the turbo-gateway command is not installed in this environment (pip install -e .)")
        argv = [str(exe)]
    else:
        argv = [sys.executable, "-m", "gateway"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(argv + ["--help"], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: {' '.join(command)} "), out.stdout.splitlines()[0]


def test_envoy_config_piped_into_a_reader_that_stops_early_ends_quietly(tmp_path):
    """``python -m gateway.envoy_config ... | head``: the reader gone before the
    bootstrap is written is no error and prints no traceback."""
    path = tmp_path / "backends.yaml"
    path.write_text("backends:\n- {name: a, url: 'http://127.0.0.1:18001', models: [m]}\n")
    r, w = os.pipe()
    os.close(r)  # the reader left before a byte was written: every write meets a broken pipe
    try:
        out = subprocess.run([sys.executable, "-m", "gateway.envoy_config", "--config", str(path)], stdout=w,
                             stderr=subprocess.PIPE, text=True, timeout=60, cwd=ROOT, check=False)
    finally:
        os.close(w)
    assert "Traceback" not in out.stderr and "BrokenPipeError" not in out.stderr, out.stderr
    assert out.returncode == 0


SITECUSTOMIZE = '''
import atexit, sys


class _Teardown:
    def __del__(self):
        sys.stderr.write("TEST: interpreter teardown\\n")


_witness = _Teardown()  # collected only by the interpreter's teardown of every module
atexit.register(lambda: sys.stderr.write("TEST: exit handlers ran\\n"))
'''


def test_the_process_ends_once_it_logged_shut_down(tmp_path):
    """After its drain the gateway exits at once: the exit handlers run (log flush,
    coverage), the interpreter's teardown of every imported module, which kept it alive
    for a second or so after its last log line, does not."""
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    config = tmp_path / "backends.yaml"
    config.write_text("backends:\n- {name: a, url: 'http://127.0.0.1:9', models: [m]}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "--config", str(config), "--port", str(free_port())],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "listening on" in line:
                break
        proc.send_signal(signal.SIGINT)
        err = proc.stderr.read()
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert '"shut down"' in err and "TEST: exit handlers ran" in err
    assert "TEST: interpreter teardown" not in err
