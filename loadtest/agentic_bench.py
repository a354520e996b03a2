"""Agentic benchmark: agent sessions through the routing policies, with and without
sessions, on the simulated heterogeneous fleet, in virtual time.

    python -m loadtest.agentic_bench                        # the default run (about 8 min on 2 cores)
    python -m loadtest.agentic_bench --sessions 40 --no-mooncake --json out.json

The workload is :mod:`loadtest.agentic` (its docstring gives every parameter and its
source). The fleet is the offline replay's (:mod:`loadtest.replay`): 2 x
``h100-llama3-8b`` + 2 x ``a100-llama3-8b``, 1.18M tokens of KV in all, engines of
:class:`loadtest.sim.engine.Engine` stepped in virtual time, the gateway's own
:class:`routing.core.DecisionCore` routing (speeds learned, engines' prefill counters
scraped every 2 s as the gateway's scraper does). Sessions are closed loops: a turn is
sent when the previous one ended and its tool call returned (the gap); sub-agents start
when their parent's turn ends, and the parent's next turn waits for all of them.

Each turn is what a client sends: its ``x-session-id`` header names its session, and
the session the router sees is the gateway's own reading of that header
(:func:`gateway.pipeline.session.session_of` under ``sessions.enabled`` on or off,
scoped by the caller's key, one key ``agents`` here).

Rows, one run each on a fresh fleet and router, the same sessions and arrival times:

- ``round_robin``, ``cache_aware``, ``estimated_ttft``: without sessions;
- ``estimated_ttft + sessions``: with them;
- under overload (session arrivals ``--overload`` times faster, admission control on:
  ``admission.max_in_flight_per_backend`` ``--max-in-flight``, the gateway's default
  ``queue_timeout_s`` of 10 s, after which a turn is refused with 503 and the client
  sends it again 1 s later, its ``Retry-After``): ``estimated_ttft + sessions`` with
  ``admission.session_fairness`` ``off`` and ``las``. The admission queue is the
  gateway's own :class:`gateway.tenancy.fair_queue.WaitQueue`, driven in virtual time.

Columns: per-turn TTFT (the turn's send, including any wait in the admission queue and
retries, to its first token) mean, p50 and p99; session completion time (a top-level
session's arrival to its last turn's end, sub-agents included) p50 and p99; the
engines' prefix hit ratio (cached over prompt tokens) and that ratio over the
**pooled-cache ideal** (the same prompts in their nominal order, each turn sent at its
session's arrival plus its gaps, through one LRU cache as large as the fleet's KV:
what the fleet's memory could hold as one pool); goodput (turns per second with TTFT
<= ``--ttft-slo`` and TPOT <= ``--tpot-slo``); and the **KV evictions of waiting
sessions**: KV blocks evicted while the session that last used them was between turns
(in a tool call or waiting for its sub-agents) and would come back (counted by the
engines, :attr:`loadtest.sim.engine.Engine.on_idle_eviction`), in tokens. Session rows
also give where the turns went (``home``, ``moved``, ``new``).

The Mooncake conversation trace (first ``--mooncake-requests`` rows, inter-arrival
x1.7, as ``loadtest.replay``'s benchmark) runs through ``estimated_ttft`` without and
with sessions, the sessions named by :func:`loadtest.traces.conversation_sessions`.

Every loop is bounded: the workload has a fixed number of sessions of at most 60 turns
(sub-agents at most 12) and every engine step advances virtual time.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gateway.apis.registry import CHAT
from gateway.config import Admission, Sessions
from gateway.pipeline.session import session_of
from gateway.tenancy.fair_queue import Charge, Waiter, WaitQueue
from loadtest import agentic
from loadtest.agentic import AgentParams, AgentSession, tokens_and_text
from loadtest.replay import (
    BYTES_PER_TOKEN,
    DEFAULT_FLEET,
    SCRAPE_INTERVAL_S,
    make_fleet,
    make_policy_seeded,
    replay,
    start_engine_step,
    summarize,
)
from loadtest.sim.engine import Engine
from loadtest.traces import conversation_sessions, load_trace, scale_time
from routing import BackendSpec
from routing.core import DecisionCore, Reservation
from routing.policies.base import Decision

KEY = "agents"  # the one caller's key name
MODEL = "m"
RETRY_AFTER_S = 1.0  # a refused turn is sent again this much later (the 503's Retry-After)
MOONCAKE_SCALE = 1.7  # loadtest.replay's benchmark scale for the conversation trace


@dataclass(frozen=True, slots=True)
class Row:
    """One run: ``label``, routing ``policy``, whether requests name sessions, whether
    it is the overload phase, and ``session_fairness`` (``None``: no admission
    control)."""

    label: str
    policy: str
    sessions: bool
    overload: bool = False
    session_fairness: str | None = None


ROWS = (
    Row("round_robin", "round_robin", False),
    Row("cache_aware", "cache_aware", False),
    Row("estimated_ttft", "estimated_ttft", False),
    Row("estimated_ttft + sessions", "estimated_ttft", True),
    Row("overload: estimated_ttft + sessions, fairness off", "estimated_ttft", True, True, "off"),
    Row("overload: estimated_ttft + sessions, fairness las", "estimated_ttft", True, True, "las"),
)


@dataclass(slots=True)
class TurnRecord:
    """One turn's outcome: its session, index, when it was ready to send, first token
    and end (virtual seconds), tokens, backend and the router's predicted hit."""

    session: str
    turn: int
    ready: float
    dispatched: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    predicted_cached: float = 0.0
    backend: str = ""
    first_token: float | None = None
    end: float | None = None
    generated: int = 0
    refused: int = 0
    error: str | None = None


@dataclass(slots=True)
class _State:
    """A session during the run."""

    s: AgentSession
    router_session: str | None
    next_turn: int = 0
    joins: int = 0  # sub-agents still running
    phase: str = "gap"  # gap (between turns), busy (a turn queued or running), done
    tokens: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    end: float | None = None


def _router_session(s: AgentSession, enabled: bool) -> str | None:
    """The session id the gateway gives a request of ``s`` (its ``x-session-id``)."""
    return session_of(Sessions(enabled=enabled), CHAT, {"model": MODEL}, s.headers(), KEY)


def run(row: Row, params: AgentParams, seed: int = 0, fleet_names: tuple[str, ...] = DEFAULT_FLEET,
        max_in_flight: int = 8) -> tuple[list[TurnRecord], dict[str, Any]]:
    """Run the agentic workload of ``params`` (``seed``) through ``row`` on a fresh
    fleet in virtual time. Returns every turn's record and the run's counters:
    ``evicted_waiting_blocks``, ``block_size``, ``placements``, ``refused``,
    ``sessions`` (per top-level session: arrival and end) and ``preemptions``."""
    sessions = agentic.generate(params, seed)
    fleet = make_fleet(fleet_names)
    specs = [BackendSpec(m.name, frozenset({MODEL}), kv_capacity_tokens=m.profile.kv_capacity_tokens,
                         kv_base_model=MODEL) for m in fleet]
    core = DecisionCore(specs, row.policy)
    core.router.policy = make_policy_seeded(row.policy, random.Random(seed * 1000))
    engines = {m.name: Engine(m.profile, engine_id=m.name) for m in fleet}
    busy = dict.fromkeys(engines, False)
    states: dict[str, _State] = {}
    for top in sessions:
        for x in top.all_sessions():
            states[x.id] = _State(x, _router_session(x, row.sessions))
    evicted = [0]

    def idle_evicted(tag: str) -> None:
        st = states.get(tag)
        if st is not None and st.phase == "gap":
            evicted[0] += 1

    for e in engines.values():
        e.on_idle_eviction = idle_evicted
    queue: WaitQueue | None = None
    if row.session_fairness is not None:
        queue = WaitQueue(Admission(max_in_flight_per_backend=max_in_flight,
                                    session_fairness=row.session_fairness))
    qcfg = queue.cfg if queue is not None else None
    records: list[TurnRecord] = []
    inflight: dict[str, tuple[int, _State, Reservation, Charge | None, Decision]] = {}
    events: list[tuple[float, int, str, Any]] = []
    seq = 0
    refused = 0

    def push(t: float, kind: str, payload: Any) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, payload))

    def prompt(st: _State, k: int) -> tuple[list[int], str]:
        turn = st.s.turns[k]
        if k == 0:
            st.tokens, text = tokens_and_text(st.s.start)
            st.text = [text]
        if turn.compact:
            st.tokens, text = tokens_and_text(st.s.base)
            st.text = [text]
        more, more_text = tokens_and_text(turn.append)
        st.tokens.extend(more)
        st.text.append(more_text)
        return st.tokens, "".join(st.text)

    def room(_model: str) -> int:
        return sum(max(max_in_flight - b.requests, 0) for b in core.fleet.backends.values())

    def start_step(name: str, t: float) -> None:
        start_engine_step(engines, busy, name, t, push)

    def ready(st: _State, t: float, i: int | None = None) -> None:
        """Turn ``st.next_turn`` of ``st`` is sent at ``t`` (``i``: a retry's record)."""
        k = st.next_turn
        st.phase = "busy"
        if i is None:
            tokens, _ = prompt(st, k)
            records.append(TurnRecord(st.s.id, k, t, prompt_tokens=len(tokens),
                                      output_tokens=st.s.turns[k].output_tokens))
            i = len(records) - 1
        _, req = core.request(MODEL, "".join(st.text), records[i].output_tokens, session=st.router_session)
        if queue is None:
            dispatch(i, st, req, t, None)
            return
        if queue.waiting == 0 and room(MODEL) > 0:
            dispatch(i, st, req, t, queue.charge(KEY, req.prompt_tokens, 1.0, st.router_session))
            return
        w = Waiter(MODEL, KEY, req.prompt_tokens, 1.0, st.router_session, t, future=(i, st, req))
        queue.push(w, 0)
        assert qcfg is not None
        push(t + qcfg.queue_timeout_s, "queue_timeout", w)
        pump(t)  # the gateway re-checks its queue every RECHECK_S: room may be free already

    def dispatch(i: int, st: _State, req: Any, t: float, charge: Charge | None) -> None:
        rec = records[i]
        rec.dispatched = t
        tokens = st.tokens
        decision, res = core.route(req, t)
        name = decision.backend.name
        rec.backend = name
        rec.predicted_cached = decision.detail.get("matched_tokens", 0.0)
        engines[name].add_request(f"r{i}", tokens, rec.output_tokens, arrival_time=t,
                                  output_tokens=rec.output_tokens, session=st.s.id)
        inflight[f"r{i}"] = (i, st, res, charge, decision)
        if not busy[name]:
            start_step(name, t)

    def pump(t: float) -> None:
        if queue is None:
            return
        while (w := queue.pop_next(room, t)) is not None:
            i, st, req = w.future
            dispatch(i, st, req, t, queue.charge(w.key, w.prompt_tokens, w.weight, w.session))

    def finished(st: _State, t: float) -> None:
        """``st``'s current turn ended at ``t``: fork, wait, or go on."""
        turn = st.s.turns[st.next_turn]
        st.next_turn += 1
        st.phase = "gap"
        for sub in turn.forks:
            st.joins += 1
            ready(states[sub.id], t)
        if not turn.forks:
            advance(st, t)

    def advance(st: _State, t: float) -> None:
        if st.next_turn < len(st.s.turns):
            push(t + st.s.turns[st.next_turn].gap_s, "ready", st)
            return
        st.phase, st.end = "done", t
        if st.s.parent is not None:
            parent = states[st.s.parent]
            parent.joins -= 1
            if parent.joins == 0:
                advance(parent, t)

    for top in sessions:
        assert top.arrival_s is not None  # generate() sets it on every top-level session
        push(top.arrival_s, "ready", states[top.id])
    push(0.0, "scrape", None)
    while events:
        t, _, kind, payload = heapq.heappop(events)
        if kind == "ready":
            ready(payload, t)
        elif kind == "scrape":
            for name, b in core.fleet.backends.items():
                eng = engines[name]
                if b.load.observe_engine_prefill(t, eng.prefill_s_total,
                                                 eng.prompt_tokens_total - eng.prompt_tokens_cached_total):
                    core.backend_restarted(b)
            if any(st.phase != "done" for st in states.values()):
                push(t + SCRAPE_INTERVAL_S, "scrape", None)
        elif kind == "queue_timeout":
            assert queue is not None
            if queue.remove(payload, 0):  # still waiting: 503, the client sends it again
                i, st, _ = payload.future
                records[i].refused += 1
                refused += 1
                push(t + RETRY_AFTER_S, "retry", (i, st))
        elif kind == "retry":
            i, st = payload
            ready(st, t, i)
        elif kind == "step":
            name, _, outs, _ = payload
            for out in outs:
                i, st, res, charge, decision = inflight[out.req_id]
                rec = records[i]
                if out.new_token_ids:
                    if rec.first_token is None:
                        rec.first_token = t
                        rec.cached_tokens = out.num_cached_tokens
                        res.first_token(t)
                    rec.generated += len(out.new_token_ids)
                if out.finished:
                    rec.end = t
                    del inflight[out.req_id]
                    res.outcome(True, t)
                    res.release(t, rec.generated)
                    core.learn_usage(MODEL, rec.prompt_tokens * BYTES_PER_TOKEN, rec.prompt_tokens, rec.generated)
                    # the engine's reported prefix hit, as the data plane's settlement teaches it
                    core.learn_cached(decision, rec.prompt_tokens, rec.cached_tokens or 0)
                    if charge is not None:
                        charge.settle(rec.prompt_tokens, rec.generated, cached_tokens=rec.cached_tokens)
                    finished(st, t)
                    pump(t)
            start_step(name, t)
    pending = sum(1 for st in states.values() if st.phase != "done")
    info = {
        "evicted_waiting_blocks": evicted[0], "block_size": fleet[0].profile.block_size,
        "placements": dict(core.router.sessions.placements), "refused": refused, "unfinished_sessions": pending,
        "sessions": [(top.arrival_s, states[top.id].end) for top in sessions],
        "preemptions": sum(e.num_preemptions for e in engines.values()),
    }
    return records, info


def pct(xs: list[float], p: float) -> float:
    """The ``p``-th percentile of ``xs`` (nearest rank; ``nan`` when empty)."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(p / 100 * len(xs)) - 1))]


def summarize_run(records: list[TurnRecord], info: dict[str, Any], ttft_slo_s: float,
                  tpot_slo_s: float) -> dict[str, Any]:
    """The row's numbers (module docstring's columns)."""
    done = [(r, r.first_token, r.end) for r in records if r.end is not None and r.first_token is not None]
    ttft = [first - r.ready for r, first, _ in done]
    tpot = [(end - first) / (r.generated - 1) for r, first, end in done if r.generated > 1]
    waits = [r.dispatched - r.ready for r, _, _ in done if r.dispatched is not None]
    good = sum(1 for r, first, end in done if first - r.ready <= ttft_slo_s and
               (r.generated <= 1 or (end - first) / (r.generated - 1) <= tpot_slo_s))
    span = max(end for _, _, end in done) - min(r.ready for r in records) if done else float("nan")
    completion = [end - arr for arr, end in info["sessions"] if end is not None]
    prompt = sum(r.prompt_tokens for r, _, _ in done)
    return {
        "turns": len(records), "completed": len(done), "refused": info["refused"],
        "queued": sum(1 for w in waits if w > 0), "queue_wait_mean_s": statistics.fmean(waits) if waits else 0.0,
        "ttft_mean_s": statistics.fmean(ttft) if ttft else float("nan"), "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99), "tpot_mean_s": statistics.fmean(tpot) if tpot else float("nan"),
        "session_p50_s": pct(completion, 50), "session_p99_s": pct(completion, 99),
        "sessions_completed": len(completion), "unfinished_sessions": info["unfinished_sessions"],
        "hit_ratio": sum(r.cached_tokens for r, _, _ in done) / prompt if prompt else 0.0,
        "predicted_hit_ratio": sum(r.predicted_cached for r, _, _ in done) / prompt if prompt else 0.0,
        "goodput_turns_s": good / span if span else float("nan"), "slo_attainment": good / len(records),
        "evicted_waiting_tokens": info["evicted_waiting_blocks"] * info["block_size"],
        "placements": info["placements"], "preemptions": info["preemptions"],
        "share": {b: n / len(done) for b, n in sorted(collections.Counter(r.backend for r, _, _ in done).items())},
    }


def nominal_prompts(params: AgentParams, seed: int = 0) -> list[tuple[float, tuple]]:
    """Every turn's prompt (segments) with its nominal send time: its session's
    arrival plus the gaps before it, service taking no time (sub-agents start with
    their parent's turn, the parent goes on when the last of them ends)."""
    out: list[tuple[float, tuple]] = []

    def walk(s: AgentSession, t: float) -> float:
        for turn, ctx in zip(s.turns, s.prompts()):
            t += turn.gap_s
            out.append((t, ctx))
            if turn.forks:
                t = max(walk(f, t) for f in turn.forks)
        return t

    for top in agentic.generate(params, seed):
        assert top.arrival_s is not None  # set for every top-level session
        walk(top, top.arrival_s)
    out.sort(key=lambda x: x[0])
    return out


def pooled_hit_ratio(params: AgentParams, seed: int, block_size: int, capacity_blocks: int) -> dict[str, float]:
    """The pooled-cache ideal (module docstring) and the ceiling (one cache of infinite
    size), both as hit ratios: a turn's hit is the longest run of its leading
    ``block_size`` blocks cached when it is sent, at most ``prompt - 1`` tokens (the
    engine's rule); its prompt's blocks then enter the cache, last block first (so
    that LRU evicts a prompt's tail before its prefix)."""
    lru: collections.OrderedDict[int, None] = collections.OrderedDict()
    seen: set[int] = set()
    hit = ceil = total = 0
    for _, ctx in nominal_prompts(params, seed):
        tokens, _ = tokens_and_text(ctx)
        hashes = []
        parent = 0
        for j in range(0, len(tokens) - block_size + 1, block_size):
            parent = hash((parent, tuple(tokens[j:j + block_size])))
            hashes.append(parent)
        n = (len(tokens) - 1) // block_size
        k = 0
        while k < n and hashes[k] in lru:
            k += 1
        c = 0
        while c < n and hashes[c] in seen:
            c += 1
        hit += k * block_size
        ceil += c * block_size
        total += len(tokens)
        seen.update(hashes)
        for h in reversed(hashes):
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return {"pooled": hit / total if total else 0.0, "ceiling": ceil / total if total else 0.0}


def _job(args: tuple) -> tuple[str, dict[str, Any], float]:
    kind, label, payload = args
    t0 = time.process_time()
    if kind == "agentic":
        row, params, seed, fleet_names, max_in_flight, ttft_slo, tpot_slo = payload
        records, info = run(row, params, seed, fleet_names, max_in_flight)
        out = summarize_run(records, info, ttft_slo, tpot_slo)
    elif kind == "pooled":
        params, seed, fleet_names = payload
        fleet = make_fleet(fleet_names)
        bs = fleet[0].profile.block_size
        blocks = sum(m.profile.num_gpu_blocks * m.profile.block_size for m in fleet) // bs
        out = {**pooled_hit_ratio(params, seed, bs, blocks), "pooled_tokens": blocks * bs}
    else:  # mooncake
        sessions, n, fleet_names, seed, ttft_slo, tpot_slo = payload
        reqs = scale_time(load_trace("mooncake_conversation", n), MOONCAKE_SCALE)
        if sessions:
            reqs = conversation_sessions(reqs)
        recs = replay(reqs, "estimated_ttft", make_fleet(fleet_names), seed=seed)
        out = summarize(recs, ttft_slo, tpot_slo)
    return label, out, time.process_time() - t0


def format_table(rows: list[tuple[str, dict[str, Any]]], pooled: float | None) -> str:
    """The agentic rows as one markdown table."""
    head = ["row", "turns", "TTFT mean s", "TTFT p50 s", "TTFT p99 s", "session p50 s", "session p99 s",
            "hit %", "hit / pooled", "goodput turns/s", "waiting-session KV evicted (M tokens)", "queued",
            "refused", "home / moved / new"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, s in rows:
        pl = s["placements"]
        place = f"{pl.get('home', 0)} / {pl.get('moved', 0)} / {pl.get('new', 0)}" if any(pl.values()) else "-"
        cells = [label, f"{s['completed']}/{s['turns']}", f"{s['ttft_mean_s']:.3f}", f"{s['ttft_p50_s']:.3f}",
                 f"{s['ttft_p99_s']:.2f}", f"{s['session_p50_s']:.1f}", f"{s['session_p99_s']:.1f}",
                 f"{s['hit_ratio'] * 100:.1f}", f"{s['hit_ratio'] / pooled:.2f}" if pooled else "-",
                 f"{s['goodput_turns_s']:.2f}", f"{s['evicted_waiting_tokens'] / 1e6:.2f}", str(s["queued"]),
                 str(s["refused"]), place]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def format_mooncake(rows: list[tuple[str, dict[str, Any]]]) -> str:
    head = ["row", "TTFT mean s", "TTFT p50 s", "TTFT p99 s", "goodput req/s", "hit %"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, s in rows:
        out.append(f"| {label} | {s['ttft_mean_s']:.3f} | {s['ttft_p50_s']:.3f} | {s['ttft_p99_s']:.2f} | "
                   f"{s['goodput_req_s']:.2f} | {s['hit_ratio'] * 100:.1f} |")
    return "\n".join(out)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.agentic_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=AgentParams().sessions, help="top-level agent sessions")
    ap.add_argument("--rate", type=float, default=AgentParams().rate, help="session arrivals per second")
    ap.add_argument("-p", "--param", action="append", default=[],
                    help="another workload parameter, key=value (a lognormal as median:sigma:lo:hi)")
    ap.add_argument("--overload", type=float, default=1.5, help="overload rows: arrival rate multiplier")
    ap.add_argument("--max-in-flight", type=int, default=8, help="overload rows: admission cap per backend")
    ap.add_argument("--row", action="append", choices=[r.label for r in ROWS], help="repeatable; default: all")
    ap.add_argument("--fleet", default=",".join(DEFAULT_FLEET), help="comma-separated profile names")
    ap.add_argument("--ttft-slo", type=float, default=2.0, help="TTFT SLO for goodput, seconds")
    ap.add_argument("--tpot-slo", type=float, default=0.1, help="TPOT SLO for goodput, seconds")
    ap.add_argument("--no-mooncake", action="store_true", help="skip the Mooncake conversation rows")
    ap.add_argument("--mooncake-requests", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    overrides = dict(kv.split("=", 1) for item in args.param for kv in item.split(",") if kv)
    try:
        params = replace(agentic.params_with(overrides), sessions=args.sessions, rate=args.rate)
    except ValueError as e:
        ap.error(str(e))
    fleet_names = tuple(args.fleet.split(","))
    rows = [r for r in ROWS if not args.row or r.label in args.row]
    jobs: list[tuple] = [("pooled", "pooled", (params, args.seed, fleet_names))]
    overloaded = replace(params, rate=params.rate * args.overload)
    if any(r.overload for r in rows):
        jobs.append(("pooled", "pooled overload", (overloaded, args.seed, fleet_names)))
    for r in rows:
        jobs.append(("agentic", r.label, (r, overloaded if r.overload else params, args.seed, fleet_names,
                                          args.max_in_flight, args.ttft_slo, args.tpot_slo)))
    if not args.no_mooncake:
        for sess in (False, True):
            jobs.append(("mooncake", "mooncake: estimated_ttft" + (" + sessions" if sess else ""),
                         (sess, args.mooncake_requests, fleet_names, args.seed, args.ttft_slo, args.tpot_slo)))
    t0 = time.monotonic()
    # the longest jobs first, so that the pool's tail is short
    order = sorted(range(len(jobs)), key=lambda j: jobs[j][0] != "agentic")
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        done = dict(zip(order, pool.map(_job, [jobs[j] for j in order])))
    results = [done[j] for j in range(len(jobs))]
    by_label = {label: (out, cpu) for label, out, cpu in results}
    pooled = by_label["pooled"][0]
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    cmd = "python -m loadtest.agentic_bench " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"# agentic benchmark, {when}, commit {_commit()}\n\n`{cmd.strip()}`\n")
    print(f"workload: {params.sessions} sessions at {params.rate:g}/s (overload rows: x{args.overload:g}, "
          f"admission.max_in_flight_per_backend {args.max_in_flight}), seed {args.seed}; "
          f"fleet {', '.join(fleet_names)}; "
          f"SLO TTFT <= {args.ttft_slo} s, TPOT <= {args.tpot_slo * 1000:.0f} ms\n")
    for phase, key in (("normal load", False), ("overload", True)):
        phase_rows = [(r.label, by_label[r.label][0]) for r in rows if r.overload == key]
        if not phase_rows:
            continue
        ideal = by_label["pooled overload" if key else "pooled"][0]
        print(f"## {phase}: pooled-cache ideal {ideal['pooled'] * 100:.1f}% "
              f"({ideal['pooled_tokens'] / 1e6:.2f}M tokens, LRU), ceiling {ideal['ceiling'] * 100:.1f}%\n")
        print(format_table(phase_rows, ideal["pooled"]))
        print()
    moon = [(label, by_label[label][0]) for kind, label, _ in jobs if kind == "mooncake"]
    if moon:
        print(f"## Mooncake conversation trace, first {args.mooncake_requests} rows, inter-arrival x{MOONCAKE_SCALE}\n")
        print(format_mooncake(moon))
        print()
    print("cpu s per job: " + ", ".join(f"{label} {cpu:.0f}" for label, _, cpu in results))
    print(f"(wall {time.monotonic() - t0:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": cmd, "date": when, "params": asdict(params),
                                               "pooled": pooled, "rows": {k: v[0] for k, v in by_label.items()}},
                                              indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
