"""The KV-cache turnover of each backend: free KV, reuse of evicted blocks."""

from __future__ import annotations

import pytest

from routing.core import BackendSpec, DecisionCore
from routing.prefix_index import PrefixIndex
from tests.kv_payloads import batch, cleared, removed, stored

MODEL = "m"
BS = 4


# ---- the approximate entries' turnover -------------------------------------------------------

def test_free_blocks_before_the_cache_is_full_and_no_reuse_without_evictions():
    idx = PrefixIndex(default_capacity_blocks=10)
    assert idx.turnover("a", 64, 640.0) == (640.0, 0.0)  # nothing recorded yet: all free
    idx.record("a", (1, 2, 3), now=0.0)
    assert idx.turnover("a", 64, 640.0) == (7 * 64.0, 0.0)


def test_reuse_is_the_share_of_evicted_blocks_asked_for_again_anywhere():
    idx = PrefixIndex(default_capacity_blocks=4)
    idx.set_capacity("b", 4)
    idx.record("a", (1, 2, 3, 4), now=0.0)
    idx.record("a", (5, 6, 7, 8), now=1.0)  # evicts 4, 3, 2, 1 (a prompt's tail first)
    assert idx.turnover("a", 64, 256.0) == (0.0, 0.0)
    idx.record("a", (1, 2), now=2.0)  # two evicted blocks come back here (recomputed); evicts 8, 7
    assert idx.turnover("a", 64, 256.0) == (0.0, pytest.approx(2 / 6))
    idx.record("b", (3,), now=3.0)  # a block a evicted, recomputed on another backend: a's eviction cost it
    assert idx.turnover("a", 64, 256.0) == (0.0, pytest.approx(3 / 6))
    assert idx.turnover("b", 64, 256.0) == (3 * 64.0, 0.0)  # b evicted nothing
    idx.record("b", (3,), now=4.0)  # held there now: no second credit
    assert idx.turnover("a", 64, 256.0) == (0.0, pytest.approx(3 / 6))


def test_ghosts_are_forgotten_after_a_cache_full_of_evictions():
    idx = PrefixIndex(default_capacity_blocks=2)  # one backend: the ghosts hold 2 blocks
    idx.record("a", (1, 2), now=0.0)
    idx.record("a", (3, 4), now=1.0)  # evicts 2, 1
    idx.record("a", (5, 6), now=2.0)  # evicts 4, 3: 2 and 1 leave the ghost list
    idx.record("a", (1,), now=3.0)  # too late to count as a refetch
    assert idx.turnover("a", 64, 128.0)[1] == 0.0
    idx.record("a", (3,), now=4.0)  # evicted recently enough
    assert idx.turnover("a", 64, 128.0)[1] > 0.0


def test_reuse_follows_a_change_of_workload():
    idx = PrefixIndex(default_capacity_blocks=8)
    for i in range(40):  # 3 prompts of 4 blocks in turn into 8 blocks: each evicted prompt comes back
        idx.record("a", tuple(range(100 * (i % 3), 100 * (i % 3) + 4)), now=float(i))
    high = idx.turnover("a", 64, 512.0)[1]
    assert high > 0.6
    for i in range(40):  # then one-off prompts: nothing evicted comes back
        idx.record("a", tuple(range(10_000 + 4 * i, 10_000 + 4 * i + 4)), now=40.0 + i)
    low = idx.turnover("a", 64, 512.0)[1]
    assert low < 0.5 * high  # counts are halved every two cache-fulls of evictions


# ---- engine events: the precise turnover -------------------------------------------------------

def tokens(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


def core() -> DecisionCore:
    return DecisionCore([BackendSpec(n, frozenset({MODEL}), kv_block_size=BS, kv_base_model=MODEL,
                                     kv_capacity_tokens=640) for n in ("a", "b")], "estimated_ttft")


def test_engine_events_measure_free_kv_and_reuse_where_they_are_live():
    c = core()  # approximate entries: 10 blocks of 64 tokens per backend; the engines' blocks: 4 tokens
    ids = tokens(12)
    c.index.record("a", (7, 8, 9), now=0.0)
    assert c.index.turnover("a", 64, 640.0) == (7 * 64.0, 0.0)
    c.kv_event_batch("a", 0, batch([stored([1, 2, 3], None, ids, BS)]))  # live now: the engine's own blocks count
    assert c.index.turnover("a", 64, 640.0) == (640.0 - 3 * BS, 0.0)
    c.kv_event_batch("a", 0, batch([removed([3, 2])]))
    assert c.index.turnover("a", 64, 640.0) == (640.0 - BS, 0.0)  # two evicted, none asked for again yet
    c.kv_event_batch("b", 0, batch([stored([50, 51], None, ids[:8], BS)]))  # b computes a's evicted block 2 again
    assert c.index.turnover("a", 64, 640.0) == (640.0 - BS, 0.5)
    assert c.index.turnover("b", 64, 640.0) == (640.0 - 2 * BS, 0.0)
    c.kv_event_batch("b", 0, batch([removed([51, 50])]))  # b evicts blocks 2 and 1 (a still holds 1)
    assert c.index.turnover("b", 64, 640.0) == (640.0, 0.0)
    # a evicts block 1: the ghost list holds as many blocks as the fleet held (1) plus one,
    # so a's oldest ghost (block 3) is forgotten; b's block 2 and a's block 1 remain
    c.kv_event_batch("a", 0, batch([removed([1])]))
    assert c.index.turnover("a", 64, 640.0) == (640.0, pytest.approx(1 / 3))
    c.kv_event_batch("a", 0, batch([stored([60, 61, 62], None, ids, BS)]))  # a computes 1, 2, 3 again
    assert c.index.turnover("a", 64, 640.0) == (640.0 - 3 * BS, pytest.approx(2 / 3))  # its block 1, not 3
    assert c.index.turnover("b", 64, 640.0) == (640.0, 0.5)  # b's block 2
    c.kv_event_batch("a", 0, batch([cleared()]))  # a clear is no eviction: what was measured stays
    assert c.index.turnover("a", 64, 640.0) == (640.0, pytest.approx(2 / 3))
