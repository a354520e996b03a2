"""The agentic workload generator (loadtest/agentic.py): deterministic sessions whose
contexts grow, share their application's prefix, fork sub-agents that share the
parent's, and wait between turns for heavy-tailed, bounded tool calls."""

from __future__ import annotations

import dataclasses
import statistics

import pytest

from loadtest import agentic
from loadtest.agentic import SESSION_HEADER, AgentParams, Segment, tokens_and_text


@pytest.fixture(scope="module")
def workload() -> list[agentic.AgentSession]:
    return agentic.generate(AgentParams(), seed=3)


def every(sessions: list[agentic.AgentSession]) -> list[agentic.AgentSession]:
    return [x for s in sessions for x in s.all_sessions()]


def test_the_same_seed_gives_the_same_sessions_and_another_seed_others(workload):
    again = agentic.generate(AgentParams(), seed=3)
    assert [(s.id, s.arrival_s, [dataclasses.astuple(t)[:4] for t in s.turns]) for s in again] == \
        [(s.id, s.arrival_s, [dataclasses.astuple(t)[:4] for t in s.turns]) for s in workload]
    other = agentic.generate(AgentParams(), seed=4)
    assert [len(s.turns) for s in other] != [len(s.turns) for s in workload]
    # session i draws alone: fewer sessions keep the first ones as they were
    fewer = agentic.generate(dataclasses.replace(AgentParams(), sessions=10), seed=3)
    assert [list(s.prompts()) for s in fewer] == [list(s.prompts()) for s in workload[:10]]


def test_tool_call_gaps_are_heavy_tailed_and_bounded(workload):
    gaps = sorted(t.gap_s for s in every(workload) for t in s.turns[1:] if t.gap_s > 0)
    p50, p90, p99 = (gaps[int(q * len(gaps))] for q in (0.5, 0.9, 0.99))
    assert p50 < 1.0 < 10.0 < p90  # mostly sub-second tool calls, one in ten over 10 s
    assert p99 > 100 * p50  # the tail is two orders of magnitude beyond the median
    assert statistics.fmean(gaps) > 10 * p50  # the mean is made by the tail
    assert gaps[0] >= 0.01 and gaps[-1] <= 300.0


def test_time_scale_shrinks_the_gaps_and_the_arrivals():
    slow = agentic.generate(dataclasses.replace(AgentParams(), sessions=5), seed=1)
    fast = agentic.generate(dataclasses.replace(AgentParams(), sessions=5, time_scale=0.1), seed=1)
    for a, b in zip(slow, fast):
        assert b.arrival_s == pytest.approx(a.arrival_s * 0.1)
        assert [t.gap_s for t in b.turns] == pytest.approx([t.gap_s * 0.1 for t in a.turns])
        assert list(a.prompts()) == list(b.prompts())


def test_contexts_grow_from_the_shared_prefix_and_compact_within_the_window(workload):
    p = AgentParams()
    apps: dict[int, tuple[Segment, ...]] = {}
    compactions = 0
    for s in every(workload):
        base = apps.setdefault(s.app, s.base)
        assert s.base == base and sum(x.tokens for x in base) == p.system_tokens + p.tools_tokens
        prev: tuple[Segment, ...] = ()
        for turn, ctx in zip(s.turns, s.prompts()):
            assert ctx[:len(base)] == base  # every turn starts with its application's blocks
            if turn.compact:
                compactions += 1
                assert ctx == base + turn.append
            elif prev:
                assert ctx[:len(prev)] == prev  # the whole previous prompt, then more
            assert sum(x.tokens for x in ctx) + turn.output_tokens <= p.max_context_tokens
            prev = ctx
    assert compactions > 0
    assert len(apps) == p.apps


def test_sub_agents_fork_from_the_parents_context_and_the_parent_reads_their_results(workload):
    forks = 0
    for s in every(workload):
        prompts = list(s.prompts())
        for k, turn in enumerate(s.turns):
            for sub in turn.forks:
                forks += 1
                assert sub.parent == s.id and sub.id.startswith(s.id + ".")
                first = next(sub.prompts())
                parent_tokens, _ = tokens_and_text(prompts[k])
                sub_tokens, _ = tokens_and_text(first)
                assert sub_tokens[:len(parent_tokens)] == parent_tokens  # the parent's prefix, token for token
                assert len(sub_tokens) > len(parent_tokens)
            if turn.forks:  # the next turn waits for them: no tool gap, their results appended
                nxt = s.turns[k + 1]
                assert nxt.gap_s == 0.0
                assert nxt.append[-1].tokens == AgentParams().subagent_result_tokens * len(turn.forks)
    assert forks >= 20
    ids = [x.id for x in every(workload)]
    assert len(ids) == len(set(ids))


def test_prompts_differ_between_sessions_after_the_shared_prefix(workload):
    a, b = [s for s in workload if s.app == workload[0].app][:2]
    ta, _ = tokens_and_text(next(a.prompts()))
    tb, _ = tokens_and_text(next(b.prompts()))
    shared = next(i for i, (x, y) in enumerate(zip(ta, tb)) if x != y)
    assert shared == AgentParams().system_tokens + AgentParams().tools_tokens


def test_each_turn_is_a_chat_request_naming_its_session(workload):
    s = next(x for x in workload if len(x.turns) >= 3 and not any(t.compact for t in x.turns[:3]))
    assert s.headers() == {SESSION_HEADER: s.id}
    bodies = [s.chat_body(k) for k in range(3)]
    for k in range(2):  # the messages of a turn are a prefix of the next one's
        assert bodies[k]["messages"] == bodies[k + 1]["messages"][:len(bodies[k]["messages"])]
    roles = [m["role"] for m in bodies[2]["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
    words = sum(len(m["content"].split()) for m in bodies[2]["messages"])
    assert words == sum(x.tokens for x in list(s.prompts())[2])  # one word per token
    assert bodies[2]["max_tokens"] == s.turns[2].output_tokens and bodies[2]["stream"]


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="no parameter"):
        agentic.params_with({"turn": "3"})
    with pytest.raises(ValueError, match="4 values"):
        agentic.params_with({"gap_s": "1:2"})
    with pytest.raises(ValueError, match="max_context_tokens"):
        agentic.params_with({"max_context_tokens": "9000"})
    assert agentic.params_with({"gap_s": "1:0.5:0.1:10", "sessions": "7"}).gap_s == (1.0, 0.5, 0.1, 10.0)
