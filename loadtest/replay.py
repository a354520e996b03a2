"""Offline replay: real traces through ``routing/`` policies onto simulated engines, in
virtual time.

The gateway's routing code (estimator, prefix index, load model, policies) runs
unchanged; the backends are :class:`loadtest.sim.engine.Engine` instances, the same
engine model the simulated HTTP backends run, stepped in virtual time so that a
whole trace over many backends takes minutes on this machine. The router sees only
what the gateway sees: dispatch, first token, completion and ``usage``.

Traces (``../shared/traces``): Mooncake ``hash_ids`` (512-token blocks) become token
ids and text such that equal ids give equal blocks, so the trace's prefix sharing is
preserved exactly; Azure traces have no prefix information, so every request's blocks
are unique.

    python -m loadtest.replay --trace mooncake_conversation --requests 1500 --time-scale 0.5
    python -m loadtest.replay --all          # the routing-quality benchmark of loadtest/README.md
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import os
import random
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.sim.engine import Engine
from loadtest.sim.profiles import PROFILES, Profile
from loadtest.traces import (BYTES_PER_TOKEN, MAX_INPUT_TOKENS, TRACE_BLOCK_TOKENS, TRACES, TRACES_DIR, TraceRequest,  # noqa: F401
                             load_trace, request_tokens_and_text, scale_time)
from routing import BackendSpec, Fleet, RouteRequest, Router, make_policy
from routing.estimate import TokenEstimator
from routing.load import RemoteLoad

BENCH_POLICIES = ("round_robin", "least_requests", "power_of_two", "prefix_hash", "cache_aware",
                  "cache_aware_min_load", "estimated_ttft")
# Llama-3.1-8B serves 128k context; the stock profiles say 8k (Llama-3-8B). The replay
# raises max_model_len and caps prompts at MAX_INPUT_TOKENS (a prefix of the trace's
# hash_ids, so prefix sharing is kept) so that every prompt fits every backend's KV cache.
MAX_MODEL_LEN = 131072


@dataclass(slots=True)
class Record:
    """One request's outcome (seconds, tokens)."""

    arrival: float
    backend: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    predicted_cached: float = 0.0
    first_token: float | None = None
    end: float | None = None
    generated: int = 0
    error: str | None = None


@dataclass
class FleetMember:
    name: str
    profile: Profile


DEFAULT_FLEET = ("h100-llama3-8b", "h100-llama3-8b", "a100-llama3-8b", "a100-llama3-8b")


def make_fleet(profile_names: tuple[str, ...] = DEFAULT_FLEET) -> list[FleetMember]:
    return [FleetMember(f"b{i}-{p.split('-')[0]}", dataclasses.replace(PROFILES[p], max_model_len=MAX_MODEL_LEN))
            for i, p in enumerate(profile_names)]


def replay(reqs: list[TraceRequest], policy: str, fleet: list[FleetMember], *, seed: int = 0,
           block_tokens: int = 64, know_kv_capacity: bool = True, replicas: int = 1,
           shared: bool = True, staleness_s: float = 0.05) -> list[Record]:
    """Run ``reqs`` through ``policy`` on ``fleet`` in virtual time; return one
    :class:`Record` per request. Speeds are not hinted: the router learns them.

    With ``replicas`` > 1, request ``i`` goes to gateway replica ``i % replicas`` (an
    L4 balancer's round robin), each with its own router; with ``shared`` every
    replica sees the others' load and dispatched prefix blocks ``staleness_s`` late
    (what :class:`routing.state.RedisStore` gives at its default bound), otherwise
    never.
    """
    random.seed(seed)

    def make_router() -> tuple[Router, TokenEstimator]:
        specs = [BackendSpec(m.name, frozenset({"m"}),
                             kv_capacity_tokens=m.profile.kv_capacity_tokens if know_kv_capacity else None)
                 for m in fleet]
        return Router(Fleet(specs), make_policy(policy), block_tokens=block_tokens), TokenEstimator(block_tokens=block_tokens)

    gateways = [make_router() for _ in range(replicas)]
    engines = {m.name: Engine(m.profile, engine_id=m.name) for m in fleet}
    busy = {m.name: False for m in fleet}
    records: list[Record] = [Record(r.arrival_s) for r in reqs]
    reservations: dict[str, tuple[object, TokenEstimator]] = {}
    events: list[tuple[float, int, str, object]] = []
    blocks_in_flight: list[tuple[float, int, int, str, tuple[int, ...]]] = []  # (visible at, seq, from, backend, hashes)
    seq = 0

    def push(t: float, kind: str, payload: object) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, payload))

    def start_step(name: str, t: float) -> None:
        eng = engines[name]
        if not eng.has_work():
            busy[name] = False
            return
        dt, outs = eng.step(t)
        if dt <= 0 and not outs:
            busy[name] = False
            return
        busy[name] = True
        push(t + dt, "step", (name, outs))

    def sync(t: float) -> None:
        for k, (router, _) in enumerate(gateways):
            for name, b in router.fleet.backends.items():
                remote = RemoteLoad()
                in_flight = 0
                for j, (other, _) in enumerate(gateways):
                    if j == k:
                        continue
                    ob = other.fleet.backends[name]
                    ld = ob.load
                    remote.queued += ld.queued
                    remote.queued_prefill_tokens += ld.queued_prefill_tokens
                    remote.running += ld.running
                    remote.decode_tokens_remaining += ld.decode_tokens_remaining
                    remote.kv_tokens += ld.kv_tokens
                    remote.speeds.append(ld.local_speed())
                    in_flight += ob.in_flight
                b.load.remote = remote
                b.remote_in_flight = in_flight
        while blocks_in_flight and blocks_in_flight[0][0] <= t:
            _, _, k, name, hashes = heapq.heappop(blocks_in_flight)
            for j, (other, _) in enumerate(gateways):
                if j != k:
                    other.index.record(name, hashes, t)

    for i, r in enumerate(reqs):
        push(r.arrival_s, "arrival", i)
    share = shared and replicas > 1
    if share:
        push(0.0, "sync", None)
    pending = len(reqs)

    while events:
        t, _, kind, payload = heapq.heappop(events)
        if kind == "sync":
            sync(t)
            if pending:
                push(t + staleness_s, "sync", None)
        elif kind == "arrival":
            i = payload  # type: ignore[assignment]
            r = reqs[i]
            rec = records[i]
            k = i % replicas
            router, estimator = gateways[k]
            tokens, text = request_tokens_and_text(r, i)
            est = estimator.estimate("m", text, r.output_tokens)
            tpb = estimator.block_bytes / estimator.stats("m").bytes_per_token
            decision, res = router.route(RouteRequest("m", prompt_text=text, prompt_bytes=est.size_bytes,
                                                      block_hashes=est.hashes, prompt_tokens=est.prompt_tokens,
                                                      output_tokens=est.output_tokens, tokens_per_block=tpb), t)
            name = decision.backend.name
            if share:
                seq += 1
                heapq.heappush(blocks_in_flight, (t + staleness_s, seq, k, name, est.hashes))
            rec.backend, rec.prompt_tokens, rec.output_tokens = name, len(tokens), r.output_tokens
            rec.predicted_cached = decision.detail.get("matched_tokens", 0.0)
            rid = f"r{i}"
            try:
                engines[name].add_request(rid, tokens, r.output_tokens, arrival_time=t, output_tokens=r.output_tokens)
            except ValueError as e:
                rec.error = str(e)
                res.release(t)
                pending -= 1
                continue
            reservations[rid] = (res, estimator)
            if not busy[name]:
                start_step(name, t)
        else:
            name, outs = payload  # type: ignore[misc]
            for out in outs:
                i = int(out.req_id[1:])
                rec = records[i]
                res, estimator = reservations[out.req_id]
                if out.new_token_ids:
                    if rec.first_token is None:
                        rec.first_token = t
                        rec.cached_tokens = out.num_cached_tokens
                        res.first_token(t)
                    rec.generated += len(out.new_token_ids)
                if out.finished:
                    rec.end = t
                    res.release(t, rec.generated)
                    del reservations[out.req_id]
                    pending -= 1
                    estimator.observe_usage("m", rec.prompt_tokens * BYTES_PER_TOKEN, rec.prompt_tokens,
                                            rec.generated)
            start_step(name, t)
    return records


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(p / 100 * len(xs)) - 1))]


def summarize(records: list[Record], ttft_slo_s: float, tpot_slo_s: float) -> dict[str, float]:
    """TTFT / TPOT / e2e statistics (vLLM benchmark definitions: TPOT = (e2e - TTFT) /
    (output tokens - 1)), throughput, goodput at the SLO, prefix hit ratio, imbalance."""
    done = [r for r in records if r.end is not None and r.first_token is not None]
    ttft = [r.first_token - r.arrival for r in done]
    tpot = [(r.end - r.first_token) / (r.generated - 1) for r in done if r.generated > 1]
    e2e = [r.end - r.arrival for r in done]
    span = max(r.end for r in done) - min(r.arrival for r in records) if done else float("nan")
    good = sum(1 for r in done if r.first_token - r.arrival <= ttft_slo_s and
               (r.generated <= 1 or (r.end - r.first_token) / (r.generated - 1) <= tpot_slo_s))
    by_backend: dict[str, int] = {}
    for r in records:
        by_backend[r.backend] = by_backend.get(r.backend, 0) + r.prompt_tokens - r.cached_tokens
    prompt = sum(r.prompt_tokens for r in done)
    return {
        "requests": len(records), "completed": len(done), "errors": sum(1 for r in records if r.error),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else float("nan"), "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "tpot_mean_s": statistics.fmean(tpot) if tpot else float("nan"), "tpot_p99_s": _pct(tpot, 99),
        "e2e_mean_s": statistics.fmean(e2e) if e2e else float("nan"), "e2e_p99_s": _pct(e2e, 99),
        "throughput_tok_s": sum(r.generated for r in done) / span, "request_rate": len(done) / span,
        "goodput_req_s": good / span, "slo_attainment": good / len(records),
        "hit_ratio": sum(r.cached_tokens for r in done) / prompt if prompt else 0.0,
        "predicted_hit_ratio": sum(r.predicted_cached for r in done) / prompt if prompt else 0.0,
        "prefill_imbalance": max(by_backend.values()) / statistics.fmean(by_backend.values()),
    }


def _job(args: tuple) -> tuple[str, str, dict[str, float], float]:
    trace, policy, n, scale, fleet_names, ttft_slo, tpot_slo, seed = args
    reqs = scale_time(load_trace(trace, n), scale)
    t0 = time.process_time()
    recs = replay(reqs, policy, make_fleet(fleet_names), seed=seed)
    return trace, policy, summarize(recs, ttft_slo, tpot_slo), time.process_time() - t0


COLUMNS = [("ttft_mean_s", "TTFT mean s", 3), ("ttft_p50_s", "TTFT p50 s", 3), ("ttft_p99_s", "TTFT p99 s", 2),
           ("tpot_mean_s", "TPOT mean ms", 1000), ("e2e_mean_s", "e2e mean s", 2), ("throughput_tok_s", "out tok/s", 0),
           ("goodput_req_s", "goodput req/s", 2), ("slo_attainment", "SLO %", 100), ("hit_ratio", "hit %", 100),
           ("predicted_hit_ratio", "pred. hit %", 100), ("prefill_imbalance", "prefill max/mean", 2)]


def format_table(rows: list[tuple[str, dict[str, float]]]) -> str:
    head = "| policy | " + " | ".join(c[1] for c in COLUMNS) + " |"
    out = [head, "|" + "---|" * (len(COLUMNS) + 1)]
    for policy, s in rows:
        cells = []
        for key, _, fmt in COLUMNS:
            v = s[key]
            if fmt == 1000:
                cells.append(f"{v * 1000:.1f}")
            elif fmt == 100:
                cells.append(f"{v * 100:.1f}")
            else:
                cells.append(f"{v:.{fmt}f}")
        out.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(out)


# The benchmark of the routing issue: per trace, how many requests and the time scale
# (inter-arrival multiplier) that loads the 4-backend fleet so that round robin's mean
# TTFT is well above its unloaded value; each row of the output says both.
BENCH = {
    "mooncake_conversation": (2000, 1.7),
    "mooncake_synthetic": (1500, 1.6),
    "azure_conv": (3000, 0.15),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.replay", description=__doc__.split("\n")[0])
    ap.add_argument("--trace", choices=sorted(TRACES), action="append")
    ap.add_argument("--all", action="store_true", help="the routing benchmark: every BENCH trace, every policy")
    ap.add_argument("--policy", action="append", choices=sorted(BENCH_POLICIES))
    ap.add_argument("--requests", type=int, help="first N requests of the trace")
    ap.add_argument("--time-scale", type=float, help="multiply inter-arrival times (<1: more load)")
    ap.add_argument("--fleet", default=",".join(DEFAULT_FLEET), help="comma-separated profile names")
    ap.add_argument("--ttft-slo", type=float, default=2.0, help="TTFT SLO for goodput, seconds")
    ap.add_argument("--tpot-slo", type=float, default=0.1, help="TPOT SLO for goodput, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", help="write the summaries here")
    args = ap.parse_args(argv)
    traces = list(BENCH) if args.all or not args.trace else args.trace
    policies = args.policy or list(BENCH_POLICIES)
    fleet_names = tuple(args.fleet.split(","))
    jobs = []
    for tr in traces:
        n, scale = BENCH.get(tr, (1000, 1.0))
        n = args.requests or n
        scale = args.time_scale or scale
        jobs.append((tr, "unloaded", n, scale))
        for p in policies:
            jobs.append((tr, p, n, scale))
    work = []
    for tr, p, n, scale in jobs:
        if p == "unloaded":  # round robin at 1/20 of the load: the unloaded reference
            work.append((tr, "round_robin", n // 4, scale * 20, fleet_names, args.ttft_slo, args.tpot_slo, args.seed))
        else:
            work.append((tr, p, n, scale, fleet_names, args.ttft_slo, args.tpot_slo, args.seed))
    t0 = time.monotonic()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(_job, work))
    out: dict[str, dict] = {}
    for (tr, label, n, scale), (_, _, summary, cpu) in zip(jobs, results):
        out.setdefault(tr, {"requests": n, "time_scale": scale, "fleet": list(fleet_names), "policies": {}})
        out[tr]["policies"][label] = {**summary, "cpu_s": cpu}
    for tr, block in out.items():
        pol = block["policies"]
        unloaded = pol.pop("unloaded")
        rr = pol.get("round_robin")
        print(f"\n### {tr}: first {block['requests']} requests, inter-arrival x{block['time_scale']}, "
              f"fleet {', '.join(fleet_names)}; SLO TTFT <= {args.ttft_slo} s, TPOT <= {args.tpot_slo * 1000:.0f} ms")
        if rr:
            print(f"round robin mean TTFT {rr['ttft_mean_s']:.3f} s vs unloaded {unloaded['ttft_mean_s']:.3f} s "
                  f"(x{rr['ttft_mean_s'] / unloaded['ttft_mean_s']:.1f})\n")
        print(format_table(list(pol.items())))
        block["unloaded_round_robin"] = unloaded
    print(f"\n(wall {time.monotonic() - t0:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
