"""Unit tests of the simulated engine model, in virtual time (no sleeps, no wall-clock asserts).

The async runner tests use real asyncio at a high speed factor but assert only on
tokens and engine state, never on elapsed time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest

from loadtest.sim import tokenizer
from loadtest.sim.engine import AsyncEngineRunner, Engine, KVCache, prompt_block_hashes
from loadtest.sim.profiles import PROFILES, get_profile

H100 = get_profile("h100-llama3-8b")


def tiny(**kw):
    """A small profile with round numbers so expected costs are easy to state."""
    base = dict(
        num_gpu_blocks=64, block_size=16, max_num_seqs=64, max_num_batched_tokens=8192,
        max_model_len=4096, step_overhead_s=0.010, prefill_s_per_token=1e-4,
        prefill_attn_s_per_token_pair=0.0, decode_s_per_seq=1e-3, kv_read_s_per_token=1e-6,
    )
    base.update(kw)
    return dataclasses.replace(get_profile("demo"), **base)


def prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def run_to_completion(engine: Engine, now: float = 0.0, max_steps: int = 100_000):
    """Step until idle; return (end time, {req_id: [outputs]}, [step dicts])."""
    outs: dict[str, list] = {}
    steps = []
    for _ in range(max_steps):
        if not engine.has_work():
            break
        dt, step_outs = engine.step(now)
        now += dt
        steps.append(dict(engine.last_step))
        for o in step_outs:
            outs.setdefault(o.req_id, []).append(o)
    else:
        raise AssertionError("engine did not drain")
    return now, outs, steps


def ttft(engine: Engine, req_id: str, ids: list[int], now: float = 0.0) -> tuple[float, list]:
    engine.add_request(req_id, ids, 4, arrival_time=now)
    _t, outs, steps = run_to_completion(engine, now)
    return engine.pop_samples()["ttft_s"][0], (outs[req_id], steps)


# --- prefix caching ------------------------------------------------------------------


def test_repeated_prefix_is_charged_less_prefill_than_fresh():
    e = Engine(H100)
    system = prompt(1024)
    t_first, (outs_a, steps_a) = ttft(e, "a", system + prompt(100, 50_000))
    t_repeat, (outs_b, steps_b) = ttft(e, "b", system + prompt(100, 60_000))
    t_fresh, (outs_c, steps_c) = ttft(e, "c", prompt(1024, 90_000) + prompt(100, 70_000))
    assert steps_a[0]["prefill_tokens"] == 1124
    assert steps_b[0]["prefill_tokens"] == 1124 - 1024  # the shared 64 blocks are skipped
    assert steps_c[0]["prefill_tokens"] == 1124
    assert t_repeat < t_first and t_repeat < t_fresh
    # The saving is exactly the prefill cost of the skipped tokens (plus their attention).
    saved = t_first - t_repeat
    assert saved >= 1024 * H100.prefill_s_per_token
    assert outs_b[0].num_cached_tokens == 1024
    assert outs_a[0].num_cached_tokens == 0 and outs_c[0].num_cached_tokens == 0


def test_cached_tokens_reported_like_vllm():
    e = Engine(tiny())
    ids = prompt(64)  # exactly 4 blocks
    _, (_outs1, _) = ttft(e, "1", ids)
    _, (outs2, steps2) = ttft(e, "2", ids)
    # Whole-prompt hit: the last token is recomputed, so only 3 whole blocks count.
    assert outs2[0].num_cached_tokens == 48
    assert steps2[0]["prefill_tokens"] == 16
    assert all(o.num_cached_tokens == 48 and o.num_prompt_tokens == 64 for o in outs2)
    assert e.prefix_cache_queries == 128
    assert e.prefix_cache_hits == 48
    # A partial last block is never cached: 70 tokens -> 4 full blocks hit at most.
    _, (outs3, _) = ttft(e, "3", ids + prompt(6, 9000))
    assert outs3[0].num_cached_tokens == 64


# --- KV exhaustion: waiting and preemption -------------------------------------------


def test_kv_exhaustion_makes_requests_wait():
    e = Engine(tiny(num_gpu_blocks=8))  # 128 tokens of KV
    e.add_request("a", prompt(100, 1000), 10, arrival_time=0.0)  # 7 blocks
    e.add_request("b", prompt(100, 5000), 10, arrival_time=0.0)
    now = 0.0
    dt, _ = e.step(now)
    now += dt
    assert e.num_running == 1 and e.num_waiting == 1
    assert e.kv_cache_usage == pytest.approx(7 / 8)
    while "a" in e.requests:
        dt, _ = e.step(now)
        now += dt
        if "a" in e.requests:
            assert e.num_waiting == 1  # b is still waiting while a holds the blocks
    _, outs, _ = run_to_completion(e, now)
    assert sum(len(o.new_token_ids) for o in outs["b"]) == 10
    assert e.num_preemptions == 0


def test_kv_exhaustion_preempts_last_running_request_and_recomputes():
    e = Engine(tiny(num_gpu_blocks=10))
    e.add_request("a", prompt(64, 1000), 40, arrival_time=0.0)
    e.add_request("b", prompt(64, 5000), 40, arrival_time=0.0)
    _, outs, _ = run_to_completion(e)
    assert e.num_preemptions >= 1
    tokens = {r: [t for o in outs[r] for t in o.new_token_ids] for r in ("a", "b")}
    assert len(tokens["a"]) == 40 and len(tokens["b"]) == 40
    # Preemption does not change the generated text (recompute, same seed).
    ref = Engine(tiny())
    ref.add_request("b", prompt(64, 5000), 40, arrival_time=0.0)
    _, ref_outs, _ = run_to_completion(ref)
    assert tokens["b"] == [t for o in ref_outs["b"] for t in o.new_token_ids]
    assert e.kv_cache_usage == 0.0


# --- step cost -----------------------------------------------------------------------


def _decode_step_dt(profile, batch: int, prompt_len: int) -> tuple[float, dict]:
    e = Engine(profile)
    for i in range(batch):
        e.add_request(f"r{i}", prompt(prompt_len, 1000 + i * 10_000), 8, arrival_time=0.0)
    dt, outs = e.step(0.0)  # all prompts prefilled in one step
    assert len(outs) == batch
    dt, outs = e.step(dt)  # pure decode step
    return dt, dict(e.last_step)


def test_decode_batch_of_64_is_slower_than_1_by_the_profile_slope():
    p = H100
    dt1, s1 = _decode_step_dt(p, 1, 100)
    dt64, s64 = _decode_step_dt(p, 64, 100)
    assert s1["decode_seqs"] == 1 and s64["decode_seqs"] == 64
    assert s1["prefill_tokens"] == 0 and s64["prefill_tokens"] == 0
    context = 101  # 100 prompt tokens + the first generated token
    slope = p.decode_s_per_seq + context * p.kv_read_s_per_token
    assert dt1 == pytest.approx(p.step_overhead_s + slope, rel=1e-12)
    assert dt64 - dt1 == pytest.approx(63 * slope, rel=1e-9)


def test_speed_factor_divides_durations():
    dt1, _ = _decode_step_dt(H100, 4, 50)
    e = Engine(H100, speed=10.0)
    for i in range(4):
        e.add_request(f"r{i}", prompt(50, 1000 + i * 10_000), 8, arrival_time=0.0)
    d0, _ = e.step(0.0)
    d1, _ = e.step(d0)
    assert d1 == pytest.approx(dt1 / 10.0, rel=1e-12)


def test_chunked_prefill_respects_max_num_batched_tokens():
    p = tiny(max_num_batched_tokens=512, num_gpu_blocks=512)
    e = Engine(p)
    e.add_request("short", prompt(10, 1000), 50, arrival_time=0.0)
    dt, _ = e.step(0.0)  # "short" is now decoding
    e.add_request("long", prompt(2000, 50_000), 2, arrival_time=dt)
    now = dt
    chunks = []
    first_token_step = None
    for k in range(10):
        dt, outs = e.step(now)
        now += dt
        s = e.last_step
        assert s["prefill_tokens"] + s["decode_seqs"] <= 512
        chunks.append(s["prefill_tokens"])
        if any(o.req_id == "long" for o in outs) and first_token_step is None:
            first_token_step = k
    # One decode token per step for "short", so the long prompt gets 511 per step.
    assert chunks[:4] == [511, 511, 511, 467]
    assert first_token_step == 3
    expected = p.step_overhead_s + 511 * p.prefill_s_per_token + p.decode_s_per_seq + 11 * p.kv_read_s_per_token
    e2 = Engine(p)
    e2.add_request("short", prompt(10, 1000), 50, arrival_time=0.0)
    d, _ = e2.step(0.0)
    e2.add_request("long", prompt(2000, 50_000), 2, arrival_time=d)
    d2, _ = e2.step(d)
    assert d2 == pytest.approx(expected, rel=1e-12)


# --- eviction, abort -----------------------------------------------------------------


def test_kv_cache_evicts_least_recently_used_blocks_first():
    kv = KVCache(num_blocks=4, block_size=16)
    a = kv.allocate(2)
    kv.register(a[0], 100)
    kv.register(a[1], 101)
    b = kv.allocate(2)
    kv.register(b[0], 200)
    kv.register(b[1], 201)
    kv.release(a)  # a freed first: least recently used
    kv.release(b)
    kv.touch(kv.lookup([100, 101]))  # a is used again...
    kv.release(a)  # ...and freed again: now b is the LRU one
    kv.allocate(1)
    # Tail blocks go before their prefix: b's second block is the first victim.
    assert kv.lookup([200, 201]) == [b[0]]
    kv.allocate(1)
    assert kv.lookup([200]) == []
    assert kv.lookup([100, 101]) == a
    assert kv.num_evictions == 2


def test_engine_eviction_order_is_lru():
    e = Engine(tiny(num_gpu_blocks=6))
    A, B, C = prompt(33, 1000), prompt(33, 2000), prompt(33, 3000)
    for rid, ids in (("a1", A), ("b1", B), ("a2", A), ("c1", C)):
        e.add_request(rid, ids, 1, arrival_time=0.0)
        run_to_completion(e)
    # C needed 3 blocks: the 2 partial (unhashed) blocks plus the LRU cached block,
    # which is B's tail (A was used after B). A keeps both blocks, B keeps its first.
    _, (outs_a, _) = ttft(e, "a3", A)
    assert outs_a[0].num_cached_tokens == 32
    _, (outs_b, _) = ttft(e, "b2", B)
    assert outs_b[0].num_cached_tokens == 16


def test_abort_frees_blocks_immediately():
    e = Engine(tiny(num_gpu_blocks=128))
    ids = prompt(500)
    e.add_request("x", ids, 100, arrival_time=0.0)
    e.add_request("w", prompt(10, 9000), 5, arrival_time=0.0)
    e.step(0.0)
    assert e.kv_cache_usage > 0 and e.num_running == 2
    e.abort("x")
    e.abort("w")
    e.abort("unknown")  # no-op
    assert e.kv_cache_usage == 0.0
    assert e.num_running == 0 and e.num_waiting == 0 and not e.has_work()
    assert e.request_success["abort"] == 2
    # Its computed full blocks stay in the prefix cache.
    _, (outs, _) = ttft(e, "y", ids)
    assert outs[0].num_cached_tokens == 496


def test_abort_waiting_request():
    e = Engine(tiny(num_gpu_blocks=8))
    e.add_request("a", prompt(100), 10, arrival_time=0.0)
    e.add_request("b", prompt(100, 5000), 10, arrival_time=0.0)
    e.step(0.0)
    assert e.num_waiting == 1
    e.abort("b")
    assert e.num_waiting == 0


def test_add_request_validation():
    e = Engine(tiny(max_model_len=128))
    with pytest.raises(ValueError):
        e.add_request("a", [], 1, arrival_time=0.0)
    with pytest.raises(ValueError):
        e.add_request("a", prompt(100), 100, arrival_time=0.0)
    e.add_request("a", prompt(10), 1, arrival_time=0.0)
    with pytest.raises(ValueError):
        e.add_request("a", prompt(10), 1, arrival_time=0.0)


# --- disaggregated prefill / decode --------------------------------------------------


def test_prefill_only_returns_kv_transfer_params():
    p = H100
    e = Engine(p, engine_id="prefill-0")
    ids = prompt(1000)
    e.add_request("p", ids, 200, prefill_only=True, arrival_time=0.0)
    _, outs, steps = run_to_completion(e)
    (out,) = outs["p"]
    assert out.finished and out.finish_reason == "length" and len(out.new_token_ids) == 1
    kvp = out.kv_transfer_params
    assert kvp["do_remote_prefill"] is True and kvp["do_remote_decode"] is False
    assert kvp["remote_engine_id"] == "prefill-0"
    assert kvp["num_tokens"] == 1000
    assert len(kvp["remote_block_ids"]) == 63  # ceil(1000 / 16)
    assert kvp["remote_block_hashes"] == [f"{h:016x}" for h in prompt_block_hashes(ids, 16)]
    assert len(steps) == 1 and steps[0]["prefill_tokens"] == 1000
    assert e.kv_cache_usage == 0.0


def test_remote_prefill_charges_transfer_time_instead_of_prefill_compute():
    p = H100
    speed = 2.0
    e = Engine(p, speed=speed)
    ids = prompt(2000)
    e.add_request("d", ids, 3, remote_prefill_tokens=2000, arrival_time=0.0)
    dt, outs = e.step(0.0)
    assert outs == [] and e.last_step["idle"]
    transfer_s = 1999 * p.kv_bytes_per_token / p.link_bandwidth_bytes_per_s
    assert dt == pytest.approx(transfer_s / speed, rel=1e-12)
    assert e.num_waiting == 1 and e.kv_cache_usage > 0
    now = dt
    dt, outs = e.step(now)
    assert e.last_step["prefill_tokens"] == 1  # only the last prompt token is computed
    assert outs[0].num_cached_tokens == 1999 and outs[0].new_token_ids
    _, rest, _ = run_to_completion(e, now + dt)
    assert sum(len(o.new_token_ids) for o in outs + rest["d"]) == 3
    assert e.kv_transfer_tokens_total == 1999
    # Cheaper than computing the prompt locally on this profile.
    local = Engine(p, speed=speed)
    local.add_request("d", ids, 3, arrival_time=0.0)
    run_to_completion(local)
    assert local.pop_samples()["ttft_s"][0] > e.pop_samples()["ttft_s"][0]


def test_remote_prefill_uses_local_prefix_hits_first_and_does_not_block_others():
    e = Engine(tiny())
    shared = prompt(320)
    ttft(e, "warm", shared)
    e.add_request("d", shared + prompt(200, 7000), 2, remote_prefill_tokens=520, arrival_time=0.0)
    e.add_request("other", prompt(10, 9000), 2, arrival_time=0.0)
    _dt, outs = e.step(0.0)
    assert [o.req_id for o in outs] == ["other"]  # runs while the KV transfer is in flight
    assert e.kv_transfer_tokens_total == 519 - 320


# --- tokenizer -----------------------------------------------------------------------


def test_tokenizer_is_deterministic_and_round_trips_generated_text():
    text = "Hello, world! The quick brown fox jumps over 12345 lazy dogs.\n"
    assert tokenizer.split(text)[:6] == ["Hell", "o", ",", " worl", "d", "!"]
    assert "".join(tokenizer.split(text)) == text
    ids = tokenizer.tokenize(text)
    assert ids == tokenizer.tokenize(text) and len(ids) == tokenizer.count_tokens(text)
    assert tokenizer.detokenize(ids) == text
    assert ids[0] == tokenizer.piece_id("Hell")  # pure function of the piece
    gen = [tokenizer.output_token_id(42, i) for i in range(50)]
    assert tokenizer.tokenize(tokenizer.detokenize(gen)) == gen


def test_profiles_are_consistent():
    for name in ("h100-llama3-8b", "a10g-llama3-8b", "h100-llama3-8b-prefill",
                 "h200-llama3-8b-decode", "demo"):
        p = PROFILES[name]
        assert p.num_gpu_blocks > 0 and p.step_overhead_s > 0 and p.kv_bytes_per_token > 0
    assert H100.kv_bytes_per_token == 131072
    assert get_profile("a10g-llama3-8b").step_overhead_s > H100.step_overhead_s
    with pytest.raises(KeyError):
        get_profile("nope")


# --- async runner --------------------------------------------------------------------


@pytest.mark.asyncio
async def test_async_runner_yields_tokens_until_finished():
    engine = Engine(get_profile("demo"), speed=1000.0)
    async with AsyncEngineRunner(engine) as runner:
        streams = [runner.generate(f"r{i}", prompt(50, 1000 + i * 1000), 12) for i in range(3)]

        async def consume(gen):
            toks = []
            async with contextlib.aclosing(gen) as g:
                async for out in g:
                    toks.extend(out.new_token_ids)
                    last = out
            return toks, last

        results = await asyncio.gather(*(consume(s) for s in streams))
    for toks, last in results:
        assert len(toks) == 12 and last.finished and last.finish_reason == "length"
    assert engine.kv_cache_usage == 0.0 and not engine.has_work()
    assert runner.stats()["steps"] > 0


@pytest.mark.asyncio
async def test_async_runner_abort_on_cancel_frees_blocks():
    engine = Engine(get_profile("demo"), speed=1000.0)
    async with AsyncEngineRunner(engine) as runner:
        got_one = asyncio.Event()

        async def consumer():
            async for _ in runner.generate("x", prompt(400), 3000):
                got_one.set()

        task = asyncio.create_task(consumer())
        await got_one.wait()
        assert engine.kv_cache_usage > 0 and "x" in engine.requests
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert "x" not in engine.requests
        assert engine.kv_cache_usage == 0.0
        assert engine.request_success["abort"] == 1

        # Closing the iterator early aborts too.
        gen = runner.generate("y", prompt(400, 9000), 3000)
        await gen.__anext__()
        await gen.aclose()
        assert "y" not in engine.requests and engine.kv_cache_usage == 0.0


def test_evictions_of_a_session_between_turns_are_counted_apart():
    """A session's blocks evicted while it has no request in the engine count as idle
    evictions (and reach the hook); those of a session with a turn queued do not, nor
    those of requests that name no session."""
    e = Engine(tiny(num_gpu_blocks=7))
    seen: list[str] = []
    e.on_idle_eviction = seen.append
    e.add_request("s1-t1", prompt(48, 1000), 1, arrival_time=0.0, session="s1")
    run_to_completion(e)  # s1 between turns: its 3 cached blocks wait
    e.add_request("x", prompt(111, 5000), 1, arrival_time=0.0)  # all 7 blocks: every cached one goes
    run_to_completion(e)
    assert e.kv_evictions_idle_session == 3 and seen == ["s1"] * 3
    assert e.kv.num_evictions == 3
    # now s2's blocks are evicted while s2's next turn waits in the queue: not idle
    e = Engine(tiny(num_gpu_blocks=7))
    e.on_idle_eviction = seen.append
    e.add_request("s2-t1", prompt(48, 1000), 1, arrival_time=0.0, session="s2")
    run_to_completion(e)
    e.add_request("big", prompt(111, 5000), 1, arrival_time=0.0)
    e.add_request("s2-t2", prompt(64, 1000), 1, arrival_time=0.0, session="s2")
    run_to_completion(e)
    assert e.kv.num_evictions > 0 and e.kv_evictions_idle_session == 0
    assert e.stats()["kv_evictions_idle_session"] == 0
    # blocks released by a request without a session lose their session's tag
    e = Engine(tiny(num_gpu_blocks=7))
    e.add_request("s3-t1", prompt(48, 1000), 1, arrival_time=0.0, session="s3")
    run_to_completion(e)
    e.add_request("same-prefix", prompt(64, 1000), 1, arrival_time=0.0)  # hits s3's 3 blocks, adds one
    run_to_completion(e)
    e.add_request("big", prompt(111, 5000), 1, arrival_time=0.0)
    run_to_completion(e)
    assert e.kv.num_evictions == 4 and e.kv_evictions_idle_session == 0
