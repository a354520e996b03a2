"""Routing on the other APIs: the same conversations over chat, Responses and Responses
chained by ``previous_response_id``, and embeddings beside chat, through the gateway.

    python -m loadtest.api_bench [--sessions 24] [--turns 4] [--concurrency 6] [--speed 20]

A simulated fleet (four engines: two fast, two slow, ``estimated_ttft``) behind a
gateway, both started anew for each API; the ``multi-turn`` workload (a 512-token system prompt, 4 turns
of 128 tokens in and 128 out per conversation, the same seed for every API) is sent
three times, one API after the other: ``chat`` (each turn carries the whole
conversation), ``responses`` (the same conversation as Responses input items) and
``responses_chained`` (each turn sends only its own input and the previous turn's
``previous_response_id``: the gateway expands it from its store,
:mod:`gateway.pipeline.conversation`). Prints, per API, the prefix-cache hit ratio the
engines reported, TTFT p50 and p99, and how many conversations stayed on one backend:
the same prefix affinity whichever API carries a conversation (each API starts cold:
new engines, a new gateway). Then embeddings of the
same prompts are sent with chat turns in flight, and the table shows the output tokens
the estimate priced (``output_tokens_est`` of ``x-turbo-route``): 0 for embeddings,
whose cost is prefill only, the learned output length for chat.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from collections import defaultdict
from typing import Any

from loadtest import procs
from loadtest.client import ClientOptions
from loadtest.metrics import RequestRecord, summarize
from loadtest.runner import LoadSpec, Target, run_load
from loadtest.workloads import make_workload

MODEL = "bench-model"
APIS = ("chat", "responses", "responses_chained")


def fleet_spec(speed: float) -> list[dict[str, Any]]:
    """Two fast and two slow simulated engines of :data:`MODEL`."""
    return [{"name": f"{kind}-{i}", "models": [MODEL], "profile": profile, "speed": speed, "eos_after": 10**6}
            for kind, profile in (("fast", "h100-llama3-8b"), ("slow", "a10g-llama3-8b")) for i in range(2)]


def gateway_config(urls: dict[str, str]) -> dict[str, Any]:
    return {"routing": {"policy": "estimated_ttft"}, "timeouts": {"ttft_s": 120, "idle_s": 60},
            "backends": [{"name": n, "url": u, "models": [MODEL]} for n, u in urls.items()]}


def route_field(rec: RequestRecord, name: str) -> str | None:
    for part in (rec.route or "").split("; "):
        key, _, value = part.partition("=")
        if key == name:
            return value
    return None


def sticky(records: list[RequestRecord]) -> tuple[int, int]:
    """(conversations all of whose turns one backend served, conversations)."""
    by_session: dict[int, set[str]] = defaultdict(set)
    for r in records:
        if r.ok and r.backend:
            by_session[r.session].add(r.backend)
    return sum(1 for b in by_session.values() if len(b) == 1), len(by_session)


async def conversations(url: str, api: str, sessions: int, turns: int, concurrency: int,
                        seed: int) -> list[RequestRecord]:
    wl = make_workload("multi-turn", {"turns": turns}, seed=seed)
    result = await run_load([Target(api, url)], [wl], LoadSpec(concurrency=concurrency, num_requests=sessions * turns),
                            ClientOptions(model=MODEL, endpoint=api, timeout_s=120.0), seed=seed,
                            show_progress=False)
    return result.lanes[0].records


async def embeddings_beside_chat(url: str, n: int, seed: int) -> tuple[list[RequestRecord], list[RequestRecord]]:
    """``n`` embeddings and ``n`` chat turns of the same prompts, sent together."""
    wl = make_workload("multi-turn", {"turns": 1}, seed=seed)
    load = LoadSpec(concurrency=4, num_requests=n)
    emb, chat = await asyncio.gather(
        run_load([Target("embeddings", url)], [wl], load, ClientOptions(model=MODEL, endpoint="embeddings",
                                                                         stream=False), seed=seed, show_progress=False),
        run_load([Target("chat", url)], [wl], load, ClientOptions(model=MODEL, endpoint="chat"), seed=seed,
                 show_progress=False))
    return emb.lanes[0].records, chat.lanes[0].records


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


async def run(args: argparse.Namespace) -> int:
    sim: subprocess.Popen | None = None
    gw: subprocess.Popen | None = None
    try:
        print("| API | requests | failed | prefix hit ratio | TTFT p50 ms | TTFT p99 ms "
              "| conversations on one backend |")
        print("|---|---|---|---|---|---|---|")
        for api in APIS:  # each from cold: new engines, a new gateway
            for p in (gw, sim):
                if p is not None:
                    procs.stop(p)
            sim, urls = procs.start_sim(fleet_spec(args.speed))
            gw, url, _ = procs.start_gateway(gateway_config(urls))
            recs = await conversations(url, api, args.sessions, args.turns, args.concurrency, args.seed)
            s = summarize(recs, percentiles=(50, 99))
            one, total = sticky(recs)
            hit = s["prefix_cache_hit_ratio"]
            print(f"| {api} | {s['requests']} | {s['failed']} | {'-' if hit is None else f'{hit:.3f}'} | "
                  f"{_ms(s.get('p50_ttft_ms'))} | {_ms(s.get('p99_ttft_ms'))} | {one}/{total} |")
        emb, chat = await embeddings_beside_chat(url, args.sessions, args.seed + 1)
        print()
        print("| API | requests | failed | output tokens priced (x-turbo-route output_tokens_est) | TTFT p50 ms |")
        print("|---|---|---|---|---|")
        for name, recs in (("embeddings", emb), ("chat", chat)):
            s = summarize(recs, percentiles=(50,))
            priced = sorted({v for r in recs if r.ok and (v := route_field(r, "output_tokens_est")) is not None})
            print(f"| {name} | {s['requests']} | {s['failed']} | {', '.join(priced) or '-'} | "
                  f"{_ms(s.get('p50_ttft_ms'))} |")
        return 0
    finally:
        for p in (gw, sim):
            if p is not None:
                procs.stop(p)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.api_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=24, help="conversations per API")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=6, help="requests in flight")
    ap.add_argument("--speed", type=float, default=20.0, help="the simulated engines' speed-up over real time")
    ap.add_argument("--seed", type=int, default=0)
    return asyncio.run(run(ap.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
