"""The precise prefix index benchmark (issue 18): approximate, precise and precise
without speculative entries, side by side on the same workloads, in virtual time.

Each row is :func:`loadtest.replay.replay` with ``estimated_ttft`` on the
heterogeneous replay fleet (2 x ``h100-llama3-8b`` + 2 x ``a100-llama3-8b``,
:data:`loadtest.replay.DEFAULT_FLEET`):

- ``approximate``: the engines publish nothing; the prefix index knows what was sent
  where, bounded by each backend's KV capacity;
- ``precise``: every engine publishes its KV events (vLLM's wire format, decoded and
  applied by the gateway's own code), the router keys prompts by token ids, dispatch
  records speculative entries that an event confirms within ``speculative_s``;
- ``precise, no speculative``: the same with ``speculative_s: 0``.

The router's token ids are the engine's own (the trace's token ids, given to both), so
the blocks match exactly; a live gateway gets them from the model's tokenizer, whose
cost is measured here separately on each workload's HTTP prompt text
(:func:`tokenize_us`: the tests' tiny BPE tokenizer by default, prefix cache on) and
added to the gateway CPU column. Workloads: the Mooncake conversation trace, a
many-tenant shared-prefix workload (:func:`loadtest.traces.shared_prefix_trace`), and
(only when asked for) the same with clients outside the gateway sending to the same
engines (:func:`direct_clients_trace`); every number but the direct clients' own table
is of the gateway's requests. The reference rows are the trace's hit ratio through one
LRU cache as large as the fleet's KV and through one infinite cache
(:func:`loadtest.replay.ceiling_hit_ratio`); ``--mode oracle`` adds the row of
``estimated_ttft`` told the engines' true cache contents (what a perfect index would
give the policy).

    python -m loadtest.precise_bench --jobs 2                       # the README table
    python -m loadtest.precise_bench --workload shared_prefix --rate 6 9 12
    python -m loadtest.precise_bench --workload shared_prefix_direct_clients --rate 6 9 \
        --mode approximate --mode precise --mode "precise, no speculative" --mode oracle
    python -m loadtest.precise_bench --live        # the same three modes over HTTP + ZMQ, small
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from loadtest.replay import (
    APPROXIMATE,
    DEFAULT_FLEET,
    ORACLE,
    PRECISE,
    FleetMember,
    ceiling_hit_ratio,
    make_fleet,
    replay,
    summarize,
)
from loadtest.traces import (
    TRACE_BLOCK_TOKENS,
    TraceRequest,
    block_words,
    load_trace,
    scale_time,
    shared_prefix_trace,
    trace_prompt_text,
)

TINY_TOKENIZER = Path(__file__).resolve().parent.parent / "tests" / "support" / "data" / "tiny-tokenizer"
MODES = {  # row label: (evidence, speculative_s or None for --speculative-s)
    "approximate": (APPROXIMATE, None),
    "precise": (PRECISE, None),
    "precise, no speculative": (PRECISE, 0.0),
}
SHARED_PREFIX, DIRECT_CLIENTS = "shared_prefix", "shared_prefix_direct_clients"
WORKLOADS = ("mooncake_conversation", SHARED_PREFIX, DIRECT_CLIENTS)
DEFAULT_WORKLOADS = WORKLOADS[:2]
DIRECT_SEED_OFFSET = 1_000_003  # the direct clients' draws share no random stream with any seed's gateway draws


def direct_clients_trace(args: argparse.Namespace, rate: float, fleet: list[FleetMember]) -> list[TraceRequest]:
    """The shared-prefix workload with clients outside the gateway on the same engines.

    ``args.shared_requests`` requests arrive at ``rate`` req/s in all; a fraction
    ``args.direct_share`` of them (rounded) come from ``args.direct_tenants`` direct
    tenants, the rest from the gateway's ``args.tenants`` tenants, as two independent
    Poisson streams (:func:`loadtest.traces.shared_prefix_trace`, same prompt shapes,
    the gateway's stream exactly the ``shared_prefix`` workload's at its share of the
    rate). Direct tenants have system prompts of their own (block ids disjoint from the
    gateway's) and each is pinned to one engine, ``fleet[tenant % len(fleet)]``, as a
    session-sticky client spreads its sessions evenly over the engines it knows
    regardless of their speed. Returns the merged requests by arrival, the direct ones
    with ``direct_backend`` set. Raises ``ValueError`` unless ``0 < direct_share < 1``
    and both populations get at least one request."""
    share = args.direct_share
    n_direct = round(args.shared_requests * share)
    if not 0 < share < 1 or not 0 < n_direct < args.shared_requests:
        raise ValueError(f"direct_share {share:g} of {args.shared_requests} requests leaves the gateway or the "
                         "direct clients without a request")
    gateway = shared_prefix_trace(args.tenants, args.shared_requests - n_direct, args.system_prompt_len,
                                  args.question_len, args.output_len, rate * (1 - share), args.seed)
    direct = shared_prefix_trace(args.direct_tenants, n_direct, args.system_prompt_len, args.question_len,
                                 args.output_len, rate * share, args.seed + DIRECT_SEED_OFFSET)
    offset = max(h for r in gateway for h in r.hash_ids or ())  # these traces are made of blocks
    sys_blocks = args.system_prompt_len // TRACE_BLOCK_TOKENS
    for r in direct:
        hash_ids = r.hash_ids
        assert hash_ids is not None  # likewise
        tenant = (hash_ids[0] - 1) // sys_blocks
        r.direct_backend = fleet[tenant % len(fleet)].name
        r.hash_ids = [h + offset for h in hash_ids]
    return sorted(gateway + direct, key=lambda r: r.arrival_s)


def make_workload(name: str, args: argparse.Namespace, rate: float | None = None) -> list[TraceRequest]:
    """The requests of workload ``name`` under the command's settings (``rate``: the
    shared-prefix workloads' arrival rate, req/s). Raises ``ValueError`` for an unknown
    name."""
    if name == "mooncake_conversation":
        return scale_time(load_trace(name, args.conversation_requests), args.time_scale)
    if name == "shared_prefix":
        return shared_prefix_trace(args.tenants, args.shared_requests, args.system_prompt_len, args.question_len,
                                   args.output_len, rate if rate is not None else args.rate[0], args.seed)
    if name == DIRECT_CLIENTS:
        return direct_clients_trace(args, rate if rate is not None else args.rate[0],
                                    make_fleet(tuple(args.fleet.split(","))))
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")


def http_request(name: str, r: TraceRequest, i: int, system_blocks: int) -> tuple[str, dict]:
    """(endpoint, body) of request ``i`` as the benchmark client sends it over HTTP: a
    shared-prefix request as a chat with the tenant's system prompt and the question,
    a conversation-trace request as one user message (the prompt words of
    :func:`loadtest.traces.trace_prompt_text`)."""
    if name in (SHARED_PREFIX, DIRECT_CLIENTS):
        assert r.hash_ids is not None  # these traces are made of blocks
        system = "".join(block_words(h) for h in r.hash_ids[:system_blocks])
        question = trace_prompt_text(TraceRequest(0.0, r.input_tokens - system_blocks * TRACE_BLOCK_TOKENS, 1,
                                                  r.hash_ids[system_blocks:]), i)
        return "chat", {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    return "chat", {"messages": [{"role": "user", "content": trace_prompt_text(r, i)}]}


def tokenize_us(name: str, reqs: list[TraceRequest], system_blocks: int, path: str,
                sample: int | None = None) -> tuple[float, float]:
    """(mean microseconds per request, mean prompt tokens) of the model's own tokenizer
    (``path``: a ``tokenizer.json`` or model directory) turning the workload's requests
    (the first ``sample``, or all), in order, into token ids as the gateway does
    (:mod:`routing.tokenizer`: template, prefix cache, encoding; the process CPU it
    takes, as :func:`loadtest.routing_cost._tokenize_us` times it, like the other CPU
    columns), starting from an empty prefix cache of
    the gateway's default size, as a gateway starts."""
    from loadtest.routing_cost import _tokenize_us
    from routing.tokenizer import DEFAULT_CACHE_TOKENS, SegmentCache, load_tokenizer

    bodies = [http_request(name, r, i, system_blocks) for i, r in enumerate(reqs[:sample])]
    tok = load_tokenizer(path)
    tok.cache = SegmentCache(DEFAULT_CACHE_TOKENS)  # the loaded object is shared: give it an empty cache
    us, _ = _tokenize_us(tok, bodies, clock=time.process_time)
    probe = load_tokenizer(path, cache_tokens=0)
    tokens = statistics.fmean(len(probe.tokenization(e, d).token_ids()) for e, d in bodies[:200])
    return us, tokens


def _job(job: tuple) -> tuple[tuple, dict]:
    key, kind, args = job
    name, rate = key[0], key[1]
    reqs = make_workload(name, args, rate)
    fleet = make_fleet(tuple(args.fleet.split(",")))
    if kind == "ceiling":
        bs = fleet[0].profile.block_size
        pooled = sum(m.profile.num_gpu_blocks * m.profile.block_size for m in fleet) // bs
        return key, {"ceiling": ceiling_hit_ratio(reqs, bs), "pooled_tokens": pooled * bs,
                     "pooled": ceiling_hit_ratio(reqs, bs, pooled)}
    if kind == "tokenize":  # the gateway tokenizes its own requests only
        reqs = [r for r in reqs if r.direct_backend is None]
        us, tokens = tokenize_us(name, reqs, args.system_prompt_len // TRACE_BLOCK_TOKENS, args.tokenizer,
                                 args.tokenize_sample or None)
        return key, {"tokenize_us": us, "tokens": tokens}
    cpu: dict[str, float] = {}
    t0 = time.process_time()
    if kind == ORACLE:
        recs = replay(reqs, ORACLE, fleet, seed=args.seed, cpu=cpu)
    else:
        evidence, spec = MODES[kind]
        recs = replay(reqs, "estimated_ttft", fleet, seed=args.seed, evidence=evidence,
                      speculative_s=args.speculative_s if spec is None else spec, cpu=cpu)
    s: dict[str, Any] = summarize(recs, args.ttft_slo, args.tpot_slo)
    gateway_requests = sum(1 for r in recs if not r.direct)
    s.update({k: v / gateway_requests * 1e6 for k, v in cpu.items()})
    if gateway_requests < len(recs):
        s["direct"] = summarize(recs, args.ttft_slo, args.tpot_slo, direct=True)
    s["job_cpu_s"] = time.process_time() - t0
    return key, s


def format_table(rows: dict[str, dict], ref: dict, tok: dict) -> str:
    """One workload's table: a row per mode, then the pooled-KV and ceiling rows."""
    head = ["index", "TTFT mean s", "TTFT p50 s", "TTFT p99 s", "goodput req/s", "SLO %", "hit %", "pred. hit %",
            "hit / pooled KV", "hit / ceiling", "routing us/req", "KV events us/req", "tokenize us/req",
            "gateway CPU us/req"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, s in rows.items():
        tokenize = tok["tokenize_us"] if MODES.get(label, (APPROXIMATE,))[0] == PRECISE else 0.0
        total = s["route_s"] + s["kv_events_s"] + tokenize
        out.append("| " + " | ".join([
            label, f"{s['ttft_mean_s']:.3f}", f"{s['ttft_p50_s']:.3f}", f"{s['ttft_p99_s']:.2f}",
            f"{s['goodput_req_s']:.2f}", f"{s['slo_attainment'] * 100:.1f}", f"{s['hit_ratio'] * 100:.1f}",
            f"{s['predicted_hit_ratio'] * 100:.1f}", f"{s['hit_ratio'] / ref['pooled']:.2f}",
            f"{s['hit_ratio'] / ref['ceiling']:.2f}", f"{s['route_s']:.0f}", f"{s['kv_events_s']:.0f}",
            f"{tokenize:.0f}", f"{total:.0f}"]) + " |")
    dash = ["-"] * 5
    out.append("| " + " | ".join([f"pooled KV (1 backend, {ref['pooled_tokens'] / 1e6:.2f}M tokens, LRU)", *dash,
                                   f"{ref['pooled'] * 100:.1f}", "-", "1.00",
                                   f"{ref['pooled'] / ref['ceiling']:.2f}", *["-"] * 4]) + " |")
    out.append("| " + " | ".join(["ceiling (1 backend, infinite KV)", *dash, f"{ref['ceiling'] * 100:.1f}", "-",
                                   f"{ref['ceiling'] / ref['pooled']:.2f}", "1.00", *["-"] * 4]) + " |")
    return "\n".join(out)


def format_direct_table(rows: dict[str, dict]) -> str:
    """The direct clients' requests of a workload that has them: a row per mode."""
    head = ["index (gateway's)", "direct requests", "TTFT mean s", "TTFT p50 s", "TTFT p99 s", "goodput req/s",
            "SLO %", "hit %"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, s in rows.items():
        d = s["direct"]
        out.append("| " + " | ".join([
            label, str(d["requests"]), f"{d['ttft_mean_s']:.3f}", f"{d['ttft_p50_s']:.3f}",
            f"{d['ttft_p99_s']:.2f}", f"{d['goodput_req_s']:.2f}", f"{d['slo_attainment'] * 100:.1f}",
            f"{d['hit_ratio'] * 100:.1f}"]) + " |")
    return "\n".join(out)


def format_live_table(rows: dict[str, dict]) -> str:
    """The live run's table: a row per mode."""
    head = ["index", "TTFT mean s", "TTFT p50 s", "TTFT p99 s", "goodput req/s", "hit %", "pred. hit %",
            "evidence of the decisions", "gateway CPU us/req", "errors"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, r in rows.items():
        s = r["summary"]
        ev = ", ".join(f"{k} {v}" for k, v in sorted(r["evidence"].items()))
        out.append("| " + " | ".join([
            label, f"{s['mean_ttft_ms'] / 1000:.3f}", f"{s['median_ttft_ms'] / 1000:.3f}",
            f"{s['p99_ttft_ms'] / 1000:.2f}", f"{s['goodput']:.2f}",
            f"{r['hit_ratio'] * 100:.1f}", f"{r['predicted_hit_ratio'] * 100:.1f}", ev,
            f"{r['gateway_cpu_us']:.0f}", str(r["errors"])]) + " |")
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m loadtest.precise_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=WORKLOADS, action="append",
                    help=f"repeatable; default: {' and '.join(DEFAULT_WORKLOADS)}")
    ap.add_argument("--mode", choices=[*MODES, ORACLE], action="append",
                    help=f"repeatable; default: the three indexes; '{ORACLE}' (not with --live): estimated_ttft told "
                         "the engines' true cache contents (loadtest.replay.OracleTTFT), what a perfect index "
                         "would give this policy")
    ap.add_argument("--conversation-requests", type=int, default=2000, help="first N rows of the conversation trace")
    ap.add_argument("--time-scale", type=float, default=1.7, help="conversation trace inter-arrival multiplier")
    ap.add_argument("--tenants", type=int, default=150, help="the gateway's shared-prefix tenants")
    ap.add_argument("--shared-requests", type=int, default=1500)
    ap.add_argument("--system-prompt-len", type=int, default=6144, help="tokens, a multiple of 512")
    ap.add_argument("--question-len", type=int, default=1200)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rate", type=float, nargs="+", default=[9.0],
                    help="shared-prefix arrivals, req/s, direct clients' included (a sweep)")
    ap.add_argument("--direct-share", type=float, default=0.25,
                    help=f"{DIRECT_CLIENTS}: fraction of the requests sent by clients outside the gateway "
                         "(default 0.25)")
    ap.add_argument("--direct-tenants", type=int, default=50,
                    help=f"{DIRECT_CLIENTS}: the direct clients' tenants, each pinned to one engine (default 50: "
                         "at a 0.25 share, each sends as often as a gateway tenant)")
    ap.add_argument("--speculative-s", type=float, default=5.0, help="speculative bound of the 'precise' row")
    ap.add_argument("--fleet", default=",".join(DEFAULT_FLEET), help="comma-separated profile names")
    ap.add_argument("--tokenizer", default=str(TINY_TOKENIZER), help="tokenizer.json or model directory")
    ap.add_argument("--tokenize-sample", type=int, default=0,
                    help="time the tokenization of the first N requests of each workload (0: all of them)")
    ap.add_argument("--ttft-slo", type=float, default=2.0, help="TTFT SLO for goodput, seconds")
    ap.add_argument("--tpot-slo", type=float, default=0.1, help="TPOT SLO for goodput, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", help="write every row here")
    ap.add_argument("--live", action="store_true", help="instead: the small live run over HTTP + ZMQ (see live())")
    ap.add_argument("--live-tenants", type=int, default=30)
    ap.add_argument("--live-per-tenant", type=int, default=6)
    ap.add_argument("--live-system-len", type=int, default=2048, help="words")
    ap.add_argument("--live-question-len", type=int, default=400, help="words")
    ap.add_argument("--live-output-len", type=int, default=64)
    ap.add_argument("--live-rate", type=float, default=3.0, help="req/s")
    return ap


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark; returns ``{workload title: {"rows", "reference", "tokenize"}}``."""
    workloads = args.workload or list(DEFAULT_WORKLOADS)
    modes = args.mode or list(MODES)
    keys = [(w, r) for w in workloads for r in (args.rate if w in (SHARED_PREFIX, DIRECT_CLIENTS) else [None])]
    jobs = [(k, kind, args) for k in keys for kind in ("ceiling", "tokenize", *modes)]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        results = {(key, job[1]): s for job, (key, s) in zip(jobs, pool.map(_job, jobs))}
    out: dict[str, dict] = {}
    for key in keys:
        w, rate = key
        title = (f"{w}, first {args.conversation_requests} requests, inter-arrival x{args.time_scale}"
                 if rate is None else
                 f"{w}, {args.tenants} tenants, {args.system_prompt_len}-token system prompts, {args.question_len}-"
                 f"token questions, {args.output_len} output tokens, {args.shared_requests} requests at {rate:g} req/s")
        if w == DIRECT_CLIENTS:
            title += (f", {args.direct_share:g} of them from {args.direct_tenants} direct tenants pinned to one "
                      "engine each")
        out[title] = {"rows": {m: results[(key, m)] for m in modes}, "reference": results[(key, "ceiling")],
                      "tokenize": results[(key, "tokenize")]}
    return out


# --- the live path: real HTTP + ZMQ, one small run per mode -----------------------------

LIVE_FLEET = (("h100", "h100-llama3-8b", 3000), ("a100", "a100-llama3-8b", 2000))  # name, profile, KV blocks


def live(args: argparse.Namespace) -> dict[str, dict]:
    """The shared-prefix workload through the real path, once per mode, each on a fresh
    fleet: ``python -m loadtest.sim`` engines (speed 1, ``LIVE_FLEET``: KV caches cut so
    that the tenants' prefixes do not all fit) publishing KV events over ZMQ and
    tokenizing with ``args.tokenizer``, ``python -m gateway`` in front with the same
    tokenizer as the model's (so the engine's and the gateway's token ids are the same)
    and, for the precise modes, subscribed to the engines' events; the client is
    ``python -m loadtest run --workload shared-prefix`` (chat: system prompt + question).
    Returns per mode the client's summary, the gateway's CPU seconds per request
    (``/proc`` utime + stime of its process over the run, tokenization included), the
    evidence of each routing decision (``x-turbo-route``) and the predicted
    (``matched_tokens``) against the reported (``cached_tokens``) prefix tokens."""
    import subprocess
    import tempfile
    import urllib.request

    from loadtest.procs import cpu_seconds, start_gateway, start_sim, stop
    from loadtest.sim.profiles import PROFILES

    modes = args.mode or list(MODES)
    out: dict[str, dict] = {}
    for label in modes:
        evidence, spec_s = MODES[label]
        spec = [{"name": name, "models": ["m"], "profile": prof, "speed": 1.0, "tokenizer": args.tokenizer,
                 "profile_overrides": {"num_gpu_blocks": blocks}, "kv_events": {"topic": "kv-events"}}
                for name, prof, blocks in LIVE_FLEET]
        sim, urls = start_sim(spec)
        tmp = Path(tempfile.mkdtemp(prefix="tg-precise-live-"))
        try:
            backends = []
            for name, prof, blocks in LIVE_FLEET:
                b = {"name": name, "url": urls[name], "models": ["m"],
                     "hints": {"kv_capacity_tokens": blocks * PROFILES[prof].block_size}}
                if evidence == PRECISE:
                    with urllib.request.urlopen(urls[name] + "/kv_event_sources", timeout=10) as r:
                        src = json.loads(r.read())["0"]
                    b["kv_events"] = {"endpoint": src["endpoint"], "replay_endpoint": src["replay_endpoint"],
                                      "topic": "kv-events", "block_size": PROFILES[prof].block_size}
                backends.append(b)
            cfg = {"models": {"m": {"tokenizer": args.tokenizer}},
                   "routing": {"policy": "estimated_ttft", "scrape_interval_s": 0,
                               "speculative_s": args.speculative_s if spec_s is None else spec_s},
                   "backends": backends}
            gw, url, _ = start_gateway(cfg, workdir=str(tmp))
            try:
                cpu0 = cpu_seconds(gw.pid)
                subprocess.run([sys.executable, "-m", "loadtest", "run", "--target", url, "--model", "m",
                                "--workload", "shared-prefix", "-p",
                                (f"num_groups={args.live_tenants},prompts_per_group={args.live_per_tenant},"
                                 f"system_prompt_len={args.live_system_len},question_len={args.live_question_len},"
                                 f"output_len={args.live_output_len}"),
                                "-n", str(args.live_tenants * args.live_per_tenant),
                                "--rate", str(args.live_rate), "--seed", str(args.seed + 1),
                                "--slo", f"ttft_ms={args.ttft_slo * 1000:g},tpot_ms={args.tpot_slo * 1000:g}",
                                "--no-plots", "--out", str(tmp / "run")],
                               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800)
                cpu = cpu_seconds(gw.pid) - cpu0
            finally:
                stop(gw)
        finally:
            stop(sim)
        lane = json.loads((tmp / "run" / "results.json").read_text())["runs"][0]["lanes"][0]
        recs = lane["records"]
        ok = [r for r in recs if r.get("error") is None]
        routes = [dict(p.split("=", 1) for p in r["route"].split("; ")) for r in ok if r.get("route")]
        evid: dict[str, int] = {}
        for rt in routes:
            evid[rt.get("evidence", "approximate")] = evid.get(rt.get("evidence", "approximate"), 0) + 1
        prompt = sum(r["prompt_tokens"] or 0 for r in ok)
        out[label] = {"summary": lane["summary"], "requests": len(recs), "errors": len(recs) - len(ok),
                      "gateway_cpu_us": cpu / len(recs) * 1e6, "evidence": evid,
                      "hit_ratio": sum(r["cached_tokens"] or 0 for r in ok) / prompt if prompt else 0.0,
                      "predicted_hit_ratio": sum(float(rt.get("matched_tokens", 0)) for rt in routes) / prompt
                      if prompt else 0.0,
                      "prompt_tokens_mean": prompt / len(ok) if ok else 0.0}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.live and ORACLE in (args.mode or ()):
        ap.error(f"--mode {ORACLE} exists in the offline replay only, not with --live")
    t0 = time.monotonic()
    if args.live:
        rows = live(args)
        print(format_live_table(rows))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return 0
    out = run(args)
    for title, block in out.items():
        tok = block["tokenize"]
        print(f"\n### {title}\n")
        print(f"fleet {args.fleet}; estimated_ttft; SLO TTFT <= {args.ttft_slo:g} s, TPOT <= "
              f"{args.tpot_slo * 1000:.0f} ms; speculative_s {args.speculative_s:g}; tokenizer "
              f"{args.tokenizer} ({tok['tokens']:.0f} prompt tokens per request over HTTP, first 200)\n")
        print(format_table(block["rows"], block["reference"], tok))
        if any("direct" in s for s in block["rows"].values()):
            print("\nthe direct clients' requests (not through the gateway), under each of the gateway's indexes:\n")
            print(format_direct_table(block["rows"]))
    print(f"\n(wall {time.monotonic() - t0:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
