"""What ``auth.cache_isolation: per_key`` costs in prefix-cache hits and TTFT.

    python -m loadtest.isolation_cost [--keys 1,4,16,64] [--requests 1500] [--rate 6]

The many-tenant shared-prefix workload of :func:`loadtest.traces.shared_prefix_trace`
(``--apps`` system prompts of 6k tokens, each request one of them plus a 1.2k-token
question of its own), with every request sent by one of ``K`` client keys drawn
uniformly: an application platform whose system prompts are used by many customers'
keys, the case where keys share prefixes. Replayed (:func:`loadtest.replay.replay`,
virtual time, the 4-engine simulated fleet, ``estimated_ttft``) twice per ``K``:
``shared``, the trace as it is, and ``per_key``, each key's blocks made its own (what a
per-key seed and ``cache_salt`` do: the same text under two keys hashes apart, in the
router's prefix index and in the engines' caches). Prints the prefix hit ratio and
TTFT of both; the difference is the price of isolation. With one key it is nothing;
with as many keys as requests per system prompt it is every cross-key hit.
"""

from __future__ import annotations

import argparse
import random
from concurrent.futures import ProcessPoolExecutor

from loadtest.replay import make_fleet, replay, summarize
from loadtest.traces import TraceRequest, shared_prefix_trace

ENGINE_IDS = 1 << 22  # the simulated engine tells block ids apart modulo this (loadtest.traces)


def per_key(reqs: list[TraceRequest], keys: int, seed: int = 0) -> tuple[list[TraceRequest], list[TraceRequest]]:
    """The requests each sent by one of ``keys`` keys drawn uniformly (seeded): as they
    are (``shared``) and with each key's block ids made its own (``per_key``)."""
    rng = random.Random(seed)
    stride = 1 + max(h for r in reqs for h in r.hash_ids or (0,))  # key k's blocks: id + k * stride
    if keys * stride >= ENGINE_IDS:
        raise ValueError(f"{keys} keys of {stride} block ids do not fit the engine's {ENGINE_IDS} distinct ids")
    shared, isolated = [], []
    for r in reqs:
        k = rng.randrange(keys)
        ids = r.hash_ids or []
        shared.append(TraceRequest(r.arrival_s, r.input_tokens, r.output_tokens, list(ids)))
        isolated.append(TraceRequest(r.arrival_s, r.input_tokens, r.output_tokens, [h + k * stride for h in ids]))
    return shared, isolated


def _run(job: tuple) -> tuple[int, str, dict]:
    keys, mode, reqs, policy = job
    s = summarize(replay(reqs, policy, make_fleet()), 2.0, 0.1)
    return keys, mode, {k: s[k] for k in ("hit_ratio", "ttft_mean_s", "ttft_p99_s", "slo_attainment")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.isolation_cost", description=__doc__.split("\n")[0])
    ap.add_argument("--keys", default="1,4,16,64", help="comma-separated numbers of client keys")
    ap.add_argument("--apps", type=int, default=16, help="distinct system prompts")
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--rate", type=float, default=6.0, help="requests per second")
    ap.add_argument("--policy", default="estimated_ttft")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    base = shared_prefix_trace(args.apps, args.requests, rate=args.rate, seed=args.seed)
    jobs = []
    for k in (int(x) for x in args.keys.split(",")):
        shared, isolated = per_key(base, k, args.seed)
        jobs += [(k, "shared", shared, args.policy), (k, "per_key", isolated, args.policy)]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(_run, jobs))
    print(f"{args.requests} requests, {args.apps} system prompts of 6k tokens, {args.rate:g} req/s, "
          f"{args.policy}, 4 simulated engines")
    print("| keys | isolation | hit % | TTFT mean s | TTFT p99 s | SLO % |")
    print("|---|---|---|---|---|---|")
    for k, mode, s in rows:
        print(f"| {k} | {mode} | {100 * s['hit_ratio']:.1f} | {s['ttft_mean_s']:.3f} | {s['ttft_p99_s']:.2f} | "
              f"{100 * s['slo_attainment']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
