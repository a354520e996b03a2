"""loadtest.isolation_cost: the per-key variant of a trace keeps each key's prefixes
apart and nothing else changes."""

from __future__ import annotations

import pytest

from loadtest.isolation_cost import per_key
from loadtest.traces import shared_prefix_trace


def test_per_key_blocks_are_apart_between_keys_and_shared_within_one():
    base = shared_prefix_trace(4, 200, seed=1)
    shared, isolated = per_key(base, 8, seed=1)
    assert [r.hash_ids for r in shared] == [r.hash_ids for r in base]
    assert [(r.arrival_s, r.input_tokens, r.output_tokens) for r in isolated] == \
        [(r.arrival_s, r.input_tokens, r.output_tokens) for r in base]
    by_prompt: dict[int, set[int]] = {}
    for b, r in zip(base, isolated):
        assert r.hash_ids is not None and b.hash_ids is not None
        by_prompt.setdefault(b.hash_ids[0], set()).add(r.hash_ids[0])
    # a system prompt becomes one prefix per key that sent it: more than one, at most eight
    assert all(1 < len(v) <= 8 for v in by_prompt.values())
    assert per_key(base, 1)[1][0].hash_ids == base[0].hash_ids  # one key: the trace itself


def test_too_many_keys_for_the_engines_ids_is_refused():
    with pytest.raises(ValueError):
        per_key(shared_prefix_trace(4, 200), 10_000)
