"""The load generator: arrivals, concurrency, bounds, progress, and gateway sampling.

* **Open loop** (``rate`` given, or a trace workload with its own arrival times):
  sessions start at arrival times drawn from a gamma process with mean rate ``rate``
  (req/s per target) and shape ``burstiness`` (1 = Poisson; < 1 burstier, > 1 more
  regular), as vLLM's ``--request-rate`` / ``--burstiness``; ``rate=inf`` sends
  everything at once. ``concurrency`` then caps the requests in flight (vLLM's
  ``--max-concurrency``): a request waits for a slot, and TTFT is measured from its
  actual send.
* **Closed loop** (only ``concurrency``): that many workers per target, each sending
  its next session as soon as the previous one finished.
* **Several targets** (``compare``): ``interleave="request"`` runs them in the same
  time window, arrival ``i`` going to target ``i mod k`` (each target is offered
  ``rate``); ``interleave="batch"`` alternates batches of ``batch_size`` sessions,
  one target at a time.
* **Bounds**: ``num_requests`` turns per target and/or ``duration_s`` of sending; no
  request starts after the sending window; each request is bounded by the client's
  ``timeout_s``, and whatever is still in flight ``timeout_s`` after the window closes
  is cancelled (error ``cancelled``).
* **Gateway sampling**: when a target's ``/metrics`` has ``turbo_gateway_*`` samples,
  its per-backend gauges (``turbo_gateway_backend_in_flight`` and friends) are read
  every ``sample_interval_s`` during the run (plus once before and once after).
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import aiohttp

from loadtest import client
from loadtest.client import ClientOptions
from loadtest.metrics import RequestRecord
from loadtest.workloads import Session, Workload

DEFAULT_NUM_REQUESTS = 200
UNBOUNDED = 10 ** 9


@dataclass(slots=True)
class Target:
    """One endpoint under test: ``url`` is the base URL (without ``/v1``)."""

    label: str
    url: str


@dataclass(slots=True)
class LoadSpec:
    """Offered load: ``rate`` (req/s per target, ``inf`` = all at once) with gamma
    ``burstiness``, and/or ``concurrency`` (in-flight cap per target); bounds
    ``num_requests`` (turns per target) and ``duration_s`` (sending window, seconds)."""

    rate: float | None = None
    burstiness: float = 1.0
    concurrency: int | None = None
    num_requests: int | None = None
    duration_s: float | None = None

    def validate(self) -> None:
        if self.rate is not None and not self.rate > 0:
            raise ValueError("rate must be > 0 (inf for all at once)")
        if not self.burstiness > 0:
            raise ValueError("burstiness must be > 0")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError("duration must be > 0")

    def request_cap(self) -> int:
        """Turns per target this run may send at most."""
        if self.num_requests:
            return self.num_requests
        if self.duration_s is None:
            return DEFAULT_NUM_REQUESTS
        if self.rate is not None and math.isfinite(self.rate):
            return int(self.rate * self.duration_s * 2) + 16
        return UNBOUNDED  # closed loop or a trace, bounded by time; sessions are generated lazily

    def label(self) -> str:
        parts = []
        if self.rate is not None:
            parts.append(f"rate={self.rate:g}")
        if self.concurrency is not None:
            parts.append(f"concurrency={self.concurrency}")
        return ", ".join(parts) or "the trace's arrivals"

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if d["rate"] is not None and math.isinf(d["rate"]):
            d["rate"] = "inf"
        return d


@dataclass
class LaneResult:
    """One target's share of a run: its records (by index), the gateway's per-backend
    gauges over time (``[{"t_s", "backends": {name: {gauge: value}}}]``) and what its
    ``/metrics`` says about it (``None`` when it is not a turbo-gateway)."""

    target: Target
    workload: dict[str, Any]
    records: list[RequestRecord] = field(default_factory=list)
    backend_samples: list[dict[str, Any]] = field(default_factory=list)
    gateway: dict[str, Any] | None = None
    active_s: float = 0.0  # seconds this target's phases ran (batch interleaving: its share of the run)


@dataclass
class RunResult:
    """One run (one offered load) over one or more targets."""

    load: LoadSpec
    interleave: str
    lanes: list[LaneResult]
    started_at_unix: float
    wall_s: float


class Progress:
    """A one-line progress bar on ``stream`` (stderr): done/total, rate, errors,
    elapsed. Redraws at most 5 times a second on a terminal; elsewhere prints a line
    every 10%."""

    def __init__(self, total: int | None, duration_s: float | None, stream: TextIO | None = None,
                 enabled: bool = True) -> None:
        self.total = total if total and total < UNBOUNDED else None
        self.duration_s = duration_s
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and getattr(self.stream, "isatty", lambda: False)()
        self.done = self.errors = 0
        self.t0 = time.perf_counter()
        self._last_draw = 0.0
        self._last_decile = -1

    def update(self, rec: RequestRecord) -> None:
        self.done += 1
        self.errors += 0 if rec.ok else 1
        if not self.enabled:
            return
        now = time.perf_counter()
        frac = self._fraction(now)
        if self.tty:
            if now - self._last_draw >= 0.2:
                self._draw(now, frac)
        elif int(frac * 10) > self._last_decile:
            self._last_decile = int(frac * 10)
            self.stream.write(self._line(now, frac) + "\n")
            self.stream.flush()

    def _fraction(self, now: float) -> float:
        fr = []
        if self.total:
            fr.append(self.done / self.total)
        if self.duration_s:
            fr.append((now - self.t0) / self.duration_s)
        return min(1.0, max(fr)) if fr else 0.0

    def _line(self, now: float, frac: float) -> str:
        el = now - self.t0
        width = 24
        bar = "#" * int(frac * width) + "." * (width - int(frac * width))
        count = f"{self.done}/{self.total}" if self.total else f"{self.done}"
        return (f"[{bar}] {count} requests  {self.done / el if el > 0 else 0:.1f} req/s  "
                f"errors {self.errors}  {el:.0f}s")

    def _draw(self, now: float, frac: float) -> None:
        self._last_draw = now
        self.stream.write("\r" + self._line(now, frac))
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self._draw(time.perf_counter(), self._fraction(time.perf_counter()))
            self.stream.write("\n")
            self.stream.flush()


class _Run:
    def __init__(self, http: aiohttp.ClientSession, lanes: list[LaneResult], workloads: list[Workload],
                 load: LoadSpec, opts: ClientOptions, seed: int, progress: Progress) -> None:
        self.http, self.lanes, self.workloads, self.load, self.opts = http, lanes, workloads, load, opts
        self.rng = random.Random(seed)
        self.progress = progress
        cap = load.request_cap()
        self.sessions = [iter(wl.sessions(cap)) for wl in workloads]
        self.next_index = [0] * len(lanes)
        self.next_session = [0] * len(lanes)
        self.exhausted = [False] * len(lanes)
        self.slots = [asyncio.Semaphore(load.concurrency) for _ in lanes] if load.concurrency else None
        self.t0 = time.perf_counter()
        self.send_deadline = self.t0 + load.duration_s if load.duration_s else math.inf
        self.tasks: set[asyncio.Task] = set()

    def open_loop(self) -> bool:
        return self.load.rate is not None or any(w.has_arrivals for w in self.workloads)

    def take(self, lane: int) -> tuple[int, Session] | None:
        if self.exhausted[lane]:
            return None
        s = next(self.sessions[lane], None)
        if s is None:
            self.exhausted[lane] = True
            return None
        self.next_session[lane] += 1
        return self.next_session[lane] - 1, s

    async def session(self, lane: int, sid: int, s: Session, scheduled_s: float | None) -> None:
        history: list[str] = []
        previous_id: str | None = None
        keep_text = len(s.turns) > 1
        for turn in range(len(s.turns)):
            if turn > 0 and time.perf_counter() > self.send_deadline:
                return
            t = s.turns[turn]
            rec = RequestRecord(index=self.next_index[lane], target=self.lanes[lane].target.label, group=s.group,
                                session=sid, turn=turn, scheduled_s=scheduled_s if turn == 0 else None,
                                input_tokens_expected=t.input_tokens, max_tokens=t.output_tokens)
            self.next_index[lane] += 1
            body = client.build_body(self.opts, s, turn, history, previous_id)
            try:
                if self.slots:
                    async with self.slots[lane]:
                        await client.send(self.http, self.lanes[lane].target.url, self.opts, body, rec, self.t0,
                                          keep_text)
                else:
                    await client.send(self.http, self.lanes[lane].target.url, self.opts, body, rec, self.t0, keep_text)
            except asyncio.CancelledError:
                if rec.error is None:
                    rec.error = "cancelled"
                    rec.start_s = rec.start_s or time.perf_counter() - self.t0
                raise
            finally:
                history.append(rec.output_text or "")
                previous_id, rec.output_text, rec.response_id = rec.response_id, None, None
                self.lanes[lane].records.append(rec)
                self.progress.update(rec)
            if not rec.ok:
                return
            if s.think_time_s and turn + 1 < len(s.turns):
                await asyncio.sleep(s.think_time_s)

    def spawn(self, lane: int, sid: int, s: Session, scheduled_s: float | None) -> None:
        task = asyncio.create_task(self.session(lane, sid, s, scheduled_s))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def phase(self, lanes: list[int], limit: int | None) -> None:
        """Send sessions of ``lanes`` (at most ``limit`` per lane) until they run out
        or the sending window closes; then wait for them (bounded)."""
        sent = dict.fromkeys(lanes, 0)

        def can_send(lane: int) -> bool:
            return limit is None or sent[lane] < limit

        start = time.perf_counter()
        if self.open_loop():
            active = [lane for lane in lanes if not self.exhausted[lane]]
            base: dict[int, float] = {}
            offset = 0.0
            i = 0
            while active:
                lane = active[i % len(active)]
                item = self.take(lane) if can_send(lane) else None
                if item is None:
                    active.remove(lane)
                    continue
                i += 1
                sid, s = item
                sent[lane] += 1
                if s.arrival_s is not None:  # a trace: its own (possibly rescaled) arrival times
                    base.setdefault(lane, s.arrival_s or 0.0)
                    at = (s.arrival_s or 0.0) - base[lane]
                elif math.isinf(self.load.rate or math.inf):
                    at = 0.0
                else:
                    combined = (self.load.rate or 1.0) * len(active)
                    b = self.load.burstiness
                    offset += self.rng.gammavariate(b, 1.0 / (combined * b))
                    at = offset
                when = start + at
                if when > self.send_deadline:
                    break
                delay = when - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                self.spawn(lane, sid, s, when - self.t0)
        else:
            async def worker(lane: int) -> None:
                while (now := time.perf_counter()) < self.send_deadline and can_send(lane):
                    item = self.take(lane)
                    if item is None:
                        return
                    sent[lane] += 1
                    await self.session(lane, item[0], item[1], now - self.t0)

            for lane in lanes:
                for _ in range(self.load.concurrency or 1):
                    self.spawn_worker(worker(lane))
        await self.drain()
        for lane in lanes:
            self.lanes[lane].active_s += time.perf_counter() - start

    def spawn_worker(self, coro) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def drain(self) -> None:
        """Wait for in-flight work; past the sending window, wait at most
        ``timeout_s`` more and cancel the rest."""
        hard = self.send_deadline + self.opts.timeout_s
        while self.tasks:
            remaining = hard - time.perf_counter()
            if remaining <= 0:
                break
            await asyncio.wait(set(self.tasks), timeout=min(remaining, 3600.0))
        if self.tasks:
            pending = set(self.tasks)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)


async def _sampler(http: aiohttp.ClientSession, lane: LaneResult, t0: float, interval_s: float,
                   stop: asyncio.Event) -> None:
    while True:
        await _sample(http, lane, t0)
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
            return
        except TimeoutError:
            continue


async def _sample(http: aiohttp.ClientSession, lane: LaneResult, t0: float) -> None:
    text = await client.fetch_metrics(http, lane.target.url, timeout_s=2.0)
    if text is not None:
        loads = client.backend_load(client.parse_prometheus(text))
        lane.backend_samples.append({"t_s": time.perf_counter() - t0, "backends": loads})


async def run_load(targets: list[Target], workloads: list[Workload], load: LoadSpec, opts: ClientOptions, *,
                   seed: int = 0, interleave: str = "request", batch_size: int = 32, sample_interval_s: float = 1.0,
                   show_progress: bool = True, progress_stream: TextIO | None = None) -> RunResult:
    """Run ``load`` against every target (``workloads[i]`` feeds ``targets[i]``) and
    return the records. See the module docstring for the arrival process and bounds.
    Raises ValueError for an invalid spec."""
    load.validate()
    if len(workloads) != len(targets) or not targets:
        raise ValueError("one workload per target")
    if interleave not in ("request", "batch"):
        raise ValueError("interleave must be 'request' or 'batch'")
    if load.rate is None and load.concurrency is None and not any(w.has_arrivals for w in workloads):
        raise ValueError(f"the workload {workloads[0].name!r} has no arrival times of its own: give --rate or "
                         "--concurrency")
    lanes = [LaneResult(t, w.describe()) for t, w in zip(targets, workloads)]
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    started = time.time()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        for lane in lanes:
            text = await client.fetch_metrics(http, lane.target.url, timeout_s=5.0)
            lane.gateway = client.gateway_info(client.parse_prometheus(text)) if text else None
        total = load.request_cap() * len(lanes)
        progress = Progress(total, load.duration_s, progress_stream, show_progress)
        run = _Run(http, lanes, workloads, load, opts, seed, progress)
        stop = asyncio.Event()
        samplers = [asyncio.create_task(_sampler(http, lane, run.t0, sample_interval_s, stop))
                    for lane in lanes if lane.gateway is not None]
        try:
            if interleave == "request":
                await run.phase(list(range(len(lanes))), None)
            else:
                while not all(run.exhausted) and time.perf_counter() < run.send_deadline:
                    for i in range(len(lanes)):
                        if not run.exhausted[i] and time.perf_counter() < run.send_deadline:
                            await run.phase([i], batch_size)
        finally:
            stop.set()
            await asyncio.gather(*samplers, return_exceptions=True)
            progress.close()
        wall = time.perf_counter() - run.t0
        for lane in lanes:
            lane.records.sort(key=lambda r: r.index)
            if lane.gateway is not None:
                await _sample(http, lane, run.t0)
                text = await client.fetch_metrics(http, lane.target.url, timeout_s=5.0)
                after = client.gateway_info(client.parse_prometheus(text)) if text else None
                if after:
                    lane.gateway.update({k: v for k, v in after.items() if k != "backends"})
                if "policy" not in lane.gateway:
                    pol = next((p for r in lane.records if (p := client.policy_from_route(r.route))), None)
                    if pol:
                        lane.gateway["policy"] = pol
    return RunResult(load, interleave, lanes, started, wall)
