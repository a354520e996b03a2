"""Agentic workload generator: agent sessions of many turns over a growing context.

There is no public agent trace in the repository, so this module builds one from
published descriptions of agent traffic. Every number below was fixed before the
first benchmark comparison (:mod:`loadtest.agentic_bench`) and is not tuned to it.

A **session** is one agent loop: a system prompt and a tool block shared by every
session of the same agent application, the user's task, then turns. Each turn sends
the whole context so far (system, tools, task, and for every earlier turn the
model's answer echoed back and the tool's result) and asks for a short answer; the
next turn is sent when the tool call the answer asked for returns, a **tool-call
gap** later. Sometimes a turn fans out **sub-agents** that run in parallel, each a
session of its own that starts from the parent's whole context (a fork, from a turn
whose context leaves room for a sub-agent's task and answer), and the parent's next
turn waits for all of them and reads their results. A session whose context would
outgrow ``max_context_tokens`` **compacts**: its context becomes the
system and tool blocks plus a summary, as coding agents do near their window.

| parameter (default) | value and source |
|---|---|
| ``system_tokens`` (2,048) + ``tools_tokens`` (6,144) | the prefix every session of an application shares. TraceLab (Zhu et al., "TraceLab: Characterizing Coding Agent Workloads for LLM Serving", arXiv 2606.30560, 4,265 Claude Code and Codex sessions, 357,161 steps) bins steps by cached prefix: almost no Claude Code step has less than 8k tokens of prefix (3,469 of 140,338 below 8k), Codex's smallest sit at 2-8k. 8k in all. |
| ``apps`` (4) | agent applications, each with its own system and tool blocks |
| ``task_tokens`` (median 1,024) | the user's request, first turn only (assumption: TraceLab reports per-step appends, not per-task ones) |
| ``append_tokens`` (lognormal, median 850, sigma 1.30, 16 to 8,192) | a tool result: TraceLab's fresh input per step (Claude Code, prefix 32k to 128k): p50 793 to 951, p90 3.7k to 5.3k, p99 12.8k to 27.3k tokens. Median 850 and p90 4,500 give sigma 1.30 (p99 17.5k); capped at 8k so that a context stays within ``max_context_tokens``. |
| ``output_tokens`` (lognormal, median 200, sigma 1.38, 1 to 2,048) | "long contexts with short outputs" (TraceLab): 186.9M output tokens over 357,161 steps is a mean of 523; a right-skewed median of 200 with that mean gives sigma 1.38. |
| ``turns`` (lognormal, median 15, sigma 1.71, 1 to 60) | TraceLab's tool-initiated steps per session: p25 4, p50 15, p90 135, p99 1,107. Median 15 and p90 135 give sigma 1.71 (p25 4.7); capped at 60 so that a run is bounded (mean 24). |
| ``gap_s`` (lognormal, median 0.3 s, sigma 2.98, 0.01 s to 300 s) | the tool call between two turns: TraceLab's per-call tool latency, p50 0.3 s, p90 13.6 s, p99 3.6 min, mean 18.4 s ("heavily-tailed": most calls are file reads of tens to hundreds of milliseconds, shell commands and sub-agents take seconds to minutes). Median and p90 give sigma 2.98; capped at 5 minutes (above the p99) so a run ends (mean 9.5 s, 12% of gaps above 10 s). Times ``time_scale``. |
| ``fork_probability`` (0.02), ``fork_width`` (2 to 4), ``subagent_turns`` (lognormal, median 4, sigma 0.7, 1 to 12), ``subagent_task_tokens`` (300), ``subagent_result_tokens`` (500) | sub-agents: Claude Code's Agent (Task) tool starts sub-agents that run in parallel, and a *fork* inherits the parent's system prompt, tools and conversation (Claude Code's documentation, as quoted by the claudetto wiki "Subagents"); TraceLab finds parallel tool calls "the exception, not the norm" (1.2 tool calls per step on average, p90 2). How often agents fork is not published: 2% of turns is an assumption. |
| ``max_context_tokens`` (32,768), ``summary_tokens`` (2,048) | compaction: TraceLab counts context drops of 50k tokens and more as compactions; the window here is the offline replay's prompt cap (``loadtest.traces.MAX_INPUT_TOKENS``), small enough that one session is a fraction of an A100's KV cache |
| ``sessions`` (160), ``rate`` (0.5 sessions/s) | arrivals are Poisson; counting their tool calls alone (3.7 minutes a session on average), 60 to 70 sessions are live at once with 2M tokens of context, against the 1.18M tokens of KV of the replay's fleet (2 x H100 + 2 x A100, Llama-3-8B): the fleet cannot hold them all (with the turns' own prefill and decode, sessions last longer and more of them overlap). |

``time_scale`` multiplies every gap (and the arrival times): below 1 a live run on
real-time simulated engines finishes sooner with the same shape.

**Requests.** Turn ``k`` of a session is one chat completion whose messages are its
context (system, then user and assistant messages), streamed, with header
``x-session-id: <session id>`` (docs/sessions.md); sub-agents have ids of their own
(``<parent>.<k>``). Two renderings keep prefixes exact: :func:`tokens_and_text`
(token ids for the simulated engine, 4 bytes of text per token for the router, as
:func:`loadtest.traces.request_tokens_and_text`) and :meth:`AgentSession.chat_body`
(one short English word per token, :func:`loadtest.traces.block_words`). The model's
earlier answers are echoed as the generator wrote them, not as the engine generated
them, so a turn's cache hit can cover the previous prompt but not the previous answer
(conservative by one answer, about 400 tokens, per turn).

Deterministic: the same ``seed`` and parameters give the same sessions; session ``i``
draws from its own generator, so changing the number of sessions keeps the others.
"""  # noqa: E501 - a table, one row a line

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from loadtest.traces import BYTES_PER_TOKEN, block_words

SESSION_HEADER = "x-session-id"
SEGMENT_STRIDE = 8192  # token ids of segment s: s * SEGMENT_STRIDE onwards (a segment is at most this long)


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of prompt tokens with an identity: ``id`` (equal ids are equal tokens,
    so equal segment lists are equal prompts) and ``tokens`` (its length)."""

    id: int
    tokens: int


@dataclass(slots=True)
class AgentTurn:
    """One request of a session. ``append``: what it adds to the context before it is
    sent (the previous answer echoed, the tool's result, sub-agents' results, or the
    task); ``compact``: the context is first reset to the session's base blocks (a
    compaction, ``append`` then starts with the summary); ``output_tokens``: its
    ``max_tokens``; ``gap_s``: the tool call before it is sent, after the previous turn
    ended (and its sub-agents finished; 0 for the first turn); ``forks``: sub-agents
    started when it ends, whose results the next turn reads."""

    append: tuple[Segment, ...]
    output_tokens: int
    gap_s: float = 0.0
    compact: bool = False
    forks: list[AgentSession] = field(default_factory=list)


@dataclass(slots=True)
class AgentSession:
    """One agent loop: ``id`` (its ``x-session-id``), ``app`` (whose system and tool
    blocks it shares), ``base`` (the blocks a compaction keeps: system and tools),
    ``start`` (its context before the first turn: ``base`` for a top-level session,
    the parent's whole context for a fork), ``turns``, ``arrival_s`` (seconds from
    the run's start; ``None`` for a sub-agent, which starts when its parent's turn
    ends) and ``parent`` (the parent's id, or ``None``)."""

    id: str
    app: int
    base: tuple[Segment, ...]
    start: tuple[Segment, ...]
    turns: list[AgentTurn]
    arrival_s: float | None = None
    parent: str | None = None

    def prompts(self) -> Iterator[tuple[Segment, ...]]:
        """The context each turn sends, in order."""
        ctx = self.start
        for t in self.turns:
            ctx = (self.base if t.compact else ctx) + t.append
            yield ctx

    def headers(self) -> dict[str, str]:
        """The request headers every turn of the session carries."""
        return {SESSION_HEADER: self.id}

    def chat_body(self, turn: int, model: str = "m", salt: str = "") -> dict[str, Any]:
        """Turn ``turn`` as an OpenAI chat completion body: the base blocks as the
        system message, then every segment after them as a user or assistant message
        (answers echoed are the assistant's), streamed with usage, ``max_tokens`` the
        turn's output and ``ignore_eos``."""
        ctx = list(self.prompts())[turn]
        n_base = len(self.base) if ctx[:len(self.base)] == self.base else 0
        msgs = [{"role": "system", "content": "".join(segment_words(s, salt) for s in ctx[:n_base])}]
        for s in ctx[n_base:]:
            role = "assistant" if s.id in self._echoes() else "user"
            msgs.append({"role": role, "content": segment_words(s, salt)})
        return {"model": model, "messages": msgs, "max_tokens": self.turns[turn].output_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True}

    def _echoes(self) -> set[int]:
        return {t.append[0].id for t in self.turns[1:] if not t.compact}

    def all_sessions(self) -> Iterator[AgentSession]:
        """This session and its sub-agents (and theirs), depth first."""
        yield self
        for t in self.turns:
            for f in t.forks:
                yield from f.all_sessions()


def tokens_and_text(segments: tuple[Segment, ...] | list[Segment]) -> tuple[list[int], str]:
    """Token ids for the simulated engine and text for the router (exactly
    :data:`~loadtest.traces.BYTES_PER_TOKEN` bytes per token): segment ``s`` is the ids
    ``s.id * SEGMENT_STRIDE`` onwards and the text ``[<id hex>]`` repeated, so that equal
    segment lists give equal prompts on both sides and different ones differ from the
    first differing segment on."""
    tokens: list[int] = []
    parts: list[str] = []
    for s in segments:
        base = (s.id * SEGMENT_STRIDE) & 0x7FFFFFFF
        tokens.extend(range(base, base + s.tokens))
        unit = f"[{s.id:x}]"
        parts.append((unit * (s.tokens * BYTES_PER_TOKEN // len(unit) + 1))[: s.tokens * BYTES_PER_TOKEN])
    return tokens, "".join(parts)


def segment_words(s: Segment, salt: str = "") -> str:
    """The text of segment ``s`` as short English words, one token each for the
    simulator's tokenizer (:func:`loadtest.traces.block_words`, 512 words a block)."""
    out = []
    left, k = s.tokens, 0
    while left > 0:
        n = min(512, left)
        out.append(block_words(s.id * 64 + k, n, salt))
        left -= n
        k += 1
    return "".join(out)


@dataclass(frozen=True, slots=True)
class AgentParams:
    """The generator's parameters (module docstring); lengths in tokens, times in
    seconds; a ``(median, sigma, lo, hi)`` tuple is a lognormal clipped to ``[lo, hi]``."""

    sessions: int = 160
    rate: float = 0.5
    apps: int = 4
    system_tokens: int = 2048
    tools_tokens: int = 6144
    task_tokens: tuple[float, float, float, float] = (1024, 0.5, 64, 4096)
    append_tokens: tuple[float, float, float, float] = (850, 1.30, 16, 8192)
    output_tokens: tuple[float, float, float, float] = (200, 1.38, 1, 2048)
    turns: tuple[float, float, float, float] = (15, 1.71, 1, 60)
    gap_s: tuple[float, float, float, float] = (0.3, 2.98, 0.01, 300.0)
    fork_probability: float = 0.02
    fork_width: tuple[int, int] = (2, 4)
    subagent_turns: tuple[float, float, float, float] = (4, 0.7, 1, 12)
    subagent_task_tokens: int = 300
    subagent_result_tokens: int = 500
    max_context_tokens: int = 32768
    summary_tokens: int = 2048
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.apps < 1 or not self.rate > 0 or not self.time_scale > 0:
            raise ValueError("sessions, apps, rate and time_scale must be positive")
        if not 0 <= self.fork_probability <= 1:
            raise ValueError("fork_probability must be in [0, 1]")
        biggest = max(self.system_tokens, self.tools_tokens, self.summary_tokens, self.append_tokens[3],
                      self.task_tokens[3], self.output_tokens[3], self.subagent_result_tokens)
        if biggest > SEGMENT_STRIDE:
            raise ValueError(f"a segment is at most {SEGMENT_STRIDE} tokens")
        if self.system_tokens + self.tools_tokens + self.summary_tokens + self.append_tokens[3] + \
                self.output_tokens[3] > self.max_context_tokens:
            raise ValueError("max_context_tokens cannot hold the base blocks, a summary and one turn")


def _lognormal(rng: random.Random, spec: tuple[float, float, float, float]) -> float:
    median, sigma, lo, hi = spec
    return min(max(median * math.exp(rng.gauss(0.0, sigma)), lo), hi)


IDS_PER_SESSION = 1000  # segment ids a session (with its sub-agents) may use


class _Ids:
    """Segment ids of one session: ``IDS_PER_SESSION`` of its own from ``first``."""

    def __init__(self, first: int) -> None:
        self.next, self.end = first, first + IDS_PER_SESSION

    def take(self) -> int:
        if self.next >= self.end:
            raise ValueError("a session uses more segments than IDS_PER_SESSION")
        self.next += 1
        return self.next - 1


def generate(params: AgentParams = AgentParams(), seed: int = 0) -> list[AgentSession]:
    """The workload's top-level sessions in arrival order (sub-agents hang off their
    parents' turns: :meth:`AgentSession.all_sessions`). Deterministic in ``params``
    and ``seed``."""
    p = params
    arrivals = random.Random(f"agentic/{seed}/arrivals")
    bases = [(Segment(1 + 2 * a, p.system_tokens), Segment(2 + 2 * a, p.tools_tokens)) for a in range(p.apps)]
    out: list[AgentSession] = []
    t = 0.0
    for i in range(p.sessions):
        rng = random.Random(f"agentic/{seed}/session/{i}")
        # each session's segment ids are its own range (sub-agents included), so that
        # sessions are independent of one another's draws
        ids = _Ids((1 + i) * IDS_PER_SESSION)
        app = rng.randrange(p.apps)
        task = Segment(ids.take(), round(_lognormal(rng, p.task_tokens)))
        n_turns = round(_lognormal(rng, p.turns))
        s = _session(p, rng, ids, f"s{seed}-{i}", app, bases[app], bases[app], task, n_turns, depth=0)
        s.arrival_s = t
        out.append(s)
        t += arrivals.expovariate(p.rate) * p.time_scale
    return out


def _session(p: AgentParams, rng: random.Random, ids: _Ids, sid: str, app: int, base: tuple[Segment, ...],
             start: tuple[Segment, ...], task: Segment, n_turns: int, depth: int) -> AgentSession:
    s = AgentSession(sid, app, base, start, [], parent=None)
    base_tokens = sum(x.tokens for x in base)
    ctx_tokens = sum(x.tokens for x in start)
    forked = 0
    for k in range(n_turns):
        out_tokens = round(_lognormal(rng, p.output_tokens))
        if k == 0:
            new: tuple[Segment, ...] = (task,)
            gap = 0.0
        else:
            prev = s.turns[-1]
            echo = Segment(ids.take(), prev.output_tokens)
            if prev.forks:  # the sub-agents were the tool call: their results, at once
                result = Segment(ids.take(), p.subagent_result_tokens * len(prev.forks))
                gap = 0.0
            else:
                result = Segment(ids.take(), round(_lognormal(rng, p.append_tokens)))
                gap = _lognormal(rng, p.gap_s) * p.time_scale
            new = (echo, result)
        compact = ctx_tokens + sum(x.tokens for x in new) + out_tokens > p.max_context_tokens
        if compact:  # the context so far becomes a summary
            new = (Segment(ids.take(), p.summary_tokens), new[-1])
            ctx_tokens = base_tokens
        ctx_tokens += sum(x.tokens for x in new)
        turn = AgentTurn(new, out_tokens, gap, compact)
        s.turns.append(turn)
        # a fork starts from the whole prompt: only where its task and answer still fit
        room = ctx_tokens + p.subagent_task_tokens + p.output_tokens[3] <= p.max_context_tokens
        if rng.random() < p.fork_probability and depth == 0 and k < n_turns - 1 and room:
            prompt = list(s.prompts())[-1]
            width = rng.randint(*p.fork_width)
            for _k in range(width):
                forked += 1
                sub_task = Segment(ids.take(), p.subagent_task_tokens)
                sub = _session(p, rng, ids, f"{sid}.{forked}", app, base, prompt, sub_task,
                               round(_lognormal(rng, p.subagent_turns)), depth + 1)
                sub.parent = sid
                turn.forks.append(sub)
    return s


def params_with(overrides: dict[str, str]) -> AgentParams:
    """:class:`AgentParams` with ``overrides`` (strings, e.g. from ``-p key=value``;
    a tuple is given as ``a:b:c:d``). Raises ValueError naming an unknown field."""
    fields = {f.name: f for f in dataclasses.fields(AgentParams)}
    base = AgentParams()
    kw: dict[str, Any] = {}
    for k, v in overrides.items():
        if k not in fields:
            raise ValueError(f"agentic workload has no parameter {k!r}; known: {', '.join(fields)}")
        cur = getattr(base, k)
        if isinstance(cur, tuple):
            parts = v.split(":")
            if len(parts) != len(cur):
                raise ValueError(f"{k} takes {len(cur)} values separated by ':'")
            kw[k] = tuple(type(c)(x) for c, x in zip(cur, parts))
        else:
            kw[k] = type(cur)(v)
    return dataclasses.replace(base, **kw)
