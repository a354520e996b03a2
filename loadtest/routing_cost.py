"""What a routing decision costs, and what sharing state through Redis costs.

    python -m loadtest.routing_cost            # all six parts
    python -m loadtest.routing_cost --part decision|store|replicas|tokenize|kv_events|sessions

1. **decision**: microseconds per request of estimate + ``Router.route`` + release with
   the default ``estimated_ttft`` policy, for 10, 100 and 1,000 backends and 10^4 to
   10^6 blocks already in the prefix index (8 KB prompts, half of them sharing a 4 KB
   prefix with an earlier one).
2. **store**: the same per-request cost with the in-process store and with a
   :class:`~gateway.store.routing_state.RedisStore` attached to a live valkey-server (the request
   path only appends to the outbox: Redis stays off it), the sync loop's CPU, and the
   Redis commands per request counted by the server itself (``INFO commandstats``)
   while a load of requests runs.
3. **replicas**: two gateway replicas behind a round-robin L4 balancer, each routing
   half of a Mooncake trace in the offline replay, once with shared state (each sees
   the other's load and prefix blocks 50 ms late, as the Redis store's default bound)
   and once with private state: TTFT and load imbalance side by side.
4. **tokenize**: microseconds per request of the model's own tokenizer
   (:mod:`routing.tokenizer`: render the chat template, look up the prefix cache,
   encode, assemble the ids) for a short chat, an 8k-token completion prompt and a
   20-turn conversation with a 2k-token system prompt, with the prefix cache on and
   off, and how much of it runs on the event loop when long encodings go to the
   executor (``--tokenizer``: a ``tokenizer.json`` or model directory; default: the
   tests' tiny byte-level BPE).
5. **kv_events**: what the precise prefix index adds. Microseconds per request of
   ``DecisionCore.request`` (given the prompt's token ids) + ``route`` + release, 10
   backends, 2,048-token prompts half of which share a 1,024-token prefix, once with no
   backend publishing KV events (the token ids are then not even looked at) and once
   with all ten publishing (token keys, precise and speculative lookup, speculative
   record); and microseconds per applied ``BlockStored`` (16 blocks) and
   ``BlockRemoved`` payload (decode included).
6. **sessions**: microseconds per request of estimate + ``Router.route`` + release when
   every request is a turn of a session (10 backends, 10^5 blocks; 200 sessions of 10
   turns, each turn's prompt extending its session's last by 512 bytes, a session's
   turns about a second apart in the router's clock, so that sessions age through the
   bins of their waiting time, expire and are valued in the eviction cost). With
   ``--digest``, a digest of the decisions of one pass with seeded ties and of every
   candidate's turnover: equal for two versions of the code that decide the same.

Network traffic goes to 127.0.0.1 only; every loop is bounded in count.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time

from routing import BackendSpec, Fleet, Router, RouteRequest, make_policy
from routing.estimate import TokenEstimator
from routing.prefix_index import PrefixIndex


def _requests(n: int, rng: random.Random) -> list[str]:
    shared = [rng.randbytes(2048).hex() for _ in range(64)]  # 4 KB prefixes
    return [rng.choice(shared) + rng.randbytes(2048).hex() for _ in range(n)]


def decision_cost(n_backends: int, n_blocks: int, n_requests: int = 2000, store=None, router=None) -> float:
    """Microseconds per request (estimate + route + release), median of 3 passes."""
    rng = random.Random(1)
    if router is None:
        fleet = Fleet([BackendSpec(f"b{i}", frozenset({"m"})) for i in range(n_backends)])
        index = PrefixIndex(max_blocks=max(n_blocks * 2, 10_000), default_capacity_blocks=max(n_blocks, 1000))
        router = Router(fleet, make_policy("estimated_ttft"), index, store=store)
        per = 32
        for j in range(n_blocks // per):  # pre-fill the index
            index.record(f"b{j % n_backends}", tuple(rng.getrandbits(64) for _ in range(per)), now=0.0)
    est = TokenEstimator()
    texts = _requests(n_requests, rng)
    passes = []
    for _ in range(3):
        t0 = time.perf_counter()
        for i, text in enumerate(texts):
            e = est.estimate("m", text, 128)
            _d, res = router.route(RouteRequest("m", prompt_text=text, prompt_bytes=e.size_bytes, block_hashes=e.hashes,
                                               prompt_tokens=e.prompt_tokens, output_tokens=e.output_tokens,
                                               tokens_per_block=64.0), now=1.0 + i * 1e-3)
            res.release(1.0 + i * 1e-3)
        passes.append((time.perf_counter() - t0) / n_requests * 1e6)
    return statistics.median(passes)


def _sessions_work(rng: random.Random, n_sessions: int, turns: int) -> list[tuple[str, str]]:
    """The sessions workload of part 6: (session, prompt) per turn, turn by turn."""
    contexts = [rng.randbytes(2048).hex() for _ in range(n_sessions)]
    tails = [rng.randbytes(256).hex() for _ in range(turns)]
    return [(f"s{k}", contexts[k] + "".join(tails[:t + 1])) for t in range(turns) for k in range(n_sessions)]


def _sessions_router(rng: random.Random, n_backends: int, n_blocks: int, policy) -> Router:
    """A router of ``n_backends`` whose index holds ``n_blocks`` unrelated blocks."""
    fleet = Fleet([BackendSpec(f"b{i}", frozenset({"m"})) for i in range(n_backends)])
    index = PrefixIndex(max_blocks=n_blocks * 2, default_capacity_blocks=n_blocks)
    router = Router(fleet, policy, index)
    for j in range(n_blocks // 32):
        index.record(f"b{j % n_backends}", tuple(rng.getrandbits(64) for _ in range(32)), now=0.0)
    return router


def _route_turns(router: Router, est: TokenEstimator, work: list[tuple[str, str]], n_sessions: int):
    """Route every turn of ``work`` (a session's turns about a second apart), sized by
    ``est``: yields (decision, reservation, router clock) per turn, the caller releasing
    it."""
    for i, (session, text) in enumerate(work):
        now = 1.0 + i * (1.0 / n_sessions)
        e = est.estimate("m", text, 128)
        d, res = router.route(RouteRequest("m", prompt_text=text, prompt_bytes=e.size_bytes, block_hashes=e.hashes,
                                           prompt_tokens=e.prompt_tokens, output_tokens=e.output_tokens,
                                           tokens_per_block=64.0, session=session), now=now)
        yield d, res, now


def sessions_cost(n_backends: int = 10, n_blocks: int = 100_000, n_sessions: int = 200, turns: int = 10) -> float:
    """Microseconds per session turn (estimate + route + release), median of 3 passes
    (see the module docstring, part 6)."""
    rng = random.Random(3)
    work = _sessions_work(rng, n_sessions, turns)
    est = TokenEstimator()
    passes = []
    for _ in range(3):
        router = _sessions_router(rng, n_backends, n_blocks, make_policy("estimated_ttft"))
        t0 = time.perf_counter()
        for _d, res, now in _route_turns(router, est, work, n_sessions):
            res.release(now)
        passes.append((time.perf_counter() - t0) / len(work) * 1e6)
    return statistics.median(passes)


def sessions_digest(n_backends: int = 10, n_blocks: int = 100_000, n_sessions: int = 200, turns: int = 10) -> str:
    """SHA-256 (hex) of every decision of the sessions workload (part 6) routed once with
    the policy's ties broken by a seeded generator: per turn the chosen backend, reason,
    detail, placement, evidence, held tokens and idle time, and every candidate's
    ``kv_turnover`` (exact floats). Equal for two versions of the code that decide the
    same (run both with the same ``PYTHONHASHSEED``)."""
    import hashlib

    from routing.policies.estimated_ttft import EstimatedTTFT

    rng = random.Random(3)
    work = _sessions_work(rng, n_sessions, turns)
    router = _sessions_router(rng, n_backends, n_blocks, EstimatedTTFT(rng=random.Random(7)))
    seen: list[tuple[str, tuple[float, float]]] = []
    turnover = router.kv_turnover

    def recorded(b):
        t = turnover(b)
        seen.append((b.name, t))
        return t

    router._kv_turnover = recorded  # what each match hands the policy
    h = hashlib.sha256()
    for d, res, now in _route_turns(router, TokenEstimator(), work, n_sessions):
        h.update(repr((d.backend.name, d.reason, sorted(d.detail.items()), d.placement, d.evidence, d.held_tokens,
                       d.idle_s, seen)).encode())
        seen.clear()
        res.release(now)
    return h.hexdigest()


def part_sessions(digest: bool = False) -> None:
    print("\n## Decision cost with sessions (estimated_ttft, 10 backends, 10^5 blocks, 200 sessions x 10 turns), "
          "microseconds per turn\n")
    print(f"| per turn | {sessions_cost():.0f} |")
    print("|---|---|")
    if digest:
        print(f"\ndecisions digest (seeded ties): {sessions_digest()}")


def part_decision() -> None:
    print("\n## Decision cost (estimated_ttft, 8 KB prompts), microseconds per request\n")
    print("| backends | 10^4 blocks | 10^5 blocks | 10^6 blocks |")
    print("|---|---|---|---|")
    for nb in (10, 100, 1000):
        cells = [f"{decision_cost(nb, k, 1000 if nb == 1000 else 2000):.0f}" for k in (10_000, 100_000, 1_000_000)]
        print(f"| {nb} | " + " | ".join(cells) + " |")


async def _paced_routing(router: Router, seconds: float, max_requests: int) -> tuple[float, int]:
    """Route requests one at a time, yielding to the event loop after each (as a
    server handling many requests does), for ``seconds`` or ``max_requests``. Returns
    (microseconds of routing per request, requests routed)."""
    rng = random.Random(2)
    est = TokenEstimator()
    texts = _requests(2000, rng)
    loop = asyncio.get_running_loop()
    spent = 0.0
    n = 0
    t_end = time.monotonic() + seconds
    while n < max_requests and time.monotonic() < t_end:
        text = texts[n % len(texts)]
        t0 = time.perf_counter()
        e = est.estimate("m", text, 128)
        now = loop.time()
        _d, res = router.route(RouteRequest("m", prompt_text=text, prompt_bytes=e.size_bytes, block_hashes=e.hashes,
                                           prompt_tokens=e.prompt_tokens, output_tokens=e.output_tokens,
                                           tokens_per_block=64.0), now)
        res.release(now)
        spent += time.perf_counter() - t0
        n += 1
        await asyncio.sleep(0)
    return spent / n * 1e6, n


async def _store_part(seconds: float = 5.0, max_requests: int = 20_000) -> None:
    import redis.asyncio as aioredis

    from gateway.store.routing_state import RedisStore  # the gateway's store is what this part measures
    from tests.support.redis_server import ValkeyProcess  # the same valkey-server the tests use

    server = ValkeyProcess()
    server.start()
    try:
        admin = aioredis.from_url(server.url)

        def router() -> Router:
            fleet = Fleet([BackendSpec(f"b{i}", frozenset({"m"})) for i in range(8)])
            return Router(fleet, make_policy("estimated_ttft"), PrefixIndex())

        local = router()
        cpu0 = time.process_time()
        local_us, local_n = await _paced_routing(local, seconds, max_requests)
        local_cpu = time.process_time() - cpu0

        shared = router()
        store = RedisStore(shared.fleet, shared.index, server.url, namespace="bench")
        shared.store = store  # what DecisionCore.attach_store does
        await store.start()
        await admin.config_resetstat()
        cpu0 = time.process_time()
        redis_us, redis_n = await _paced_routing(shared, seconds, max_requests)
        redis_cpu = time.process_time() - cpu0
        stats = await admin.info("commandstats")
        commands = sum(v["calls"] for k, v in stats.items()
                       if k.startswith("cmdstat_") and k not in ("cmdstat_info", "cmdstat_config|resetstat"))
        syncs = store.stats.calls.get("pipeline", 0)
        await store.stop()

        idle = RedisStore(router().fleet, PrefixIndex(), server.url, namespace="bench-idle")
        await idle.start()
        cpu0 = time.process_time()
        await asyncio.sleep(3.0)
        idle_cpu = (time.process_time() - cpu0) / 3.0
        await idle.stop()
        await admin.aclose()
        print("\n## State store cost (8 backends, 8 KB prompts, requests routed back to back)\n")
        print("| | in-process | Redis (valkey on 127.0.0.1) |")
        print("|---|---|---|")
        print(f"| routing cost per request (estimate + route + release), us | {local_us:.0f} | {redis_us:.0f} |")
        print(f"| process CPU per request incl. the sync loop, us | {local_cpu / local_n * 1e6:.0f} | "
              f"{redis_cpu / redis_n * 1e6:.0f} |")
        print(f"| requests routed | {local_n} | {redis_n} |")
        print(f"| Redis commands per request | 0 | {commands / redis_n:.3f} ({commands} commands, {syncs} syncs) |")
        print(f"| sync loop CPU when idle, % of one core | 0 | {idle_cpu * 100:.1f} |")
    finally:
        server.cleanup()


def part_replicas(trace: str = "mooncake_conversation", n: int = 1500, scale: float = 1.7) -> None:
    """Two replicas, shared vs private state, in the offline replay."""
    from loadtest import replay as rp

    reqs = rp.scale_time(rp.load_trace(trace, n), scale)
    print(f"\n## Two replicas: shared vs private state ({trace}, first {n} requests, inter-arrival x{scale}, "
          f"estimated_ttft, fleet {', '.join(rp.DEFAULT_FLEET)})\n")
    rows = []
    for shared in (True, False):
        recs = rp.replay(reqs, "estimated_ttft", rp.make_fleet(), replicas=2, shared=shared)
        s = rp.summarize(recs, 2.0, 0.1)
        rows.append(("shared (50 ms staleness)" if shared else "private", s))
    print(rp.format_table(rows))


_WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an "
          "they you were her she there been one all we their has would when if so no what up out who them some "
          "could into time only new other about then two more these may first any like now my such over "
          "prefill decode cache token block backend Zürich café naïve 世界 🙂 def return x = 1 2 3").split()


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _tokenize_us(tok, requests: list[tuple[str, dict]], offload: bool = False,
                 clock=time.perf_counter) -> tuple[float, float]:
    """(microseconds per request in all, of them on the calling thread) to turn each
    request into token ids, in order, as the director does (long encodings in an
    executor thread when ``offload``), timed by ``clock`` (wall time by default;
    ``time.process_time`` gives the process's CPU, every thread's, which a busy
    machine does not inflate)."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1)
    total = on_loop = 0.0
    try:
        for endpoint, data in requests:
            t0 = clock()
            tz = tok.tokenization(endpoint, data)
            if offload and tz.offload:
                t1 = clock()
                pool.submit(tz.encode).result()
                away = clock() - t1
            else:
                away = 0.0
            tz.token_ids()
            dt = clock() - t0
            total += dt
            on_loop += dt - away
    finally:
        pool.shutdown()
    return total / len(requests) * 1e6, on_loop / len(requests) * 1e6


def part_tokenize(path: str | None = None) -> None:
    from pathlib import Path

    from routing.tokenizer import load_tokenizer

    path = path or str(Path(__file__).resolve().parent.parent / "tests" / "support" / "data" / "tiny-tokenizer")
    rng = random.Random(5)
    system = {"role": "system", "content": _words(rng, 1400)}
    short = [("chat", {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                                    {"role": "user", "content": _words(rng, 25) + f" ({i})"}]}) for i in range(400)]
    long = [("completions", {"prompt": f"{i}: " + _words(rng, 6300)}) for i in range(12)]
    convo: list[dict] = [system]
    turns = []
    for _i in range(20):
        convo = convo + [{"role": "user", "content": _words(rng, 80)}]
        turns.append(("chat", {"messages": convo}))
        convo = convo + [{"role": "assistant", "content": _words(rng, 120)}]
    probe = load_tokenizer(path, cache_tokens=0)
    sizes = {name: statistics.mean(len(probe.tokenization(e, d).token_ids()) for e, d in reqs)
             for name, reqs in (("short", short), ("long", long), ("turns", turns))}
    print(f"\n## Tokenization cost ({path}), microseconds per request\n")
    print("| request | tokens | cache off | cache on "
          "| of which on the event loop (cache on, long encodings in the executor) |")
    print("|---|---|---|---|---|")
    for name, label, reqs in (("short", "short chat (system + one question)", short),
                              ("long", "8k-token completion prompt (each one new)", long),
                              ("turns", "20-turn conversation, 2k-token system prompt (each turn's whole history)",
                               turns)):
        cells = []
        for cache in (0, 1 << 21):
            runs: list[float] = []
            for _ in range(3):
                tok = load_tokenizer(path, cache_tokens=cache + len(runs) * (cache > 0))  # a fresh, empty cache
                runs.append(_tokenize_us(tok, reqs)[0])
            cells.append(statistics.median(runs))
        loop_us = statistics.median(_tokenize_us(load_tokenizer(path, cache_tokens=(1 << 21) + 10 + i), reqs, True)[1]
                                    for i in range(3))
        print(f"| {label} | {sizes[name]:.0f} | {cells[0]:.0f} | {cells[1]:.0f} | {loop_us:.0f} |")


def _stored_payload(hashes: list[int], parent: int | None, token_ids: list[int], block_size: int) -> bytes:
    import msgpack

    ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": token_ids,
          "block_size": block_size, "lora_id": None, "medium": "GPU", "lora_name": None}
    return msgpack.packb([time.time(), [ev], 0])


def kv_events_cost(events: bool, n_requests: int = 2000, block_size: int = 16) -> float:
    """Microseconds per request (request with token ids + route + release), median of
    3 passes; ``events``: every backend publishes KV events (its engine stored the
    shared prefixes, one backend each)."""
    from routing.core import DecisionCore

    rng = random.Random(3)
    specs = [BackendSpec(f"b{i}", frozenset({"m"}), kv_block_size=block_size if events else None, kv_base_model="m")
             for i in range(10)]
    core = DecisionCore(specs, "estimated_ttft")
    prefixes = [[rng.randrange(100_000) for _ in range(1024)] for _ in range(64)]
    if events:
        for j, p in enumerate(prefixes):
            core.kv_event_batch(f"b{j % 10}", 0, _stored_payload(
                [rng.getrandbits(63) for _ in range(1024 // block_size)], None, p, block_size))
    prompts = [(rng.choice(prefixes) if i % 2 else [rng.randrange(100_000) for _ in range(1024)]) +
               [rng.randrange(100_000) for _ in range(1024)] for i in range(n_requests)]
    texts = [" ".join(map(str, p)) for p in prompts]
    passes = []
    for k in range(3):
        t0 = time.perf_counter()
        for i, (ids, text) in enumerate(zip(prompts, texts)):
            now = 1.0 + (k * n_requests + i) * 1e-3
            _, req = core.request("m", text, 128, None, True, ids if core.wants_token_ids("m") else None)
            _d, res = core.route(req, now)
            res.release(now)
        passes.append((time.perf_counter() - t0) / n_requests * 1e6)
    return statistics.median(passes)


def event_apply_cost(n: int = 5000, block_size: int = 16) -> tuple[float, float]:
    """Microseconds per applied BlockStored payload (16 blocks chained from a stored
    parent) and per BlockRemoved payload (16 blocks), decode included."""
    import msgpack

    from routing.core import DecisionCore

    rng = random.Random(4)
    core = DecisionCore([BackendSpec("b", frozenset({"m"}), kv_block_size=block_size, kv_base_model="m")],
                        "estimated_ttft")
    core.kv_event_batch("b", 0, _stored_payload([1], None, list(range(block_size)), block_size))
    stores, removes = [], []
    next_hash = 2
    for _ in range(n):
        hashes = list(range(next_hash, next_hash + 16))
        next_hash += 16
        stores.append(_stored_payload(hashes, 1, [rng.randrange(100_000) for _ in range(16 * block_size)], block_size))
        removes.append(msgpack.packb([time.time(), [{"type": "BlockRemoved", "block_hashes": hashes,
                                                     "medium": "GPU"}], 0]))
    t0 = time.perf_counter()
    for p in stores:
        core.kv_event_batch("b", 0, p)
    t1 = time.perf_counter()
    for p in removes:
        core.kv_event_batch("b", 0, p)
    t2 = time.perf_counter()
    assert core.index.counts("b") == (1, 0)
    return (t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6


def part_kv_events() -> None:
    print("\n## The precise prefix index (10 backends, 2,048-token prompts given as token ids, "
          "block size 16), microseconds\n")
    print("| | per request |")
    print("|---|---|")
    print(f"| no backend publishes KV events | {kv_events_cost(False):.0f} |")
    print(f"| every backend publishes KV events | {kv_events_cost(True):.0f} |")
    stored, removed = event_apply_cost()
    print(f"\nPer event payload: BlockStored (16 blocks) {stored:.1f} us, BlockRemoved (16 blocks) {removed:.1f} us")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.routing_cost", description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["decision", "store", "replicas", "tokenize", "kv_events", "sessions"],
                    action="append")
    ap.add_argument("--tokenizer", help="tokenizer.json or model directory of the tokenize part")
    ap.add_argument("--digest", action="store_true",
                    help="sessions part: also print a digest of its decisions, equal for code that decides the same")
    args = ap.parse_args(argv)
    parts = args.part or ["decision", "store", "replicas", "tokenize", "kv_events", "sessions"]
    if "decision" in parts:
        part_decision()
    if "store" in parts:
        asyncio.run(_store_part())
    if "replicas" in parts:
        part_replicas()
    if "tokenize" in parts:
        part_tokenize(args.tokenizer)
    if "kv_events" in parts:
        part_kv_events()
    if "sessions" in parts:
        part_sessions(args.digest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
