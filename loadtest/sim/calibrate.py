"""Emulator side of the calibration table (docs/results/calibration.md), in virtual time.

    python -m loadtest.sim.calibrate                  # all Llama-3-8B profiles, C = 1, 8, 64
    python -m loadtest.sim.calibrate --profile a100-llama3-8b --concurrency 1 2 4 8 16 32 64

Replays what ``vllm bench serve --dataset-name random --random-input-len 1024
--random-output-len 128 --ignore-eos --max-concurrency C --num-prompts 20*C
--request-rate inf`` does against one engine: C closed-loop clients, each sending its
next request when the previous one finishes; every prompt is distinct random tokens
(no prefix-cache hits). Runs :class:`loadtest.sim.engine.Engine` directly in virtual
time (no sockets, no sleeping), so it takes well under a second per row and the numbers
are exactly the model's. Reports mean TTFT, mean TPOT (per request, excluding the first
token, as vllm bench does), mean ITL and output throughput.
"""

from __future__ import annotations

import argparse
import random
import sys

from loadtest.sim.engine import Engine
from loadtest.sim.profiles import PROFILES, get_profile

DEFAULT_PROFILES = ("a100-llama3-8b", "h100-llama3-8b", "a10g-llama3-8b", "h100-llama3-8b-prefill",
                    "h200-llama3-8b-decode")


def bench(profile_name: str, concurrency: int, input_len: int = 1024, output_len: int = 128,
          num_prompts: int | None = None, seed: int = 0) -> dict:
    """One closed-loop run in virtual time; returns mean TTFT/TPOT/ITL (s) and tok/s."""
    eng = Engine(get_profile(profile_name))
    rng = random.Random(seed)
    n_total = num_prompts or 20 * concurrency
    sent = 0
    now = 0.0

    def send(t: float) -> None:
        nonlocal sent
        ids = [rng.randrange(256, 128_000) for _ in range(input_len)]
        eng.add_request(f"r{sent}", ids, output_len, arrival_time=t)
        sent += 1

    for _ in range(min(concurrency, n_total)):
        send(0.0)
    while eng.has_work():
        dt, outs = eng.step(now)
        if dt == 0 and not outs:
            break
        now += dt
        for o in outs:
            if o.finished and sent < n_total:
                send(now)
    s = eng.pop_samples()
    tpots = [d / (n - 1) for d, n in zip(s["decode_s"], s["generation_tokens"]) if n > 1]
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    return {"profile": profile_name, "concurrency": concurrency, "ttft_s": mean(s["ttft_s"]),
            "tpot_s": mean(tpots), "itl_s": mean(s["itl_s"]),
            "output_tok_per_s": sum(s["generation_tokens"]) / now if now else 0.0,
            "requests": len(s["e2e_s"]), "preemptions": eng.num_preemptions}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.sim.calibrate", description=__doc__.split("\n")[0])
    ap.add_argument("--profile", nargs="*", default=list(DEFAULT_PROFILES), choices=sorted(PROFILES))
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 8, 64])
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args(argv)
    print(f"virtual-time closed loop, {args.input_len} in / {args.output_len} out, ignore_eos, 20*C prompts")
    print("| profile | C | mean TTFT (ms) | mean TPOT (ms) | mean ITL (ms) | output tok/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for p in args.profile:
        for c in args.concurrency:
            r = bench(p, c, args.input_len, args.output_len)
            print(f"| {p} | {c} | {r['ttft_s'] * 1e3:.1f} | {r['tpot_s'] * 1e3:.2f} | {r['itl_s'] * 1e3:.2f} "
                  f"| {r['output_tok_per_s']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
