"""The agentic benchmark end to end, tiny: eight agent sessions on two small simulated
engines (so their contexts cannot all stay cached), every row of the report, the
Mooncake rows on the trace sample, in virtual time."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from loadtest import agentic_bench, traces
from loadtest.agentic import AgentParams
from loadtest.agentic_bench import ROWS, Row, run

if not (traces.TRACES_DIR / "mooncake").is_dir():  # a checkout without ../shared: the sample in tests/support
    traces.TRACES_DIR = Path(__file__).resolve().parents[2] / "support" / "data" / "traces"

FLEET = ("a10g-llama3-8b", "a10g-llama3-8b")  # 42k tokens of KV each: a few sessions fill them
SMALL = ["--sessions", "8", "--rate", "1", "--fleet", ",".join(FLEET), "--max-in-flight", "1"]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("agentic") / "rows.json"
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert agentic_bench.main([*SMALL, "--mooncake-requests", "80", "--jobs", "1", "--json", str(out)]) == 0
    return json.loads(out.read_text()), text.getvalue()


def test_the_report_has_every_row_and_every_turn_was_answered(report):
    data, text = report
    rows = data["rows"]
    for r in ROWS:
        s = rows[r.label]
        assert s["completed"] == s["turns"] > 8  # sessions of many turns, every one answered
        assert s["sessions_completed"] == 8 and s["unfinished_sessions"] == 0
        assert 0 < s["ttft_p50_s"] <= s["ttft_p99_s"] and s["session_p50_s"] <= s["session_p99_s"]
        assert 0 < s["hit_ratio"] <= data["pooled"]["ceiling"] + 0.02  # never far past an infinite cache
        assert f"| {r.label} |" in text
    for label in ("mooncake: estimated_ttft", "mooncake: estimated_ttft + sessions"):
        assert rows[label]["completed"] == 80 and f"| {label} |" in text
    assert "pooled-cache ideal" in text and data["command"].startswith("python -m loadtest.agentic_bench")


def test_only_session_rows_place_sessions_and_overload_rows_queue(report):
    rows = report[0]["rows"]
    for r in ROWS:
        placed = rows[r.label]["placements"]
        if r.sessions:
            assert placed["home"] > placed["new"] > 0  # most turns went back to their session's home
        else:
            assert sum(placed.values()) == 0
        assert (rows[r.label]["queued"] > 0) == r.overload  # one request per engine: the rest wait


def test_waiting_sessions_lose_kv_on_small_engines_and_round_robin_loses_more(report):
    rows = report[0]["rows"]
    rr, ettft = rows["round_robin"], rows["estimated_ttft + sessions"]
    assert rr["evicted_waiting_tokens"] > 0  # blocks of sessions in a tool call were evicted
    assert rr["hit_ratio"] < ettft["hit_ratio"]


def test_a_run_is_deterministic():
    params = AgentParams(sessions=3, rate=1.0)
    row = Row("t", "estimated_ttft", True)
    a, info_a = run(row, params, seed=5, fleet_names=FLEET)
    b, info_b = run(row, params, seed=5, fleet_names=FLEET)
    assert [(r.session, r.turn, r.backend, r.first_token, r.cached_tokens) for r in a] == \
        [(r.session, r.turn, r.backend, r.first_token, r.cached_tokens) for r in b]
    assert info_a["evicted_waiting_blocks"] == info_b["evicted_waiting_blocks"]
    # a sub-agent's turns and its parent's are all there, in their sessions' order
    by_session: dict[str, list[int]] = {}
    for r in a:
        by_session.setdefault(r.session, []).append(r.turn)
    assert all(turns == list(range(len(turns))) for turns in by_session.values())
