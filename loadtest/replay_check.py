"""Does the offline replay agree with the real-time simulated fleet? One small case.

    python -m loadtest.replay_check [--requests 60] [--time-scale 1.5] [--max-input 8192]

Runs the first ``--requests`` rows of the Mooncake conversation trace twice on the same
two-backend fleet (``h100-llama3-8b`` + ``a100-llama3-8b``, ``estimated_ttft``):

1. in real time: ``python -m loadtest.sim`` backends at speed 1, ``python -m gateway``
   in front, ``python -m loadtest run --workload mooncake`` as the client (the trace's
   arrival times times ``--time-scale``);
2. in virtual time: :func:`loadtest.replay.replay` with the same rows and scale.

and prints TTFT, TPOT and end-to-end latency side by side with their ratio. The real
run adds what the replay leaves out (HTTP, the gateway's and the client's own time, the
machine's scheduling); the engine model and the routing code are the same.
Bounded: ``--requests`` rows, 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from loadtest import replay as rp
from loadtest.procs import start_gateway, start_sim, stop

FLEET = ("h100-llama3-8b", "a100-llama3-8b")


def _stats(ttft: list[float], tpot: list[float], e2e: list[float]) -> dict[str, float]:
    return {"TTFT mean s": statistics.fmean(ttft), "TTFT p50 s": statistics.median(ttft),
            "TPOT mean ms": statistics.fmean(tpot) * 1000, "e2e mean s": statistics.fmean(e2e)}


def offline(n: int, scale: float, max_input: int) -> dict[str, float]:
    reqs = rp.scale_time(rp.load_trace("mooncake_conversation", n, max_input_tokens=max_input), scale)
    fleet = [dataclasses.replace(m, name=f"sim-{i}") for i, m in enumerate(rp.make_fleet(FLEET))]
    done = [(r.arrival, r.first_token, r.end, r.generated) for r in rp.replay(reqs, "estimated_ttft", fleet)
            if r.end is not None and r.first_token is not None]
    return _stats([first - arrival for arrival, first, _, _ in done],
                  [(end - first) / (n - 1) for _, first, end, n in done if n > 1],
                  [end - arrival for arrival, _, end, _ in done])


def realtime(n: int, scale: float, max_input: int) -> dict[str, float]:
    spec = [{"name": f"sim-{i}", "models": ["m"], "profile": p, "speed": 1.0,
             "profile_overrides": {"max_model_len": rp.MAX_MODEL_LEN}} for i, p in enumerate(FLEET)]
    sim, urls = start_sim(spec)
    tmp = Path(tempfile.mkdtemp(prefix="tg-replay-check-"))
    try:
        gw, url, _ = start_gateway({"routing": {"policy": "estimated_ttft", "scrape_interval_s": 0},
                                    "backends": [{"name": k, "url": u, "models": ["m"]} for k, u in urls.items()]},
                                   workdir=str(tmp))
        try:
            subprocess.run([sys.executable, "-m", "loadtest", "run", "--target", url, "--model", "m",
                            "--workload", "mooncake", "-p",
                            f"trace=conversation,max_input_len={max_input},time_scale={scale}",
                            "-n", str(n), "--seed", "1", "--out", str(tmp / "run")],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800)
        finally:
            stop(gw)
    finally:
        stop(sim)
    doc = json.loads((tmp / "run" / "results.json").read_text())
    recs = [r for r in doc["runs"][0]["lanes"][0]["records"] if r.get("error") is None]
    ttft = [r["ttft_s"] for r in recs if r.get("ttft_s") is not None]
    tpot = [r["tpot_s"] for r in recs if r.get("tpot_s") is not None]
    e2e = [r["e2e_s"] for r in recs if r.get("e2e_s") is not None]
    return _stats(ttft, tpot, e2e)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.replay_check", description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--time-scale", type=float, default=1.5)
    ap.add_argument("--max-input", type=int, default=8192)
    args = ap.parse_args(argv)
    virt = offline(args.requests, args.time_scale, args.max_input)
    real = realtime(args.requests, args.time_scale, args.max_input)
    print(f"mooncake conversation, first {args.requests} rows, inter-arrival x{args.time_scale}, prompts capped at "
          f"{args.max_input} tokens, fleet {' + '.join(FLEET)}, estimated_ttft\n")
    print("| metric | offline replay | real-time fleet via gateway | real / replay |")
    print("|---|---|---|---|")
    for k in virt:
        print(f"| {k} | {virt[k]:.3f} | {real[k]:.3f} | {real[k] / virt[k]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
