"""The Grafana dashboards in ``deploy/grafana/dashboards`` return data (issue 33): a real
Prometheus (Debian's ``prometheus`` package, which ``.ci/run`` installs) scrapes a gateway
on 127.0.0.1 serving a bounded load from simulated engines (one of which fails a share
of its requests, so the retry and error panels have data), then every PromQL expression
of every panel, and every template variable's query, is evaluated through Prometheus's
HTTP API and must return at least one series. A few panels show failures this load does
not cause (:data:`MAY_BE_EMPTY`, each with its reason): their queries must still be
valid PromQL. With tracing on, the TTFT histogram's exemplars reach Prometheus (scraped
in the OpenMetrics format) with the trace ids of the requests' spans."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from loadtest.sim.server import SimBackendConfig, start_backends
from tests.support.otlp import OtlpReceiver, tracing_config
from tests.support.servers import free_port, gateway_config, running_gateway

pytest.importorskip("opentelemetry.sdk.trace", reason="the otel extra (pip install -e '.[test]')")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "deploy/grafana/dashboards").glob("*.json"))
ALERTS = ROOT / "deploy/prometheus/alerts.yml"
# an alert's expression without its threshold: what must have series for the rule to mean anything
THRESHOLD = re.compile(r"\s*(==|!=|>=|<=|>|<)\s*[0-9.]+\s*$")
# alerts whose metric only a condition this test does not create exports, with the reason
ALERTS_MAY_BE_EMPTY = {
    "turbo_gateway_admission_rejected_total": "admission refusals (the fleet is never saturated here)",
    "turbo_gateway_kv_events_gaps_total": "KV events (no backend here publishes them)",
}
JOB = "turbo-gateway"
MODEL = "sim-model"
# Grafana's variables, as the dashboards' defaults ("All") set them
VARIABLES = {"$job": JOB, "$model": ".*", "$backend": ".*", "$__rate_interval": "1m"}
# metric names whose series only a failure this test does not cause makes
MAY_BE_EMPTY = {
    "turbo_gateway_stream_errors_total": "streams cut after their first byte (none here)",
    "turbo_gateway_client_disconnects_total": "clients leaving mid-answer (none here)",
    "turbo_gateway_state_redis_errors_total": "Redis failures (the in-process store has none)",
}
PROMPTS = ["You are a helpful assistant. " * 20 + f"Question {i}: what is {i} + {i}?" for i in range(4)]


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from _panels(p.get("panels", []))


def _expressions() -> list[tuple[str, str, str]]:
    """(dashboard, panel title, expression) of every target of every panel, and the
    template variables' queries (``label_values(selector, label)`` as a count by label)."""
    out = []
    for path in DASHBOARDS:
        d = json.loads(path.read_text())
        for p in _panels(d.get("panels", [])):
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append((path.name, p.get("title", ""), t["expr"]))
        for v in d.get("templating", {}).get("list", []):
            if v.get("type") == "query":
                q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
                m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", q.strip())
                assert m, f"{path.name}: variable {v['name']}: unsupported query {q!r}"
                out.append((path.name, f"variable {v['name']}", f"count by ({m[2]}) ({m[1]})"))
    return out


def _substitute(expr: str) -> str:
    for k in sorted(VARIABLES, key=len, reverse=True):
        expr = expr.replace(k, VARIABLES[k])
    return expr


@asynccontextmanager
async def _prometheus(target: str) -> AsyncIterator[str]:
    """A Prometheus scraping ``target`` (host:port) every second; yields its URL."""
    exe = shutil.which("prometheus")
    if exe is None:
        pytest.skip("no prometheus binary: apt-get install prometheus (.ci/run does)")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tg-prom-") as tmp:
        cfg = Path(tmp) / "prometheus.yml"
        shutil.copy(ALERTS, Path(tmp) / "alerts.yml")
        cfg.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": ["alerts.yml"],
            "scrape_configs": [{"job_name": JOB, "metrics_path": "/metrics", "static_configs": [
                {"targets": [target]}]}]}))
        log = Path(tmp) / "prometheus.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [exe, f"--config.file={cfg}", f"--storage.tsdb.path={tmp}/data",
                 f"--web.listen-address=127.0.0.1:{port}", "--enable-feature=exemplar-storage"],
                stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as s:
                for _ in range(600):  # bounded: 30 s
                    assert proc.poll() is None, log.read_text()[-3000:]
                    try:
                        async with s.get(url + "/-/ready") as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError("prometheus not ready within 30 s: " + log.read_text()[-3000:])
            yield url
        finally:
            proc.terminate()  # by its PID
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def _query(s: aiohttp.ClientSession, url: str, expr: str) -> dict[str, Any]:
    async with s.get(url + "/api/v1/query", params={"query": expr}) as r:
        return await r.json()


async def _load(s: aiohttp.ClientSession, gw: str, batch: int) -> None:
    """One batch: streamed and whole chat completions, sharing prompt prefixes."""
    async def one(i: int) -> None:
        body = {"model": MODEL, "max_tokens": 8, "stream": i % 2 == 0,
                "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]}
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        async with s.post(gw + "/v1/chat/completions", json=body) as r:
            await r.read()

    await asyncio.gather(*(one(batch * 8 + i) for i in range(8)))


async def test_every_dashboard_query_returns_series_from_a_real_prometheus():
    assert DASHBOARDS, "no dashboard in deploy/grafana/dashboards"
    sims = [SimBackendConfig.from_dict({"name": name, "models": [MODEL], "speed": 50.0, "faults": faults})
            for name, faults in (("a", {}), ("b", {"error_rate": 0.3, "error_status": 503, "seed": 7}))]
    engines, urls = await start_backends(sims)
    receiver = OtlpReceiver()
    try:
        async with receiver.running():
            cfg = gateway_config([{"name": n, "url": u, "models": [MODEL]} for n, u in urls.items()],
                                 routing={"policy": "estimated_ttft"}, tracing=tracing_config(receiver))
            async with running_gateway(cfg) as gw, _prometheus(gw.url.removeprefix("http://")) as prom, \
                    aiohttp.ClientSession() as s:
                served = 0.0
                for batch in range(4):  # each batch scraped before the next: rates have points to differ
                    await _load(s, gw.url, batch)
                    sent = (batch + 1) * 8

                    async def scraped() -> bool:
                        nonlocal served
                        got = await _query(s, prom, f'sum(turbo_gateway_requests_total{{job="{JOB}"}})')
                        served = float(got["data"]["result"][0]["value"][1]) if got["data"]["result"] else 0.0
                        return served >= sent

                    for _ in range(300):  # bounded: Prometheus scrapes every second
                        if await scraped():
                            break
                        await asyncio.sleep(0.1)
                    assert served >= sent, f"Prometheus saw {served} of {sent} requests"
                empty, failed, allowed_empty = [], [], []  # the last: MAY_BE_EMPTY's
                for dashboard, title, expr in _expressions():
                    got = await _query(s, prom, _substitute(expr))
                    if got.get("status") != "success":
                        failed.append(f"{dashboard}: {title}: {expr}: {got.get('error')}")
                    elif not got["data"]["result"]:
                        (allowed_empty if any(m in expr for m in MAY_BE_EMPTY) else empty).append(
                            f"{dashboard}: {title}: {expr}")
                alert_empty, alert_failed = [], []
                for rule in _alert_rules():
                    for expr in (rule["expr"], THRESHOLD.sub("", rule["expr"])):
                        got = await _query(s, prom, expr)
                        if got.get("status") != "success":
                            alert_failed.append(f"{rule['alert']}: {expr}: {got.get('error')}")
                    if not got["data"]["result"] and not any(m in expr for m in ALERTS_MAY_BE_EMPTY):
                        alert_empty.append(f"{rule['alert']}: {expr}")
                async with s.get(prom + "/api/v1/rules") as r:
                    loaded = [rule for g in (await r.json())["data"]["groups"] for rule in g["rules"]]
                # the checks can fail: a series no gateway exports, a query that is not PromQL
                absent = await _query(s, prom, f'turbo_gateway_no_such_metric{{job="{JOB}"}}')
                broken = await _query(s, prom, "sum by (le (rate(turbo_gateway_ttft_seconds_bucket[1m]))")
                # the exemplars of the traced requests, scraped in the OpenMetrics format
                async with s.get(prom + "/api/v1/query_exemplars", params={
                        "query": f'turbo_gateway_ttft_seconds_bucket{{job="{JOB}"}}', "start": "0",
                        "end": str(2 ** 31)}) as r:
                    exemplars = (await r.json())["data"]
    finally:
        for e in engines:
            await e.cleanup()
    assert absent["status"] == "success" and absent["data"]["result"] == [] and broken["status"] == "error"
    assert failed == [], "queries Prometheus refused:\n" + "\n".join(failed)
    assert alert_failed == [], "alert expressions Prometheus refused:\n" + "\n".join(alert_failed)
    assert alert_empty == [], "alert expressions with no series:\n" + "\n".join(alert_empty)
    assert sorted(r["name"] for r in loaded) == sorted(r["alert"] for r in _alert_rules())
    assert all(r["health"] in ("ok", "unknown") for r in loaded), loaded
    assert empty == [], "queries that returned no series:\n" + "\n".join(empty)
    trace_ids = {e["labels"]["trace_id"] for series in exemplars for e in series["exemplars"]}
    assert trace_ids and trace_ids <= {sp.trace_id for sp in receiver.spans if sp.parent == ""}


def _alert_rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def test_the_alert_rules_cover_what_an_operator_needs():
    names = {r["alert"] for r in _alert_rules()}
    assert names == {"TurboGatewayBackendDown", "TurboGatewayBreakerOpen", "TurboGatewayErrorRatio",
                     "TurboGatewayTTFTOverSLO", "TurboGatewayAdmissionQueueFull", "TurboGatewayRedisUnreachable",
                     "TurboGatewayKVEventGaps"}
    assert all(THRESHOLD.search(r["expr"]) for r in _alert_rules())  # each fires on a threshold


def test_the_dashboards_have_queries_and_the_test_knows_every_variable():
    exprs = _expressions()
    assert len(exprs) > 10
    for _, title, expr in exprs:
        left = re.findall(r"\$\w+", _substitute(expr))
        assert not left, f"{title}: variables the test does not set: {left}"
