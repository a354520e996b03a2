"""The two commands of README.md, end to end: `python -m gateway --config backends.yaml`
starts the demo fleet and the openai SDK streams through it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.servers import free_port

ROOT = Path(__file__).resolve().parent.parent


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
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
