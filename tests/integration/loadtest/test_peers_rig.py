"""The native rig of ``python -m loadtest.peers`` (:mod:`loadtest.native_rig`): its nginx +
echo backends answer well-formed chat completions, and its lean TTFT client parses a whole
stream. Behaviour checks only; no timing bound beyond the backend's own sleep."""

from __future__ import annotations

import json
import shutil
import urllib.request

import pytest

from loadtest import native_rig, procs

OK, WHY = native_rig.availability()
pytestmark = pytest.mark.skipif(not OK, reason=f"native peers rig unavailable: {WHY}")


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
    be = native_rig.start_backends(tmp_path_factory.mktemp("native-rig"), ttft_s=0.05, itl_s=0.01, slow_tokens=8)
    try:
        yield be
    finally:
        procs.stop(be.proc)


def _post(url: str, stream: bool, tokens: int) -> tuple[int, str, bytes]:
    body = json.dumps({"model": "zero", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens,
                       "stream": stream}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status, r.headers.get("Content-Type", ""), r.read()


def test_models_and_health(backends):
    for urls in backends.urls.values():
        for u in urls:
            with urllib.request.urlopen(u + "/v1/models", timeout=5) as r:
                assert [m["id"] for m in json.loads(r.read())["data"]] == ["zero"]
            with urllib.request.urlopen(u + "/health", timeout=5) as r:
                assert r.status == 200


def test_non_streamed_completion(backends):
    status, ctype, raw = _post(backends.urls["whole"][0], False, 16)
    assert status == 200 and ctype.startswith("application/json")
    obj = json.loads(raw)
    assert obj["object"] == "chat.completion"
    assert obj["choices"][0]["message"]["content"] == " tok" * 16
    assert obj["usage"] == {"prompt_tokens": 51, "completion_tokens": 16, "total_tokens": 67}
    assert native_rig.check_chat(backends.urls["whole"][1], False, 16) == ""


def test_streamed_completion(backends):
    status, ctype, raw = _post(backends.urls["stream"][1], True, 64)
    assert status == 200 and ctype.startswith("text/event-stream")
    events = [e for e in raw.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    objs = [json.loads(e[6:]) for e in events[:-1]]
    deltas = [c["delta"] for o in objs for c in o["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert sum(1 for d in deltas if d.get("content") == " tok") == 64
    assert objs[-1]["usage"]["completion_tokens"] == 64 and objs[-1]["choices"] == []
    assert len(events) == 1 + 64 + 1 + 1 + 1  # role, tokens, finish, usage, [DONE]
    assert native_rig.check_chat(backends.urls["stream"][0], True, 64) == ""


def test_lean_client_parses_slow_stream(backends):
    b = native_rig.run_streams(backends.urls["slow"][:1], 1, 2, 8, timeout_s=10)
    assert (b.streams, b.errors) == (2, 0), b.first_error
    assert b.tokens == 2 * 8
    assert b.events == 2 * (1 + 8 + 1 + 1 + 1)
    assert min(b.ttft_ms) >= 50.0  # the backend's echo_sleep before the first event


def test_lean_client_counts_a_malformed_stream(backends):
    # the zero-delay stream has 64 tokens, not the 8 the client is told to expect
    b = native_rig.run_streams(backends.urls["stream"][:1], 1, 1, 8, timeout_s=10)
    assert (b.streams, b.errors) == (0, 1) and "64 content tokens" in b.first_error


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk not installed")
def test_wrk_counts_requests(backends, tmp_path):
    script = native_rig.wrk_script(tmp_path / "w.lua", False, 16)
    w = native_rig.run_wrk(backends.urls["whole"][0], script, 1, 1, 4)
    assert w.requests > 0 and w.errors == 0, w.error_text()
    bad = native_rig.run_wrk(backends.urls["whole"][0] + "/nope", script, 1, 1, 2)  # 404 route
    assert bad.requests > 0 and bad.status == bad.requests
    assert bad.error_text().startswith("non-2xx ")
