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

Cache use (loadtest/README.md, "Oracle and ceiling"): the ``oracle`` row is
``estimated_ttft`` with the engines' true cache contents in place of the prefix index's
guess (:class:`OracleTTFT`, replay only: the gateway cannot import it); the ceiling row
is the trace's hit ratio on one backend with an infinite KV cache, the pooled-KV row on
one LRU cache as large as the fleet's KV (:func:`ceiling_hit_ratio`); every row's hit
ratio is also given as a fraction of the oracle's and of the ceiling.
``--scenario restart`` restarts one backend at the trace's midpoint (cache lost, down
for a few seconds, the router told through the gateway's health hooks);
``--scenario slow`` divides one backend's speed by 10 for a minute of virtual time.

    python -m loadtest.replay --trace mooncake_conversation --requests 600 \
        --policy estimated_ttft --policy cache_aware --policy oracle
    python -m loadtest.replay --trace mooncake_conversation --requests 600 \
        --policy estimated_ttft --policy oracle --scenario restart
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import heapq
import inspect
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.sim.engine import Engine, prompt_block_hashes
from loadtest.sim.kv_event_publisher import encode_batch
from loadtest.sim.profiles import PROFILES, Profile
from loadtest.traces import (  # noqa: F401
    BYTES_PER_TOKEN,
    MAX_INPUT_TOKENS,
    TRACE_BLOCK_TOKENS,
    TRACES,
    TRACES_DIR,
    TraceRequest,
    load_trace,
    request_tokens_and_text,
    scale_time,
)
from routing import POLICIES, BackendSpec, BackendState, NoBackendAvailable, RouteRequest
from routing.core import DecisionCore, Reservation
from routing.estimate import TokenEstimator
from routing.load import RemoteLoad
from routing.policies.base import Decision, Match
from routing.policies.estimated_ttft import EstimatedTTFT
from routing.retry import DEFAULT_FAILED_BACKEND_COOLDOWN_S, DEFAULT_MAX_ATTEMPTS, RetryPolicy

BENCH_POLICIES = ("round_robin", "least_requests", "power_of_two", "prefix_hash", "cache_aware",
                  "cache_aware_min_load", "estimated_ttft")
ORACLE = "oracle"  # replay only: estimated_ttft told the engines' true cache contents
REPLAY_POLICIES = BENCH_POLICIES + (ORACLE,)
SCENARIOS = ("none", "restart", "slow", "gateway_restart")
APPROXIMATE, PRECISE = "approximate", "precise"
EVIDENCE = (APPROXIMATE, PRECISE)  # what the prefix index learns from: dispatch only, or the engines' KV events too
RESTART_DOWN_S = 5.0  # a restarting backend is down this long (virtual seconds)
SLOW_WINDOW_S = 60.0  # a slowed backend stays slow this long
SLOWDOWN = 10.0  # ... at its speed divided by this
GATEWAY_COLD_S = 50.0  # after a gateway restart, the window reported (about 100 requests of the Mooncake traces)
# What the gateway does when an attempt fails before any byte reached the client: its
# retry policy (routing.retry, the defaults of the config's ``retries``), modelled in
# virtual time: retry on another backend after a full-jitter backoff, at most
# DEFAULT_MAX_ATTEMPTS attempts in all; a refused connection keeps the backend out
# DEFAULT_FAILED_BACKEND_COOLDOWN_S.
MAX_ATTEMPTS = DEFAULT_MAX_ATTEMPTS
FAILED_BACKEND_COOLDOWN_S = DEFAULT_FAILED_BACKEND_COOLDOWN_S
# Llama-3.1-8B serves 128k context; the stock profiles say 8k (Llama-3-8B). The replay
# raises max_model_len and caps prompts at MAX_INPUT_TOKENS (a prefix of the trace's
# hash_ids, so prefix sharing is kept) so that every prompt fits every backend's KV cache.
MAX_MODEL_LEN = 131072
# The gateway's default ``routing.scrape_interval_s``: every interval the replay reads each
# live engine's prefill counters as the scraper reads them from /metrics (gateway/engine_signals/metrics_scraper.py).
SCRAPE_INTERVAL_S = 2.0
COLD_START_REQUESTS = 100  # the first requests of a run, where the router has learned little yet


@dataclass(slots=True)
class Record:
    """One request's outcome (seconds, tokens); ``direct``: sent to its engine by a
    client outside the gateway (:attr:`loadtest.traces.TraceRequest.direct_backend`)."""

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
    attempts: int = 1
    direct: bool = False


@dataclass
class FleetMember:
    name: str
    profile: Profile


DEFAULT_FLEET = ("h100-llama3-8b", "h100-llama3-8b", "a100-llama3-8b", "a100-llama3-8b")


def make_fleet(profile_names: tuple[str, ...] = DEFAULT_FLEET) -> list[FleetMember]:
    return [FleetMember(f"b{i}-{p.split('-')[0]}", dataclasses.replace(PROFILES[p], max_model_len=MAX_MODEL_LEN))
            for i, p in enumerate(profile_names)]


class OracleTTFT(EstimatedTTFT):
    """``estimated_ttft`` with perfect cache information: the same cost model, tie rule
    and everything else, but each candidate's prefix match is what its engine really
    holds for the request at hand instead of what the prefix index guesses.

    ``truth(backend name)`` gives the fraction (0..1) of the current request's prompt
    that the backend holds: its engine's prefix cache now, extended by the prompts
    already dispatched to it and not yet computed (the engine computes them before this
    request, FCFS; the prefix index counts them from dispatch too, so the oracle is not
    handicapped on bursts of siblings). The fraction is applied to the router's own
    prompt-token estimate, so only the cache knowledge differs from ``estimated_ttft``.
    The router then reserves load with the same truth (uncached tokens). Lives here, in
    ``loadtest``: the gateway cannot import it (``make_policy("oracle")`` fails).
    """

    name = ORACLE

    def __init__(self, truth: Callable[[str], float], rng: random.Random | None = None) -> None:
        super().__init__(rng=rng)
        self.truth = truth

    def choose(self, request: RouteRequest, candidates: Sequence[BackendState], match: Match) -> Decision:
        per_block = request.prompt_tokens / request.tokens_per_block if request.tokens_per_block else 0.0
        matched: dict[str, float] = {}
        for b in candidates:
            f = self.truth(b.name)
            if f > 0:
                matched[b.name] = f * per_block
        match.matched_blocks = matched  # type: ignore[assignment]  # fractional blocks: exact tokens
        decision = super().choose(request, candidates, match)
        decision.policy = ORACLE
        return decision


@dataclass(frozen=True, slots=True)
class Scenario:
    """Something that happens to one backend during a replay.

    - ``restart``: at ``start`` the backend's engine is lost (requests in flight there
      fail: those without a first token are retried elsewhere as the gateway does, the
      others are cut), the router hears "health down"; ``duration_s`` later a cold
      engine is up, the router hears "health up" (``healthy = True`` and
      :meth:`routing.core.DecisionCore.backend_restarted`, the gateway's hooks).
    - ``slow``: from ``start`` for ``duration_s`` the backend's engine runs at its speed
      divided by ``slowdown`` (a noisy neighbour); the router is told nothing.
    - ``gateway_restart``: at ``start`` every gateway replica is replaced by a new one
      that knows nothing (no learned speeds, no prefix index), as a restart, reload or
      rollout of the gateway would; the engines keep running, warm. The old replicas
      finish the requests they hold. ``backend`` is not used; ``duration_s`` is the
      window whose requests are reported as its "during" phase.

    Times are virtual seconds of the replayed (scaled) trace.
    """

    kind: str
    backend: str
    start: float
    duration_s: float
    slowdown: float = SLOWDOWN

    @property
    def end(self) -> float:
        return self.start + self.duration_s

    def describe(self) -> str:
        if self.kind == "gateway_restart":
            return f"the gateway restarts cold at t={self.start:.1f} s (engines warm)"
        if self.kind == "restart":
            return (f"{self.backend} restarts at t={self.start:.1f} s (cache lost), down {self.duration_s:g} s, "
                    f"back at t={self.end:.1f} s")
        return (f"{self.backend} runs {self.slowdown:g}x slower from t={self.start:.1f} s to t={self.end:.1f} s "
                f"({self.duration_s:g} s)")


def make_scenario(kind: str, reqs: list[TraceRequest], fleet: list[FleetMember], *, backend: str | None = None,
                  at: float = 0.5, duration_s: float | None = None, slowdown: float = SLOWDOWN) -> Scenario | None:
    """The ``kind`` scenario (``none`` gives ``None``) on ``backend`` (default: the
    fleet's first), starting at fraction ``at`` of the trace's arrival span (0.5: its
    midpoint), lasting ``duration_s`` (default :data:`RESTART_DOWN_S` for a restart,
    :data:`SLOW_WINDOW_S` for a slowdown). Raises ``ValueError`` on an unknown kind or
    backend."""
    if kind == "none":
        return None
    if kind not in SCENARIOS:
        raise ValueError(f"unknown scenario {kind!r}; known: {', '.join(SCENARIOS)}")
    names = [m.name for m in fleet]
    backend = backend or names[0]
    if backend not in names:
        raise ValueError(f"unknown backend {backend!r}; the fleet has {', '.join(names)}")
    t0, t1 = reqs[0].arrival_s, reqs[-1].arrival_s
    if duration_s is None:
        duration_s = {"restart": RESTART_DOWN_S, "gateway_restart": GATEWAY_COLD_S}.get(kind, SLOW_WINDOW_S)
    return Scenario(kind, backend, t0 + at * (t1 - t0), duration_s, slowdown)


def ceiling_hit_ratio(reqs: list[TraceRequest], block_size: int = 16, capacity_blocks: int | None = None) -> float:
    """The trace's best possible prefix-cache hit ratio: the replay on ONE backend with
    an infinite KV cache and instant prefill (every earlier prompt is cached when a
    request arrives). A request's hit is the longest run of its leading ``block_size``
    blocks that an earlier prompt had, capped at ``prompt - 1`` tokens as the engine's
    own lookup (:meth:`loadtest.sim.engine.Engine.cached_prefix_tokens`); the ratio is
    hit tokens over prompt tokens of the gateway's requests (a request with a
    ``direct_backend`` fills the cache but is not counted). No fleet of any size can
    hit more: a backend's cache only ever holds blocks of prompts that arrived earlier
    (generated tokens never match a trace prompt).

    With ``capacity_blocks`` the one cache is finite: an LRU of that many blocks, a
    prompt's blocks touched last-first so that its tail is evicted before its prefix
    (the engine's release order), generated tokens not stored. With the fleet's total
    KV it says what the fleet's memory could hold if it were one pool (not a bound: LRU
    is not optimal, and running requests pin blocks in a real engine)."""
    seen: collections.OrderedDict[int, None] = collections.OrderedDict()
    hit = total = 0
    for i, r in enumerate(reqs):
        tokens, _ = request_tokens_and_text(r, i)
        hashes = prompt_block_hashes(tokens, block_size)
        n = (len(tokens) - 1) // block_size
        k = 0
        while k < n and hashes[k] in seen:
            k += 1
        if r.direct_backend is None:
            hit += k * block_size
            total += len(tokens)
        if capacity_blocks is None:
            seen.update(dict.fromkeys(hashes))
            continue
        for h in reversed(hashes[:capacity_blocks]):
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > capacity_blocks:
            seen.popitem(last=False)
    return hit / total if total else 0.0


def make_policy_seeded(name: str, rng: random.Random):
    """The policy ``name`` of :data:`routing.policies.POLICIES`, given ``rng`` for its
    random choices when its constructor takes one (replays then repeat exactly)."""
    cls = POLICIES[name]
    try:
        takes_rng = "rng" in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        takes_rng = False
    return cls(rng=rng) if takes_rng else cls()  # type: ignore[call-arg]  # rng: when its signature has it


Watch = Callable[[str, float, dict[str, Engine]], None]


def replay(reqs: list[TraceRequest], policy: str, fleet: list[FleetMember], *, seed: int = 0,
           block_tokens: int = 64, know_kv_capacity: bool = True, replicas: int = 1,
           shared: bool = True, staleness_s: float = 0.05, scenario: Scenario | None = None,
           watch: Watch | None = None, engine_metrics: bool = True, evidence: str = APPROXIMATE,
           speculative_s: float = 5.0, cpu: dict[str, float] | None = None,
           router_inputs: list[tuple] | None = None) -> list[Record]:
    """Run ``reqs`` through ``policy`` (a name of :data:`REPLAY_POLICIES`) on ``fleet``
    in virtual time; return one :class:`Record` per request. Speeds are not hinted: the
    router learns them. Policies that take an ``rng`` get one seeded from ``seed``.

    With ``replicas`` > 1, request ``i`` goes to gateway replica ``i % replicas`` (an
    L4 balancer's round robin), each with its own router; with ``shared`` every
    replica sees the others' load and dispatched prefix blocks ``staleness_s`` late
    (what :class:`gateway.store.routing_state.RedisStore` gives at its default bound),
    otherwise never.

    With ``engine_metrics``, every :data:`SCRAPE_INTERVAL_S` the routers read the
    engines' prefill counters (a restarting engine's cannot be read), as the gateway's
    scraper does; the engines' queue and KV gauges are not fed to them.

    ``scenario`` (see :class:`Scenario`) restarts or slows one backend, or restarts the
    gateway; ``watch(phase,
    t, engines)`` is called at its transitions (``restart_before``, ``restart_down``,
    ``restart_up``, ``slow_start``, ``slow_end``, ``gateway_restart``) with the live
    engines by name.

    ``evidence``: ``approximate`` (the engines publish nothing: the prefix index has
    only what the router sent where) or ``precise`` (every engine publishes its KV
    events; each step's batch is encoded in vLLM's wire format by
    :func:`loadtest.sim.kv_event_publisher.encode_batch` and handed to every replica's
    :meth:`routing.core.DecisionCore.kv_event_batch` when the step ends, as the
    gateway's subscriber does; the router gets each prompt's token ids, the ones the
    engine computes, so its token-exact keys are the engine's blocks).
    ``speculative_s``: how long a token-exact entry recorded at dispatch waits for its
    event (0: none recorded). ``cpu``, when given, gets the process CPU seconds the
    router spent: ``route_s`` (estimate, token keys, route, reservation updates) and
    ``kv_events_s`` (decoding and applying event batches), summed over replicas.
    ``router_inputs``, when given, gets what the routers were handed, in order:
    ``("kv", backend, payload)`` per event batch and ``("route", prompt_text,
    token_ids, output_tokens, excluded backends, now)`` per routing decision (what
    :mod:`loadtest.precise_cost` applies again to measure the router alone).

    A request with a ``direct_backend`` comes from a client outside the gateway: at its
    arrival that engine queues it (its prefill stores its blocks and evicts others; with
    ``precise`` its KV events reach the routers like any other), but no router routes
    it, reserves load for it, records it in its prefix index or learns from its
    outcome; the engines' prefill counters that the routers scrape include it, as an
    engine's ``/metrics`` would. Its :class:`Record` has ``direct`` set (it fails,
    without a retry, when its engine is down). Raises ``ValueError`` when a
    ``direct_backend`` is not in the fleet.
    """
    random.seed(seed)
    if policy not in REPLAY_POLICIES:
        raise KeyError(f"unknown replay policy {policy!r}; known: {', '.join(REPLAY_POLICIES)}")
    if evidence not in EVIDENCE:
        raise ValueError(f"unknown evidence {evidence!r}; known: {', '.join(EVIDENCE)}")
    unknown = {r.direct_backend for r in reqs if r.direct_backend is not None} - {m.name for m in fleet}
    if unknown:
        raise ValueError(f"direct_backend {', '.join(sorted(unknown))} not in the fleet "
                         f"({', '.join(m.name for m in fleet)})")
    oracle = policy == ORACLE
    precise = evidence == PRECISE
    clock = time.process_time
    spent = {"route_s": 0.0, "kv_events_s": 0.0}
    engines: dict[str, Engine] = {m.name: Engine(m.profile, engine_id=m.name, kv_events=precise) for m in fleet}
    profiles = {m.name: m.profile for m in fleet}
    down: set[str] = set()  # restarting backends: a connection to them is refused
    # The oracle's view: per backend, block hashes of prompts dispatched there and not yet
    # computed; the current request's engine block hashes, per block size.
    pending_blocks: dict[str, collections.Counter[int]] = {m.name: collections.Counter() for m in fleet}
    req_blocks: dict[int, tuple[str, list[int]]] = {}
    current: dict[str, Any] = {"hashes": {}, "tokens": 1}  # {"hashes": {block size: hashes}, "tokens": n}

    def truth(name: str) -> float:
        if name in down:
            return 0.0
        eng = engines[name]
        hashes: list[int] = current["hashes"][eng.block_size]
        n_max = (current["tokens"] - 1) // eng.block_size
        pend = pending_blocks[name]
        n = 0
        while True:
            m = min(eng.cached_prefix_blocks(hashes, n), n_max)
            while m < n_max and hashes[m] in pend:
                m += 1
            if m == n:
                break
            n = m
        return n * eng.block_size / current["tokens"]

    def make_gateway(k: int) -> tuple[DecisionCore, TokenEstimator]:
        specs = [BackendSpec(m.name, frozenset({"m"}),
                             kv_capacity_tokens=m.profile.kv_capacity_tokens if know_kv_capacity else None,
                             kv_block_size=m.profile.block_size if precise else None, kv_base_model="m")
                 for m in fleet]
        core = DecisionCore(specs, "estimated_ttft" if oracle else policy, block_tokens=block_tokens,
                            speculative_s=speculative_s)
        rng = random.Random(seed * 1000 + k)
        core.router.policy = OracleTTFT(truth, rng=rng) if oracle else make_policy_seeded(policy, rng)
        return core, core.estimator

    gateways = [make_gateway(k) for k in range(replicas)]
    busy = {m.name: False for m in fleet}
    records: list[Record] = [Record(r.arrival_s, direct=r.direct_backend is not None) for r in reqs]
    reservations: dict[str, tuple[Reservation, TokenEstimator, DecisionCore, Decision]] = {}
    excluded: dict[int, set[str]] = {}
    retry_policy = RetryPolicy(rng=random.Random(seed))  # the gateway's, with its defaults
    events: list[tuple[float, int, str, Any]] = []  # the payload's type follows the kind
    # (visible at, seq, from, backend, hashes)
    blocks_in_flight: list[tuple[float, int, int, str, tuple[int, ...]]] = []
    seq = 0
    pending = len(reqs)

    def push(t: float, kind: str, payload: Any) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, payload))

    def start_step(name: str, t: float) -> None:
        start_engine_step(engines, busy, name, t, push, publish if precise else None)

    def publish(name: str, eng: Engine, kv: list) -> None:
        """The engine's KV events of one step, as the gateway's subscriber hands them on."""
        payload = encode_batch(0.0, kv, block_size=eng.block_size)
        if router_inputs is not None:
            router_inputs.append(("kv", name, payload))
        c0 = clock()
        for core, _ in gateways:
            core.kv_event_batch(name, 0, payload)
        spent["kv_events_s"] += clock() - c0

    def sync(t: float) -> None:
        for k, (core, _) in enumerate(gateways):
            for name, b in core.fleet.backends.items():
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

    def scrape(t: float) -> None:
        if not engine_metrics:
            return
        for core, _ in gateways:
            for name, b in core.fleet.backends.items():
                if name in down:
                    continue
                eng = engines[name]
                if b.load.observe_engine_prefill(t, eng.prefill_s_total,
                                                 eng.prompt_tokens_total - eng.prompt_tokens_cached_total):
                    core.backend_restarted(b)  # its counters went back (gateway/engine_signals/metrics_scraper.py)

    def forget_pending(i: int) -> None:
        entry = req_blocks.pop(i, None)
        if entry is None:
            return
        name, hashes = entry
        pend = pending_blocks[name]
        for h in hashes:
            c = pend[h] - 1
            if c > 0:
                pend[h] = c
            else:
                del pend[h]

    def fail(i: int, t: float, name: str, error: str, retry: bool) -> None:
        """Attempt of request ``i`` on ``name`` failed at ``t``: retry it elsewhere (a
        gateway retry: only before its first byte, at most MAX_ATTEMPTS in all) or give up."""
        nonlocal pending
        rec = records[i]
        forget_pending(i)
        backoff = retry_policy.after_failure(retry and rec.first_token is None, rec.attempts, rec.arrival, t)
        if backoff is not None:
            excluded.setdefault(i, set()).add(name)
            rec.attempts += 1
            push(t + backoff, "arrival", i)
            return
        rec.error = error
        pending -= 1

    def submit(i: int, name: str, tokens: list[int], t: float) -> str | None:
        """Queue request ``i`` on engine ``name``; the engine's refusal, or None."""
        r = reqs[i]
        try:
            engines[name].add_request(f"r{i}", tokens, r.output_tokens, arrival_time=t, output_tokens=r.output_tokens)
        except ValueError as e:
            return str(e)
        if oracle:
            hashes = prompt_block_hashes(tokens, engines[name].block_size)
            req_blocks[i] = (name, hashes)
            pending_blocks[name].update(hashes)
        if not busy[name]:
            start_step(name, t)
        return None

    def direct(i: int, t: float) -> None:
        """Request ``i`` from a client outside the gateway: straight to its engine."""
        nonlocal pending
        r, rec = reqs[i], records[i]
        name = r.direct_backend
        assert name is not None  # dispatch() sends only those here
        tokens, _ = request_tokens_and_text(r, i)
        rec.backend, rec.prompt_tokens, rec.output_tokens = name, len(tokens), r.output_tokens
        error = "connection refused" if name in down else submit(i, name, tokens, t)
        if error is not None:
            rec.error = error
            pending -= 1

    def dispatch(i: int, t: float) -> None:
        nonlocal seq, pending
        r = reqs[i]
        rec = records[i]
        if r.direct_backend is not None:
            direct(i, t)
            return
        k = i % replicas
        core, estimator = gateways[k]
        tokens, text = request_tokens_and_text(r, i)
        if oracle:
            current["hashes"] = {bs: prompt_block_hashes(tokens, bs) for bs in {e.block_size for e in engines.values()}}
            current["tokens"] = len(tokens)
        c0 = clock()
        try:
            est = estimator.estimate("m", text, r.output_tokens, None, tokens if precise else None)
            tpb = estimator.block_bytes / estimator.stats("m").bytes_per_token
            req = RouteRequest("m", exclude=frozenset(excluded.get(i, ())), prompt_text=text,
                               prompt_bytes=est.size_bytes, block_hashes=est.hashes, prompt_tokens=est.prompt_tokens,
                               output_tokens=est.output_tokens, tokens_per_block=tpb,
                               token_ids=tokens if precise else None,
                               token_keys=core.token_keys("m", tokens) if precise else None, session=r.session)
            if router_inputs is not None:
                router_inputs.append(("route", text, tokens, r.output_tokens, tuple(sorted(req.exclude)), t))
            decision, res = core.route(req, t)
        except NoBackendAvailable as e:
            spent["route_s"] += clock() - c0
            if e.retry_after_s is not None and rec.attempts < retry_policy.max_attempts:
                rec.attempts += 1
                push(t + e.retry_after_s, "arrival", i)
            else:
                rec.error = "no backend available"
                pending -= 1
            return
        spent["route_s"] += clock() - c0
        name = decision.backend.name
        if share:
            seq += 1
            heapq.heappush(blocks_in_flight, (t + staleness_s, seq, k, name, est.hashes))
        rec.backend, rec.prompt_tokens, rec.output_tokens = name, len(tokens), r.output_tokens
        rec.predicted_cached = decision.detail.get("matched_tokens", 0.0)
        if name in down:  # the backend is restarting: the connection is refused
            res.outcome(False, t)
            res.release(t)
            core.cool_down(decision.backend, t + FAILED_BACKEND_COOLDOWN_S)
            fail(i, t, name, "connection refused", retry=True)
            return
        error = submit(i, name, tokens, t)
        if error is not None:
            rec.error = error
            res.release(t)
            pending -= 1
            return
        reservations[f"r{i}"] = (res, estimator, core, decision)  # the engine's step that uses it is a later event

    def restart(name: str, t: float) -> None:
        nonlocal pending
        if watch:
            watch("restart_before", t, engines)
        for rid, (res, *_) in list(reservations.items()):
            i = int(rid[1:])
            if records[i].backend != name:
                continue
            del reservations[rid]
            res.outcome(False, t)
            res.release(t)
            fail(i, t, name, "backend restarted mid-stream", retry=True)
        for i, rec in enumerate(records):  # direct clients' requests in flight there are lost
            if rec.direct and rec.backend == name and rec.end is None and rec.error is None:
                rec.error = "backend restarted mid-stream"
                forget_pending(i)
                pending -= 1
        engines[name] = Engine(profiles[name], engine_id=f"{name}-restarted", kv_events=precise)
        if precise:  # its events start again at seq 0: the subscriber sees a restart
            for core, _ in gateways:
                core.kv_event_restart(name, 0)
        pending_blocks[name].clear()
        busy[name] = False
        down.add(name)
        for core, _ in gateways:  # the health checker marks it down (gateway/engine_signals/health_checks.py)
            core.fleet.backends[name].healthy = False
        if watch:
            watch("restart_down", t, engines)

    def back_up(name: str, t: float) -> None:
        down.discard(name)
        for core, _ in gateways:  # ... and up again, with the gateway's on_recovered hook
            b = core.fleet.backends[name]
            b.healthy = True
            core.backend_restarted(b)
        if watch:
            watch("restart_up", t, engines)

    for i, r in enumerate(reqs):
        push(r.arrival_s, "arrival", i)
    if scenario is not None:
        if scenario.backend not in engines:
            raise ValueError(f"scenario backend {scenario.backend!r} is not in the fleet")
        push(scenario.start, f"{scenario.kind}_start", scenario.backend)
        push(scenario.end, f"{scenario.kind}_end", scenario.backend)
    share = shared and replicas > 1
    if share:
        push(0.0, "sync", None)
    if engine_metrics:
        push(0.0, "scrape", None)
    slow_speed: dict[str, float] = {}

    while events:
        t, _, kind, payload = heapq.heappop(events)
        if kind == "sync":
            sync(t)
            if pending:
                push(t + staleness_s, "sync", None)
        elif kind == "scrape":
            scrape(t)
            if pending:
                push(t + SCRAPE_INTERVAL_S, "scrape", None)
        elif kind == "arrival":
            dispatch(payload, t)
        elif kind == "step":
            name, eng, outs, kv = payload
            if engines[name] is not eng:
                continue  # the engine restarted during this step: its outputs never arrive
            if kv:
                publish(name, eng, kv)
            c0 = clock()
            for out in outs:
                i = int(out.req_id[1:])
                rec = records[i]
                routed = reservations.get(out.req_id)  # None: a direct client's request
                if out.new_token_ids:
                    if rec.first_token is None:
                        rec.first_token = t
                        rec.cached_tokens = out.num_cached_tokens
                        if routed is not None:
                            routed[0].first_token(t)
                        forget_pending(i)
                    rec.generated += len(out.new_token_ids)
                if out.finished:
                    rec.end = t
                    pending -= 1
                    forget_pending(i)
                    if routed is not None:
                        res, estimator, gw_core, decision = routed
                        res.outcome(True, t)
                        res.release(t, rec.generated)
                        del reservations[out.req_id]
                        estimator.observe_usage("m", rec.prompt_tokens * BYTES_PER_TOKEN,
                                                rec.prompt_tokens, rec.generated)
                        # the engine's reported prefix hit, as the data plane's settlement teaches it
                        gw_core.learn_cached(decision, rec.prompt_tokens, rec.cached_tokens or 0)
            spent["route_s"] += clock() - c0
            start_step(name, t)
        elif kind == "restart_start":
            restart(payload, t)
        elif kind == "restart_end":
            back_up(payload, t)
        elif kind == "slow_start":
            assert scenario is not None  # only a scenario pushes it
            eng = engines[payload]
            slow_speed[payload] = eng.speed
            eng.speed = eng.speed / scenario.slowdown
            if watch:
                watch("slow_start", t, engines)
        elif kind == "slow_end":
            engines[payload].speed = slow_speed.pop(payload)
            if watch:
                watch("slow_end", t, engines)
        elif kind == "gateway_restart_start":
            gateways[:] = [make_gateway(k) for k in range(replicas)]
            scrape(t)  # the gateway's scraper reads every backend once at startup
            if watch:
                watch("gateway_restart", t, engines)
    if cpu is not None:
        cpu.update(spent)
    return records


def start_engine_step(engines: dict[str, Engine], busy: dict[str, bool], name: str, t: float,
                      push: Callable[[float, str, Any], None],
                      publish: Callable[[str, Engine, list], None] | None = None) -> None:
    """Start engine ``name``'s next step at virtual time ``t`` (seconds), as a simulated
    engine's loop does: when it has work and the step takes time or yields outputs,
    ``busy[name]`` is set and ``push(t + dt, "step", (name, engine, outputs, kv))`` schedules
    its end; otherwise ``busy[name]`` is cleared (the next request added starts it again).
    ``publish``: where the step's KV events go when it ends at once (``None``: they are not
    taken, and ``kv`` is ``None``); a scheduled step carries them to its end."""
    eng = engines[name]
    if not eng.has_work():
        busy[name] = False
        return
    dt, outs = eng.step(t)
    kv = eng.take_kv_events() if publish is not None else None
    if dt <= 0 and not outs:
        busy[name] = False
        if kv and publish is not None:
            publish(name, eng, kv)
        return
    busy[name] = True
    push(t + dt, "step", (name, eng, outs, kv))


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(p / 100 * len(xs)) - 1))]


def summarize(records: list[Record], ttft_slo_s: float, tpot_slo_s: float,
              cold_from: float = -math.inf, direct: bool = False) -> dict[str, Any]:
    """TTFT / TPOT / e2e statistics (vLLM benchmark definitions: TPOT = (e2e - TTFT) /
    (output tokens - 1)), throughput, goodput at the SLO, prefix hit ratio, imbalance,
    and (not floats) ``share``: per backend, the fraction of requests it served last,
    and ``cold_start``: the same over the first :data:`COLD_START_REQUESTS` requests by
    arrival (from ``cold_from``, e.g. a gateway restart), with their mean TTFT.

    Of the gateway's own requests, or with ``direct`` of the direct clients' ones
    (:attr:`Record.direct`). Raises ``ValueError`` when there are none."""
    records = [r for r in records if r.direct == direct]
    if not records:
        raise ValueError(f"no {'direct clients' if direct else 'gateway'} requests to summarize")
    # the completed ones, with their first token's and their end's times
    done = [(r, r.first_token, r.end) for r in records if r.end is not None and r.first_token is not None]
    ttft = [first - r.arrival for r, first, _ in done]
    tpot = [(end - first) / (r.generated - 1) for r, first, end in done if r.generated > 1]
    e2e = [end - r.arrival for r, _, end in done]
    span = max(end for _, _, end in done) - min(r.arrival for r in records) if done else float("nan")
    good = sum(1 for r, first, end in done if first - r.arrival <= ttft_slo_s and
               (r.generated <= 1 or (end - first) / (r.generated - 1) <= tpot_slo_s))
    by_backend: dict[str, int] = {}
    count: dict[str, int] = {}
    for r in records:
        by_backend[r.backend] = by_backend.get(r.backend, 0) + r.prompt_tokens - r.cached_tokens
        count[r.backend] = count.get(r.backend, 0) + 1
    prompt = sum(r.prompt_tokens for r, _, _ in done)
    first = sorted((r for r in records if r.arrival >= cold_from), key=lambda r: r.arrival)[:COLD_START_REQUESTS]
    first_ttft = [r.first_token - r.arrival for r in first if r.end is not None and r.first_token is not None]
    cold_start = {"requests": len(first), "ttft_mean_s": statistics.fmean(first_ttft) if first_ttft else float("nan"),
                  "share": {k: v / len(first)
                            for k, v in sorted(collections.Counter(r.backend for r in first).items())}}
    return {
        "requests": len(records), "completed": len(done), "errors": sum(1 for r in records if r.error),
        "retried": sum(1 for r in records if r.attempts > 1),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else float("nan"), "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "tpot_mean_s": statistics.fmean(tpot) if tpot else float("nan"), "tpot_p99_s": _pct(tpot, 99),
        "e2e_mean_s": statistics.fmean(e2e) if e2e else float("nan"), "e2e_p99_s": _pct(e2e, 99),
        "throughput_tok_s": sum(r.generated for r, _, _ in done) / span, "request_rate": len(done) / span,
        "goodput_req_s": good / span, "slo_attainment": good / len(records),
        "hit_ratio": sum(r.cached_tokens for r, _, _ in done) / prompt if prompt else 0.0,
        "predicted_hit_ratio": sum(r.predicted_cached for r, _, _ in done) / prompt if prompt else 0.0,
        "prefill_imbalance": max(by_backend.values()) / statistics.fmean(by_backend.values()),
        "share": {k: v / len(records) for k, v in sorted(count.items())},
        "cold_start": cold_start,
    }


def scenario_phases(records: list[Record], scenario: Scenario) -> dict[str, dict[str, float]]:
    """Requests arriving before, during and after the scenario's window: how many, the
    scenario backend's share of them, and their mean TTFT (completed ones)."""
    out: dict[str, dict[str, float]] = {}
    for phase in ("before", "during", "after"):
        rs = [r for r in records if (r.arrival < scenario.start if phase == "before" else
                                     r.arrival >= scenario.end if phase == "after" else
                                     scenario.start <= r.arrival < scenario.end)]
        ttft = [r.first_token - r.arrival for r in rs if r.end is not None and r.first_token is not None]
        mine = [r.first_token - r.arrival for r in rs
                if r.backend == scenario.backend and r.end is not None and r.first_token is not None]
        out[phase] = {"requests": len(rs),
                      "share": sum(1 for r in rs if r.backend == scenario.backend) / len(rs) if rs else float("nan"),
                      "ttft_mean_s": statistics.fmean(ttft) if ttft else float("nan"),
                      "backend_ttft_mean_s": statistics.fmean(mine) if mine else float("nan")}
    return out


def format_phase_table(rows: list[tuple[str, dict]], scenario: Scenario) -> str:
    """Per policy, the scenario backend's share and TTFT before, during, after the window."""
    b = scenario.backend

    def num(v: float, fmt: str) -> str:
        return "-" if math.isnan(v) else format(v, fmt)

    head = ["policy", *(f"{b} share {p} %" for p in ("before", "during", "after")),
            *(f"TTFT {p} s (all / {b})" for p in ("before", "during", "after"))]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for policy, s in rows:
        ph = s["phases"]
        phases = [ph[p] for p in ("before", "during", "after")]
        cells = [policy, *(num(x["share"] * 100, ".1f") for x in phases),
                 *(f"{num(x['ttft_mean_s'], '.3f')} / {num(x['backend_ttft_mean_s'], '.3f')}" for x in phases)]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


CEILING = "ceiling"  # the job that computes ceiling_hit_ratio (not a policy)


def _job(args: tuple) -> tuple[str, str, dict, float]:
    trace, policy, n, scale, fleet_names, ttft_slo, tpot_slo, seed, scen, engine_metrics = args
    reqs = scale_time(load_trace(trace, n), scale)
    fleet = make_fleet(fleet_names)
    t0 = time.process_time()
    if policy == CEILING:
        bs = fleet[0].profile.block_size
        pooled = sum(m.profile.num_gpu_blocks * m.profile.block_size for m in fleet) // bs
        return trace, policy, {"hit_ratio": ceiling_hit_ratio(reqs, bs), "pooled_blocks": pooled,
                               "pooled_hit_ratio": ceiling_hit_ratio(reqs, bs, pooled)}, time.process_time() - t0
    scenario = make_scenario(scen[0], reqs, fleet, backend=scen[1], at=scen[2], duration_s=scen[3],
                             slowdown=scen[4]) if scen else None
    recs = replay(reqs, policy, fleet, seed=seed, scenario=scenario, engine_metrics=engine_metrics)
    cold_from = scenario.start if scenario is not None and scenario.kind == "gateway_restart" else -math.inf
    summary = summarize(recs, ttft_slo, tpot_slo, cold_from)
    if scenario is not None:
        summary["phases"] = scenario_phases(recs, scenario)
    return trace, policy, summary, time.process_time() - t0


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


def format_cache_table(rows: list[tuple[str, dict]], backends: list[str], ceiling: float | None,
                       pooled: tuple[int, float] | None = None) -> str:
    """Per policy: TTFT mean/p50/p99, goodput, each backend's share of the requests,
    failed and retried requests, hit ratio, and the hit ratio as a fraction of the
    oracle row's and of the ceiling's; then the ceiling row, and ``pooled`` = (tokens,
    hit ratio) of one LRU cache as large as the fleet's KV together."""
    oracle = dict(rows).get(ORACLE)
    head = ["policy", "TTFT mean s", "TTFT p50 s", "TTFT p99 s", "goodput req/s",
            *(f"{b} %" for b in backends), "failed", "retried", "hit %", "hit / oracle", "hit / ceiling"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def frac(v: float, of: float | None) -> str:
        return f"{v / of:.2f}" if of else "-"

    for policy, s in rows:
        share = s.get("share", {})
        cells = [policy, f"{s['ttft_mean_s']:.3f}", f"{s['ttft_p50_s']:.3f}", f"{s['ttft_p99_s']:.2f}",
                 f"{s['goodput_req_s']:.2f}", *(f"{share.get(b, 0.0) * 100:.1f}" for b in backends),
                 str(s["errors"]), str(s["retried"]), f"{s['hit_ratio'] * 100:.1f}",
                 frac(s["hit_ratio"], oracle["hit_ratio"] if oracle else None), frac(s["hit_ratio"], ceiling)]
        out.append("| " + " | ".join(cells) + " |")
    if pooled is not None:
        tokens, ratio = pooled
        cells = [f"pooled KV (1 backend, {tokens / 1e6:.2f}M tokens, LRU)"] + ["-"] * (len(head) - 4) + \
                [f"{ratio * 100:.1f}", frac(ratio, oracle["hit_ratio"] if oracle else None), frac(ratio, ceiling)]
        out.append("| " + " | ".join(cells) + " |")
    if ceiling is not None:
        cells = ["ceiling (1 backend, infinite KV)"] + ["-"] * (len(head) - 4) + \
                [f"{ceiling * 100:.1f}", frac(ceiling, oracle["hit_ratio"] if oracle else None), "1.00"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def format_cold_start_table(rows: list[tuple[str, dict]], backends: list[str]) -> str:
    """Per policy, each backend's share of the first requests and their mean TTFT."""
    head = ["policy", *(f"{b} %" for b in backends), "TTFT mean s"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for policy, s in rows:
        c = s["cold_start"]
        out.append("| " + " | ".join([policy, *(f"{c['share'].get(b, 0.0) * 100:.0f}" for b in backends),
                                      f"{c['ttft_mean_s']:.3f}"]) + " |")
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
    ap.add_argument("--policy", action="append", choices=list(REPLAY_POLICIES),
                    help=f"repeatable; default: {', '.join(BENCH_POLICIES)} ('{ORACLE}': estimated_ttft told "
                         "the engines' true cache contents, replay only)")
    ap.add_argument("--requests", type=int, help="first N requests of the trace")
    ap.add_argument("--time-scale", type=float, help="multiply inter-arrival times (<1: more load)")
    ap.add_argument("--fleet", default=",".join(DEFAULT_FLEET), help="comma-separated profile names")
    ap.add_argument("--ttft-slo", type=float, default=2.0, help="TTFT SLO for goodput, seconds")
    ap.add_argument("--tpot-slo", type=float, default=0.1, help="TPOT SLO for goodput, seconds")
    ap.add_argument("--scenario", choices=SCENARIOS, default="none",
                    help="restart: one backend restarts (cache lost, down --scenario-duration s, default "
                         f"{RESTART_DOWN_S:g}); slow: one backend runs --slowdown times slower for "
                         f"--scenario-duration s (default {SLOW_WINDOW_S:g}); gateway_restart: the gateway "
                         f"restarts cold, engines warm (its first {COLD_START_REQUESTS} requests are reported)")
    ap.add_argument("--scenario-backend", help="the backend it happens to (default: the first, b0-...)")
    ap.add_argument("--scenario-at", type=float, default=0.5,
                    help="when it starts, as a fraction of the trace's arrival span (default 0.5: the midpoint)")
    ap.add_argument("--scenario-duration", type=float, help="virtual seconds down (restart) or slow (slow)")
    ap.add_argument("--slowdown", type=float, default=SLOWDOWN, help="slow: speed divisor (default 10)")
    ap.add_argument("--no-ceiling", action="store_true", help="skip the ceiling and pooled-KV rows")
    ap.add_argument("--no-engine-metrics", action="store_true",
                    help="the routers do not read the engines' prefill counters (what they are worth)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", help="write the summaries here")
    args = ap.parse_args(argv)
    traces = list(BENCH) if args.all or not args.trace else args.trace
    policies = args.policy or list(BENCH_POLICIES)
    fleet_names = tuple(args.fleet.split(","))
    fleet = make_fleet(fleet_names)
    backends = [m.name for m in fleet]
    if args.scenario_backend and args.scenario_backend not in backends:
        ap.error(f"--scenario-backend: the fleet has {', '.join(backends)}")
    scen = None if args.scenario == "none" else \
        (args.scenario, args.scenario_backend, args.scenario_at, args.scenario_duration, args.slowdown)
    jobs = []
    for tr in traces:
        n, scale = BENCH.get(tr, (1000, 1.0))
        n = args.requests or n
        scale = args.time_scale or scale
        if "round_robin" in policies:
            jobs.append((tr, "unloaded", n, scale))
        if not args.no_ceiling:
            jobs.append((tr, CEILING, n, scale))
        for p in policies:
            jobs.append((tr, p, n, scale))
    work: list[tuple] = []
    for tr, p, n, scale in jobs:
        if p == "unloaded":  # round robin at 1/20 of the load, no scenario: the unloaded reference
            work.append((tr, "round_robin", n // 4, scale * 20, fleet_names, args.ttft_slo, args.tpot_slo, args.seed,
                         None, not args.no_engine_metrics))
        else:
            work.append((tr, p, n, scale, fleet_names, args.ttft_slo, args.tpot_slo, args.seed, scen,
                         not args.no_engine_metrics))
    t0 = time.monotonic()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(_job, work))
    out: dict[str, dict] = {}
    for (tr, label, n, scale), (_, _, summary, cpu) in zip(jobs, results):
        block = out.setdefault(tr, {"requests": n, "time_scale": scale, "fleet": list(fleet_names),
                                    "scenario": None, "policies": {}})
        if label == CEILING:
            block["ceiling_hit_ratio"] = summary["hit_ratio"]
            block["pooled_kv_tokens"] = summary["pooled_blocks"] * fleet[0].profile.block_size
            block["pooled_kv_hit_ratio"] = summary["pooled_hit_ratio"]
        elif label == "unloaded":
            block["unloaded_round_robin"] = {**summary, "cpu_s": cpu}
        else:
            block["policies"][label] = {**summary, "cpu_s": cpu}
    for tr, block in out.items():
        pol = block["policies"]
        unloaded = block.get("unloaded_round_robin")
        rr = pol.get("round_robin")
        print(f"\n### {tr}: first {block['requests']} requests, inter-arrival x{block['time_scale']}, "
              f"fleet {', '.join(fleet_names)}; SLO TTFT <= {args.ttft_slo} s, TPOT <= {args.tpot_slo * 1000:.0f} ms")
        if scen:
            reqs = scale_time(load_trace(tr, block["requests"]), block["time_scale"])
            scenario = make_scenario(scen[0], reqs, fleet, backend=scen[1], at=scen[2], duration_s=scen[3],
                                     slowdown=scen[4])
            assert scenario is not None  # scen names one
            block["scenario"] = dataclasses.asdict(scenario)
            print(f"scenario {scenario.kind}: {scenario.describe()}")
        if rr and unloaded:
            print(f"round robin mean TTFT {rr['ttft_mean_s']:.3f} s vs unloaded {unloaded['ttft_mean_s']:.3f} s "
                  f"(x{rr['ttft_mean_s'] / unloaded['ttft_mean_s']:.1f})")
        print()
        print(format_table(list(pol.items())))
        print()
        pooled = (block["pooled_kv_tokens"], block["pooled_kv_hit_ratio"]) if "pooled_kv_tokens" in block else None
        print(format_cache_table(list(pol.items()), backends, block.get("ceiling_hit_ratio"), pooled))
        cold = "after the gateway restart" if scen and scen[0] == "gateway_restart" else "of the run"
        print(f"\nthe first {COLD_START_REQUESTS} requests {cold} (cold start), share per backend and mean TTFT:\n")
        print(format_cold_start_table(list(pol.items()), backends))
        if scen and scenario is not None:
            print(f"\nrequests by arrival before / during / after the {scenario.kind} window:\n")
            print(format_phase_table(list(pol.items()), scenario))
        print("\ncpu s per row: " + ", ".join(f"{p} {s['cpu_s']:.1f}" for p, s in pol.items()))
    print(f"\n(wall {time.monotonic() - t0:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
