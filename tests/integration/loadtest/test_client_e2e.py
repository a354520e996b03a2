"""The benchmark client end to end: simulated backends and a gateway on loopback ports,
a short run, and the JSON, the report and the plots it writes."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from contextlib import asynccontextmanager

import orjson
import pytest
from aiohttp import web

from loadtest import report
from loadtest.client import ClientOptions
from loadtest.runner import LoadSpec, Target, run_load
from loadtest.sim.server import SimBackendConfig, start_backends
from loadtest.workloads import make_workload
from loadtest.zero import make_app
from tests.support.servers import ScriptedBackend, gateway_config, running_gateway, serving, sse_chunk

PNG = b"\x89PNG\r\n\x1a\n"
SHARED = {"num_groups": 2, "prompts_per_group": 3, "system_prompt_len": 64, "question_len": 8, "output_len": 6}


@asynccontextmanager
async def sim_fleet(n: int = 2):
    backends, urls = await start_backends([SimBackendConfig(name=f"sim-{i}", models=["demo-model"], profile="demo",
                                                            speed=20.0) for i in range(n)])
    try:
        yield urls
    finally:
        for b in backends:
            await b.cleanup()


@asynccontextmanager
async def gateway_over(urls: dict[str, str], policy: str = "least_requests"):
    cfg = gateway_config([{"name": k, "url": v, "models": ["demo-model"]} for k, v in urls.items()],
                         routing={"policy": policy})
    async with running_gateway(cfg) as gw:
        yield gw


async def test_run_against_the_gateway_writes_json_report_and_plots(tmp_path):
    async with sim_fleet() as urls, gateway_over(urls) as gw:
        opts = ClientOptions(model="demo-model", timeout_s=30)
        runs = []
        for conc in (1, 3):
            wl = make_workload("shared-prefix", SHARED, seed=1)
            wl.salt = f"c{conc}"
            runs.append(await run_load([Target("gw", gw.url)], [wl], LoadSpec(concurrency=conc, num_requests=6), opts,
                                       seed=1, sample_interval_s=0.05, show_progress=False))
    doc = report.build_document("run", report.machine_context(["test"]), {"seed": 1}, runs, {"ttft": 10_000},
                                (50.0, 99.0))
    paths = report.write_outputs(doc, tmp_path / "out")
    for name in ("ttft_cdf.png", "e2e_cdf.png", "latency_vs_load.png"):
        assert (tmp_path / "out" / name).read_bytes().startswith(PNG)
    assert [p.name for p in paths.values() if p.name.startswith("backend_load")] == \
        ["backend_load_0_gw.png", "backend_load_1_gw.png"]
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["schema"] == report.SCHEMA and data["context"]["machine"]["cpu_count"] >= 1
    assert data["context"]["libraries"]["aiohttp"]
    lane = data["runs"][1]["lanes"][0]
    assert lane["gateway"]["policy"] == "least_requests" and lane["gateway"]["backends"] == ["sim-0", "sim-1"]
    assert lane["workload"] == {"name": "shared-prefix", "seed": 1, "params": SHARED, "salt": "c3"}
    assert len(lane["records"]) == 6 and all(r["error"] is None for r in lane["records"])
    assert all(r["backend"] in ("sim-0", "sim-1") and r["output_tokens"] == 6 for r in lane["records"])
    assert all(len(r["itl_s"]) == 5 and r["ttft_s"] > 0 for r in lane["records"])
    s = lane["summary"]
    assert s["completed"] == 6 and s["total_output_tokens"] == 36 and s["goodput"] > 0
    assert 0 < s["prefix_cache_hit_ratio"] < 1  # later prompts of a group reuse its system prompt
    assert set(lane["groups"]) == {"g0", "g1"}
    # per-backend load sampled from /metrics: before, during (at least the final sample) and after
    assert len(lane["backend_samples"]) >= 2
    assert set(lane["backend_samples"][-1]["backends"]) == {"sim-0", "sim-1"}
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## concurrency=3" in md and "![ttft_cdf.png](ttft_cdf.png)" in md and "least_requests" in md


async def test_compare_direct_and_gateway_in_alternating_batches(tmp_path):
    async with sim_fleet(1) as urls, gateway_over(urls) as gw:
        targets = [Target("direct", urls["sim-0"]), Target("gateway", gw.url)]
        wls = []
        for j in range(2):
            wl = make_workload("fixed", {"input_len": 32, "output_len": 4}, seed=2)
            wl.salt = f"target{j}"
            wls.append(wl)
        run = await run_load(targets, wls, LoadSpec(rate=float("inf"), concurrency=2, num_requests=5),
                             ClientOptions(model="demo-model", timeout_s=30), interleave="batch", batch_size=2,
                             show_progress=False)
    assert [len(ln.records) for ln in run.lanes] == [5, 5]
    assert run.lanes[0].gateway is None and run.lanes[1].gateway is not None
    assert all(r.backend == "sim-0" for r in run.lanes[1].records)
    # batches alternate: the direct target's batch i ends before the gateway's batch i starts
    d, g = run.lanes[0].records, run.lanes[1].records
    assert max(r.end_s for r in d[:2]) <= min(r.start_s for r in g[:2])
    doc = report.build_document("compare", report.machine_context([]), {}, [run])
    ratios = doc["ratios"][0]
    assert ratios["direct"]["completed"] == 1.0 and ratios["gateway"]["completed"] == 1.0
    assert ratios["gateway"]["mean_ttft_ms"] > 0
    table = report.ratio_table(doc["runs"][0], ratios)
    assert "| mean TTFT (ms) |" in table and "gateway (x first)" in table
    report.write_outputs(doc, tmp_path, plots=False)
    assert json.loads((tmp_path / "results.json").read_text())["kind"] == "compare"


async def _misbehave(backend: ScriptedBackend, request: web.Request, body: dict) -> web.StreamResponse:
    mode = body["messages"][-1]["content"].split()[0]
    if mode == "status":
        return web.json_response({"error": {"message": "busy", "type": "x", "param": None, "code": None}},
                                 status=503)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(sse_chunk(0, "one "))
    if mode == "errorevent":
        await resp.write(b"data: " + orjson.dumps({"error": {"message": "boom"}}) + b"\n\n")
    elif mode == "nodone":
        await resp.write(sse_chunk(1, "two "))
    await resp.write_eof()
    return resp


async def test_error_kinds_are_recorded():
    import time

    import aiohttp

    from loadtest.client import send
    from loadtest.metrics import RequestRecord

    async with ScriptedBackend(handler=_misbehave).running() as be, aiohttp.ClientSession() as http:
        opts = ClientOptions(model="m", timeout_s=10)
        out = {}
        for mode in ("status", "errorevent", "nodone"):
            rec = RequestRecord(0)
            await send(http, be.url, opts, {"model": "m", "stream": True,
                                            "messages": [{"role": "user", "content": mode}]}, rec, time.perf_counter())
            out[mode] = rec
        rec = RequestRecord(0)
        await send(http, "http://127.0.0.1:9", opts, {"model": "m", "messages": []}, rec, time.perf_counter())
    assert out["status"].error == "http_503" and out["status"].status == 503 and "busy" in out["status"].error_detail
    assert out["errorevent"].error == "stream_error" and out["errorevent"].ttft_s is not None
    assert out["nodone"].error == "incomplete" and out["nodone"].chunks == 2
    assert rec.error == "connect"


def zero_backend():
    return serving(make_app(4))


async def test_bounds_in_count_and_time_and_multi_turn_history():
    async with zero_backend() as url:
        opts = ClientOptions(model="zero", timeout_s=10)
        wl = make_workload("multi-turn", {"turns": 3, "system_prompt_len": 4, "user_len": 4, "output_len": 3})
        run = await run_load([Target("z", url)], [wl], LoadSpec(concurrency=2, num_requests=7), opts,
                             show_progress=False)
        recs = run.lanes[0].records
        assert len(recs) == 7 and all(r.ok for r in recs)
        assert sorted((r.session, r.turn) for r in recs) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0)]
        assert all(r.output_tokens == 3 and r.chunks == 3 for r in recs)
        # closed loop bounded only by time: stops sending once the window closes, and ends
        run = await run_load([Target("z", url)], [make_workload("fixed", {"input_len": 4, "output_len": 2})],
                             LoadSpec(concurrency=2, duration_s=0.2), opts, show_progress=False)
        assert run.lanes[0].records and all(r.ok for r in run.lanes[0].records)
        assert all(r.scheduled_s < 0.2 for r in run.lanes[0].records if r.turn == 0)  # decided inside the window


@pytest.mark.slow
async def test_cli_run_and_overhead_as_processes(tmp_path):
    """``python -m loadtest run`` against an in-process gateway, and a tiny ``overhead``
    (it starts the zero-delay backend and ``python -m gateway`` itself)."""
    async with sim_fleet() as urls, gateway_over(urls) as gw:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "loadtest", "run", "--target", gw.url, "--workload", "short-long",
            "-p", "short_input_len=8,long_input_len=64,output_len=4", "--rate", "50", "inf", "-n", "6",
            "--concurrency", "3", "--seed", "5", "--slo", "ttft_ms=5000", "--out", str(tmp_path / "cli"), "--quiet",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    assert "Successful requests:" in out.decode() and "Request goodput" in out.decode()
    data = json.loads((tmp_path / "cli" / "results.json").read_text())
    assert [r["load"]["rate"] for r in data["runs"]] == [50.0, "inf"]
    assert data["settings"]["seed"] == 5 and data["runs"][0]["lanes"][0]["workload"]["params"]["long_input_len"] == 64
    assert (tmp_path / "cli" / "latency_vs_load.png").read_bytes().startswith(PNG)

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "loadtest", "overhead", "--backend", "zero", "--concurrency", "1", "4",
        "--requests", "100", "--reps", "1", "--out", str(tmp_path / "ov"), "--quiet",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 180)
    assert proc.returncode == 0, err.decode()
    text = out.decode()
    assert "| zero | 1 | 100 |" in text and "| zero | 4 | 100 |" in text
    ov = json.loads((tmp_path / "ov" / "results.json").read_text())["overhead"]
    assert [r["concurrency"] for r in ov] == [1, 4]
    assert all(r["gateway_errors"] == 0 and r["gateway_cpu_s_per_1k"] > 0 for r in ov)


@pytest.mark.slow
async def test_cli_run_without_matplotlib_writes_results_and_says_how_to_get_plots(tmp_path):
    """A checkout installed without the ``bench`` extra: ``import matplotlib`` fails (a
    package of that name that raises ImportError comes first on the child's path)."""
    stub = tmp_path / "no_matplotlib" / "matplotlib"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(stub.parent), os.environ.get("PYTHONPATH", "")])}
    async with sim_fleet(1) as urls:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "loadtest", "run", "--target", urls["sim-0"], "--workload", "fixed",
            "--input-len", "8", "--output-len", "3", "--concurrency", "1", "2", "-n", "3", "--seed", "1",
            "--out", str(tmp_path / "out"), "--quiet", env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    assert "Traceback" not in err.decode()
    lines = out.decode().splitlines()
    assert lines.count(report.PLOTS_HINT) == 1 and "pip install -e '.[bench]'" in report.PLOTS_HINT
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [len(r["lanes"][0]["records"]) for r in data["runs"]] == [3, 3]
    assert "## concurrency=2" in (tmp_path / "out" / "report.md").read_text()
    assert not list((tmp_path / "out").glob("*.png"))


@pytest.mark.slow
async def test_the_readmes_run_command_needs_no_rate_or_concurrency(tmp_path):
    """README's ``python -m loadtest run --target URL --out DIR`` runs (closed loop at the
    default concurrency) instead of exiting 2."""
    async with sim_fleet() as urls, gateway_over(urls) as gw:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "loadtest", "run", "--target", gw.url, "--out", str(tmp_path / "out"),
            "-n", "12", "--no-plots", "--quiet", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        _out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["runs"][0]["load"]["concurrency"] == 8
    assert len(data["runs"][0]["lanes"][0]["records"]) == 12


def test_a_load_without_rate_concurrency_or_arrivals_is_refused_in_plain_words():
    wl = make_workload("fixed", {}, 0)
    with pytest.raises(ValueError, match="'fixed' has no arrival times of its own: give --rate or --concurrency"):
        asyncio.run(run_load([Target("t", "http://127.0.0.1:9")], [wl], LoadSpec(num_requests=1), ClientOptions()))


@pytest.mark.parametrize("endpoint", ["responses", "responses_chained", "embeddings"])
async def test_the_client_speaks_the_other_apis(endpoint):
    """Conversations over Responses (whole, or chained by ``previous_response_id``, which
    the gateway expands from its store) and embeddings: every turn answered, its usage
    read, a conversation's later turns longer and hitting the prefix cache."""
    async with sim_fleet() as urls, gateway_over(urls, "cache_aware") as gw:
        wl = make_workload("multi-turn", {"turns": 3, "system_prompt_len": 64, "user_len": 16, "output_len": 4})
        opts = ClientOptions(model="demo-model", endpoint=endpoint, stream=endpoint != "embeddings", timeout_s=30)
        result = await run_load([Target(endpoint, gw.url)], [wl], LoadSpec(concurrency=2, num_requests=6), opts,
                                show_progress=False)
    recs = result.lanes[0].records
    assert len(recs) == 6 and all(r.ok for r in recs), [(r.error, r.error_detail) for r in recs]
    assert all(r.prompt_tokens and r.ttft_s is not None for r in recs)
    assert all(r.response_id is None and r.output_text is None for r in recs)  # not kept past their use
    if endpoint == "embeddings":
        assert all(r.output_tokens == 0 for r in recs)
        return
    assert all(r.output_tokens == 4 and r.chunks == 4 for r in recs)
    for s in {r.session for r in recs}:
        turns = sorted((r for r in recs if r.session == s), key=lambda r: r.turn)
        assert [t.turn for t in turns] == [0, 1, 2]
        assert turns[0].prompt_tokens < turns[1].prompt_tokens < turns[2].prompt_tokens
        assert turns[2].cached_tokens and turns[2].cached_tokens > 0
