"""Trace parsing, the hash-ids-to-text mapping, and the workloads of the benchmark client."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from loadtest import traces
from loadtest.client import ClientOptions, build_body
from loadtest.sim import tokenizer
from loadtest.traces import TraceRequest, block_words, load_trace, scale_to_rate, trace_prompt_text, trace_rate
from loadtest.workloads import make_workload, parse_params

if not (traces.TRACES_DIR / "mooncake").is_dir():
    # a clean checkout without the workspace's traces: use the samples shipped with the
    # tests (the first rows of the same files, see tests/support/data/traces/README.md)
    traces.TRACES_DIR = Path(__file__).resolve().parents[2] / "support" / "data" / "traces"
needs_traces = pytest.mark.skipif(not (traces.TRACES_DIR / "mooncake").is_dir(),
                                  reason=f"traces not found at {traces.TRACES_DIR}")


@needs_traces
def test_mooncake_trace_rows():
    reqs = load_trace("mooncake_conversation", 200)
    assert len(reqs) == 200
    assert all(r.hash_ids and r.hash_ids[0] == 0 for r in reqs)  # the shared system-prompt block
    assert all(len(r.hash_ids) == math.ceil(r.input_tokens / 512) for r in reqs)
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    capped = load_trace("mooncake_conversation", 200, max_input_tokens=1000)
    assert max(r.input_tokens for r in capped) <= 1000
    assert all(c.hash_ids == r.hash_ids[:len(c.hash_ids)] for c, r in zip(capped, reqs))


@needs_traces
def test_azure_trace_rows():
    reqs = load_trace("azure_code", 50)
    assert len(reqs) == 50 and reqs[0].arrival_s == 0.0 and reqs[0].hash_ids is None
    assert all(r.input_tokens >= 1 and r.output_tokens >= 1 for r in reqs)
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)


def test_replay_uses_the_shared_trace_module():
    from loadtest import replay

    assert replay.load_trace is traces.load_trace
    assert replay.request_tokens_and_text is traces.request_tokens_and_text


def test_equal_ids_give_equal_blocks_and_different_ids_different_ones():
    assert block_words(7) == block_words(7)
    assert tokenizer.count_tokens(block_words(7)) == 512
    ids = list(range(-300, 300)) + [2**40, -(2**40), 182789]
    texts = {h: block_words(h) for h in ids}
    assert len(set(texts.values())) == len(ids)
    heads = {t.split()[:6].__repr__() for t in texts.values()}
    assert len(heads) == len(ids)  # the first six words alone tell ids apart
    assert block_words(7, 100) == block_words(7)[:len(block_words(7, 100))]  # truncation keeps a prefix
    assert block_words(7, salt="x") != block_words(7)


def test_trace_prompts_share_exactly_the_shared_blocks():
    a = TraceRequest(0.0, 3 * 512 + 100, 10, [0, 1, 2, 3])
    b = TraceRequest(1.0, 3 * 512 + 7, 10, [0, 1, 5, 6])
    ta, tb = trace_prompt_text(a, 0), trace_prompt_text(b, 1)
    wa, wb = ta.split(), tb.split()
    assert len(wa) == a.input_tokens and len(wb) == b.input_tokens
    assert tokenizer.count_tokens(ta) == a.input_tokens  # one simulator token per word
    assert wa[:1024] == wb[:1024]
    assert wa[1024:1030] != wb[1024:1030]
    # no hash_ids (Azure): requests share nothing
    c, d = TraceRequest(0.0, 600, 5), TraceRequest(0.0, 600, 5)
    assert trace_prompt_text(c, 0).split()[:6] != trace_prompt_text(d, 1).split()[:6]


def test_scale_to_rate_keeps_the_shape():
    reqs = [TraceRequest(t, 10, 10) for t in (5.0, 6.0, 6.0, 9.0, 13.0)]
    assert trace_rate(reqs) == pytest.approx(4 / 8)
    out = scale_to_rate(reqs, 2.0)
    assert [r.arrival_s for r in out] == pytest.approx([0.0, 0.25, 0.25, 1.0, 2.0])
    assert trace_rate(out) == pytest.approx(2.0)
    assert all(r.arrival_s == 0.0 for r in scale_to_rate(reqs, math.inf))


def test_workload_parameters_and_errors():
    assert parse_params(["a=1,b=x", "c-d=2"]) == {"a": "1", "b": "x", "c_d": "2"}
    wl = make_workload("fixed", {"input_len": "64", "output_len": 8}, seed=3)
    assert wl.params == {"input_len": 64, "output_len": 8}
    with pytest.raises(ValueError, match="no parameter"):
        make_workload("fixed", {"nope": 1})
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("nope")
    with pytest.raises(ValueError, match="expected int"):
        make_workload("fixed", {"input_len": "x"})


def test_synthetic_workloads_shapes():
    fixed = list(make_workload("fixed", {"input_len": 64, "output_len": 8}, seed=1).sessions(5))
    assert len(fixed) == 5 and all(len(s.turns[0].text.split()) == 64 for s in fixed)
    assert len({s.turns[0].text for s in fixed}) == 5
    # reproducible per seed, different across seeds and salts
    again = list(make_workload("fixed", {"input_len": 64, "output_len": 8}, seed=1).sessions(5))
    assert [s.turns[0].text for s in again] == [s.turns[0].text for s in fixed]
    other = make_workload("fixed", {"input_len": 64, "output_len": 8}, seed=1)
    other.salt = "x"
    assert next(other.sessions(1)).turns[0].text != fixed[0].turns[0].text

    sp = list(make_workload("shared-prefix", {"num_groups": 3, "prompts_per_group": 4, "system_prompt_len": 50,
                                              "question_len": 10, "output_len": 5}).sessions(12))
    by_group: dict[str, set[str]] = {}
    for s in sp:
        by_group.setdefault(s.group, set()).add(s.system)
        assert len(s.turns[0].text.split()) == 10 and s.turns[0].input_tokens == 60
    assert sorted(by_group) == ["g0", "g1", "g2"] and all(len(v) == 1 for v in by_group.values())
    assert len({next(iter(v)) for v in by_group.values()}) == 3

    sl = list(make_workload("short-long", {"short_input_len": 5, "long_input_len": 50,
                                           "long_fraction": 0.5}).sessions(40))
    assert {s.group for s in sl} == {"short", "long"}
    assert all(s.turns[0].input_tokens == (50 if s.group == "long" else 5) for s in sl)

    mt = list(make_workload("multi-turn", {"turns": 3, "user_len": 5, "output_len": 4}).sessions(7))
    assert [len(s.turns) for s in mt] == [3, 3, 1]  # exactly 7 requests


@needs_traces
def test_trace_workloads_rescale_arrivals():
    wl = make_workload("mooncake", {"trace": "synthetic", "max_input_len": 2048}, seed=0)
    wl.target_rate = 50.0
    ss = list(wl.sessions(30))
    assert len(ss) == 30 and ss[0].arrival_s == 0.0
    assert 29 / ss[-1].arrival_s == pytest.approx(50.0)
    assert all(s.turns[0].input_tokens <= 2048 for s in ss)
    az = list(make_workload("azure", {"trace": "conv", "time_scale": 0.5}).sessions(5))
    raw = load_trace("azure_conv", 5)
    assert [s.arrival_s for s in az] == pytest.approx([r.arrival_s * 0.5 for r in raw])
    with pytest.raises(ValueError, match="unknown mooncake trace"):
        list(make_workload("mooncake", {"trace": "nope"}).sessions(1))


def test_request_bodies():
    s = next(iter(make_workload("multi-turn", {"turns": 2, "system_prompt_len": 3, "user_len": 2,
                                               "output_len": 7}).sessions(2)))
    body = build_body(ClientOptions(model="m"), s, 1, ["answer one"])
    assert body["max_tokens"] == 7 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "user"]
    assert body["messages"][2]["content"] == "answer one"
    comp = build_body(ClientOptions(model="m", endpoint="completions", stream=False, ignore_eos=False), s, 0, [])
    assert comp["prompt"] == s.system + s.turns[0].text
    assert "ignore_eos" not in comp and "stream_options" not in comp
