"""``python -m loadtest.request_walk`` records something: one streamed chat completion
through the traced gateway enters the module that serves the connection (the first file
entered, under ``gateway/``) and at least one routing module. No counts are checked: they
change with the code's structure."""

from __future__ import annotations

import pytest

from loadtest import request_walk

pytestmark = pytest.mark.slow


def test_walk_records_the_request():
    res = request_walk.walk(warmup=2, timeout_s=60.0, settle_ms=100.0)
    files = [f["file"] for f in res["files"]]
    assert res["response_bytes"] > 0
    assert files and files[0].startswith("gateway/"), files  # the server: it accepts the connection
    assert any(f.startswith("routing/") for f in files), files
    assert all(f["entries"] >= 1 and f["functions"] for f in res["files"])
    assert len(res["sequence"]) == sum(f["entries"] for f in res["files"])
    report = request_walk.report(res)
    assert f"{len(files)} distinct files of gateway/ and routing/ entered" in report
