"""What the precise prefix path costs the router alone, in CPU and in instructions.

    python -m loadtest.precise_cost                                  # shared_prefix at 6 req/s
    python -m loadtest.precise_cost --workload mooncake_conversation --against ../old-checkout
    python -m loadtest.precise_cost --callgrind --against ../old-checkout   # needs valgrind

Runs the precise replay of :mod:`loadtest.precise_bench` once (seed 0, speculative
entries on) and keeps what its router was handed, in order
(:func:`loadtest.replay.replay`'s ``router_inputs``): every KV-event payload and every
request routed. Then applies them to a fresh :class:`routing.core.DecisionCore` of
this checkout (and of ``--against``, another checkout, side by side): first the KV
events alone, then everything (each request estimated, keyed, routed and its
reservation released at once, so that the decisions depend on the code only). Prints
per request of the workload:

- the process CPU of the KV events (decode + index) and of the routing (estimate,
  token keys, lookup, route, speculative record), best of ``--repeat`` passes;
- with ``--callgrind``, the instructions valgrind counts in a process that applies
  them, minus one that only loads them: they do not move with the machine's load
  (the CPU figures on a shared machine move by 2x between runs);
- a digest of the decisions (backend, matched tokens, evidence) and the index's
  final (precise, speculative) counts, equal for two checkouts that route the same.

Each checkout is applied in a child process (``python`` running this file with the
checkout first on ``sys.path``), so ``--against`` may be any version of the gateway
whose replay has ``make_policy_seeded``. Every loop is bounded by the workload.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def capture(workload: str, rate: float, path: str, requests: int | None = None) -> int:
    """Record the router's inputs of one precise replay of ``workload`` (its first
    ``requests``, or as many as :mod:`loadtest.precise_bench` replays) into ``path``
    (pickle); returns the number of requests."""
    from loadtest.precise_bench import build_parser, make_workload
    from loadtest.replay import DEFAULT_FLEET, PRECISE, make_fleet, replay

    bench_args = build_parser().parse_args([])
    if requests is not None:
        bench_args.shared_requests = bench_args.conversation_requests = requests
    reqs = make_workload(workload, bench_args, rate)
    fleet = make_fleet(tuple(DEFAULT_FLEET))
    inputs: list[tuple] = []
    replay(reqs, "estimated_ttft", fleet, seed=0, evidence=PRECISE, speculative_s=5.0, router_inputs=inputs)
    specs = [(m.name, m.profile.kv_capacity_tokens, m.profile.block_size) for m in fleet]
    with open(path, "wb") as f:
        pickle.dump({"specs": specs, "inputs": inputs, "requests": len(reqs)}, f)
    return len(reqs)


def apply(path: str, part: str, repeat: int) -> dict:
    """Apply the recorded inputs to a fresh core: ``part`` ``load`` (nothing),
    ``kv`` (the KV events only) or ``all``. Returns CPU us per request (best pass),
    the decisions' digest and the final counts."""
    import random
    import time

    from loadtest.replay import make_policy_seeded
    from routing.core import BackendSpec, DecisionCore, RouteRequest

    with open(path, "rb") as f:
        log = pickle.load(f)
    n = log["requests"]
    best = {"kv_us": float("inf"), "route_us": float("inf")}
    digest, counts = 0, {}
    for _ in range(repeat if part != "load" else 0):
        specs = [BackendSpec(name, frozenset({"m"}), kv_capacity_tokens=cap, kv_block_size=bs, kv_base_model="m")
                 for name, cap, bs in log["specs"]]
        core = DecisionCore(specs, "estimated_ttft", speculative_s=5.0)
        core.router.policy = make_policy_seeded("estimated_ttft", random.Random(0))
        est = core.estimator
        clock = time.process_time
        kv_s = route_s = 0.0
        digest = 0
        for op in log["inputs"]:
            if op[0] == "kv":
                c0 = clock()
                core.kv_event_batch(op[1], 0, op[2])
                kv_s += clock() - c0
            elif part == "all":
                _, text, tokens, output_tokens, exclude, now = op
                c0 = clock()
                e = est.estimate("m", text, output_tokens, None, tokens)
                req = RouteRequest("m", exclude=frozenset(exclude), prompt_text=text, prompt_bytes=e.size_bytes,
                                   block_hashes=e.hashes, prompt_tokens=e.prompt_tokens,
                                   output_tokens=e.output_tokens,
                                   tokens_per_block=est.block_bytes / est.stats("m").bytes_per_token,
                                   token_ids=tokens, token_keys=core.token_keys("m", tokens))
                d, res = core.route(req, now)
                res.release(now)
                route_s += clock() - c0
                digest = zlib.crc32(repr((d.backend.name, d.detail.get("matched_tokens"), d.evidence)).encode(), digest)
        best["kv_us"] = min(best["kv_us"], kv_s / n * 1e6)
        best["route_us"] = min(best["route_us"], route_s / n * 1e6)
        counts = {name: core.index.counts(name) for name, _, _ in log["specs"]}
    return {**best, "digest": f"{digest:08x}", "counts": counts, "requests": n}


def _child(checkout: Path, path: str, part: str, repeat: int, callgrind: bool) -> tuple[dict, int | None]:
    """Apply in a child process with ``checkout`` first on its path (``-P``: not this
    file's directory); (result, instructions counted by callgrind or None)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(checkout), str(HERE)]))
    cmd = [sys.executable, "-P", str(Path(__file__).resolve()), "--apply", path, "--part", part,
           "--repeat", str(repeat)]
    if callgrind:
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={path}.callgrind"] + cmd
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=7200, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"applying in {checkout} failed:\n{p.stderr[-2000:]}")
    result = json.loads(p.stdout.strip().splitlines()[-1])
    instr = None
    if callgrind:
        m = re.search(r"Collected : (\d+)", p.stderr)
        instr = int(m.group(1)) if m else None
    return result, instr


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.precise_cost", description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=["shared_prefix", "mooncake_conversation"], default="shared_prefix")
    ap.add_argument("--rate", type=float, default=6.0, help="shared_prefix arrivals, req/s")
    ap.add_argument("--requests", type=int, help="the workload's first N requests (default: precise_bench's)")
    ap.add_argument("--against", type=Path, help="another checkout of the gateway, measured side by side")
    ap.add_argument("--repeat", type=int, default=3, help="passes; the best counts (CPU only)")
    ap.add_argument("--callgrind", action="store_true", help="also count instructions under valgrind (slow)")
    ap.add_argument("--apply", help=argparse.SUPPRESS)
    ap.add_argument("--part", choices=["load", "kv", "all"], default="all", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.apply:
        print(json.dumps(apply(args.apply, args.part, args.repeat)))
        return 0
    if args.callgrind and shutil.which("valgrind") is None:
        ap.error("--callgrind needs valgrind (Debian: apt-get install valgrind)")
    checkouts = [("this checkout", HERE)] + ([(str(args.against), args.against.resolve())] if args.against else [])
    with tempfile.TemporaryDirectory(prefix="precise-cost-") as tmp:
        path = str(Path(tmp) / "inputs.pickle")
        n = capture(args.workload, args.rate, path, args.requests)
        rows = []
        for label, checkout in checkouts:
            r, _ = _child(checkout, path, "all", args.repeat, False)
            row = {"label": label, **r}
            if args.callgrind:
                instr = {part: _child(checkout, path, part, 1, True)[1] for part in ("load", "kv", "all")}
                load, kv, whole = instr["load"], instr["kv"], instr["all"]
                if load is not None and kv is not None and whole is not None:
                    row["kv_instr"] = (kv - load) / n
                    row["route_instr"] = (whole - kv) / n
            rows.append(row)
    title = args.workload + (f" at {args.rate:g} req/s" if args.workload == "shared_prefix" else "")
    print(f"\n## The router alone on the precise replay of {title} ({n} requests), per request\n")
    head = ["checkout", "KV events CPU us", "routing CPU us"]
    if args.callgrind:
        head += ["KV events instructions (M)", "routing instructions (M)"]
    head += ["decisions digest", "final (precise, speculative) blocks per backend"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [r["label"], f"{r['kv_us']:.0f}", f"{r['route_us']:.0f}"]
        if args.callgrind:
            cells += [f"{r.get('kv_instr', float('nan')) / 1e6:.2f}", f"{r.get('route_instr', float('nan')) / 1e6:.2f}"]
        cells += [r["digest"], ", ".join(f"{k} {tuple(v)}" for k, v in r["counts"].items())]
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
