"""Workloads of the benchmark client: what to send, in what order, and (for traces) when.

A workload is built from a name, a seed and ``key=value`` parameters
(:func:`make_workload`) and yields :class:`Session` objects: a session is one or more
:class:`Turn` s sent in order, each turn after the previous answer arrived (multi-turn
conversations send that answer back as history). Single-request workloads are
sessions of one turn. Trace workloads also carry each session's arrival time.

Every prompt is made of short English words, one token each for the simulator's
tokenizer and about one for BPE tokenizers (see :mod:`loadtest.traces`); lengths are
in tokens of that measure. Output lengths are fixed by ``max_tokens`` with
``ignore_eos: true`` (vLLM and SGLang honour it; other servers may stop earlier).

| name | parameters (defaults) | source of the shape |
|---|---|---|
| ``fixed`` | ``input_len=1024, output_len=128`` | vLLM ``--dataset-name random`` (range ratio 0) |
| ``short-long`` | ``short_input_len=128, long_input_len=4096, output_len=128, long_fraction=0.5`` | two groups side by side |
| ``shared-prefix`` | ``num_groups=8, prompts_per_group=16, system_prompt_len=2048, question_len=128, output_len=256`` | SGLang ``generated-shared-prefix`` (``gen-*`` flags; SGLang's defaults are 64 groups x 16 prompts, 2048/128/256) |
| ``multi-turn`` | ``turns=4, system_prompt_len=512, user_len=128, output_len=128`` | each turn sends the whole history back |
| ``mooncake`` | ``trace=conversation, max_input_len=32768, start=0, time_scale=1.0`` | ``shared/traces/mooncake`` (``hash_ids`` to text, prefix sharing kept) |
| ``azure`` | ``trace=conv, max_input_len=32768, start=0, time_scale=1.0`` | ``shared/traces/azure2023`` (lengths and arrival times) |

Trace workloads send each request at its trace time (relative to the first one sent),
multiplied by ``time_scale``, or rescaled so that the mean rate is the run's ``--rate``
(:func:`loadtest.traces.scale_to_rate`: the shape of bursts and gaps is kept).
``trace`` is ``conversation`` or ``synthetic`` (Mooncake), ``conv`` or ``code`` (Azure);
``start`` skips that many rows.

Prompts of different runs share nothing unless they use the same ``seed`` (the seed
salts every generated word), so a second run does not hit the first run's cache.
"""  # noqa: E501 - a table, one row a line

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from loadtest import traces


@dataclass(slots=True)
class Turn:
    """One request of a session. ``text`` is the new user message (chat) or the
    prompt continuation (completions); ``input_tokens`` the expected prompt length of
    this turn alone (tokens); ``output_tokens`` the ``max_tokens`` to request."""

    text: str
    input_tokens: int
    output_tokens: int


@dataclass(slots=True)
class Session:
    """Turns sent in order on one conversation. ``system`` (optional) is the system
    prompt; ``group`` labels the session in the report (per-group metrics);
    ``arrival_s`` is the trace's arrival time (seconds from the trace start) or
    ``None`` when the run's arrival process decides."""

    turns: list[Turn]
    system: str | None = None
    group: str = ""
    arrival_s: float | None = None
    think_time_s: float = 0.0


@dataclass
class Workload:
    """A named, parameterized workload. :meth:`sessions` yields up to ``n_requests``
    turns' worth of sessions (the last session may be cut short)."""

    name: str
    params: dict[str, Any]
    seed: int
    build: Callable[[Workload, int], Iterable[Session]] = field(repr=False)
    has_arrivals: bool = False

    salt: str = ""  # namespaces the generated text (compare: one per target, so targets share no cache)
    target_rate: float | None = None  # traces: rescale arrival times to this mean rate (req/s)

    def sessions(self, n_requests: int) -> Iterator[Session]:
        """Sessions holding exactly ``n_requests`` turns in all (fewer when a trace is
        shorter), generated lazily."""
        left = n_requests
        for s in self.build(self, n_requests):
            if left <= 0:
                break
            if len(s.turns) > left:
                s = dataclasses.replace(s, turns=s.turns[:left])
            yield s
            left -= len(s.turns)

    def describe(self) -> dict[str, Any]:
        d = {"name": self.name, "seed": self.seed, "params": dict(self.params)}
        if self.salt:
            d["salt"] = self.salt
        if self.target_rate is not None:
            d["target_rate"] = self.target_rate
        return d


def _salt(wl: Workload) -> str:
    return f"{wl.name}/{wl.seed}/{wl.salt}"


def _fixed(wl: Workload, n: int) -> Iterator[Session]:
    p = wl.params
    rng = random.Random(_salt(wl))
    for _ in range(n):  # random words: no two prompts share a cache block
        yield Session([Turn(traces.random_words(p["input_len"], rng), p["input_len"], p["output_len"])],
                      group="fixed")


def _short_long(wl: Workload, n: int) -> Iterator[Session]:
    p = wl.params
    rng = random.Random(_salt(wl))
    for _ in range(n):
        long = rng.random() < p["long_fraction"]
        k = p["long_input_len"] if long else p["short_input_len"]
        yield Session([Turn(traces.random_words(k, rng), k, p["output_len"])], group="long" if long else "short")


def _shared_prefix(wl: Workload, n: int) -> Iterator[Session]:
    """SGLang's generated-shared-prefix dataset: ``num_groups`` system prompts of
    ``system_prompt_len`` tokens, each followed by ``prompts_per_group`` questions of
    ``question_len`` tokens; all prompts shuffled (SGLang shuffles them too). Cycles
    through the set again (new questions, same system prompts) when ``n`` is larger."""
    p = wl.params
    rng = random.Random(_salt(wl))
    systems = [traces.random_words(p["system_prompt_len"], rng) for _ in range(p["num_groups"])]
    sent = 0
    while sent < n:
        order = [g for g in range(p["num_groups"]) for _ in range(p["prompts_per_group"])]
        rng.shuffle(order)
        for g in order:
            yield Session([Turn(traces.random_words(p["question_len"], rng),
                                p["system_prompt_len"] + p["question_len"], p["output_len"])],
                          system=systems[g], group=f"g{g}")
            sent += 1


def _multi_turn(wl: Workload, n: int) -> Iterator[Session]:
    p = wl.params
    rng = random.Random(_salt(wl))
    for _ in range((n + p["turns"] - 1) // p["turns"]):
        system = traces.random_words(p["system_prompt_len"], rng) if p["system_prompt_len"] else None
        turns = [Turn(traces.random_words(p["user_len"], rng), p["user_len"], p["output_len"])
                 for _ in range(p["turns"])]
        yield Session(turns, system=system, group="conversation", think_time_s=p["think_time_s"])


def _trace(kind: str) -> Callable[[Workload, int], Iterator[Session]]:
    def build(wl: Workload, n: int) -> Iterator[Session]:
        p = wl.params
        name = f"{kind}_{p['trace']}"
        if name not in traces.TRACES:
            known = sorted(k.split("_", 1)[1] for k in traces.TRACES if k.startswith(kind))
            raise ValueError(f"unknown {kind} trace {p['trace']!r}; known: {', '.join(known)}")
        reqs = traces.load_trace(name, p["start"] + n, max_input_tokens=p["max_input_len"])[p["start"]:]
        if wl.target_rate:
            reqs = traces.scale_to_rate(reqs, wl.target_rate)
        else:
            t0 = reqs[0].arrival_s if reqs else 0.0
            reqs = [dataclasses.replace(r, arrival_s=(r.arrival_s - t0) * p["time_scale"]) for r in reqs]
        salt = _salt(wl)
        for i, r in enumerate(reqs):
            yield Session([Turn(traces.trace_prompt_text(r, p["start"] + i, salt), r.input_tokens, r.output_tokens)],
                          group=name, arrival_s=r.arrival_s)
    return build


# name -> (builder, default parameters, has its own arrival times)
WORKLOADS: dict[str, tuple[Callable[[Workload, int], Iterable[Session]], dict[str, Any], bool]] = {
    "fixed": (_fixed, {"input_len": 1024, "output_len": 128}, False),
    "short-long": (_short_long, {"short_input_len": 128, "long_input_len": 4096, "output_len": 128,
                                 "long_fraction": 0.5}, False),
    "shared-prefix": (_shared_prefix, {"num_groups": 8, "prompts_per_group": 16, "system_prompt_len": 2048,
                                       "question_len": 128, "output_len": 256}, False),
    "multi-turn": (_multi_turn, {"turns": 4, "system_prompt_len": 512, "user_len": 128, "output_len": 128,
                                 "think_time_s": 0.0}, False),
    "mooncake": (_trace("mooncake"), {"trace": "conversation", "max_input_len": traces.MAX_INPUT_TOKENS,
                                      "start": 0, "time_scale": 1.0}, True),
    "azure": (_trace("azure"), {"trace": "conv", "max_input_len": traces.MAX_INPUT_TOKENS, "start": 0,
                        "time_scale": 1.0}, True),
}


def parse_params(items: list[str] | None) -> dict[str, str]:
    """``["a=1", "b=x,c=2"]`` -> ``{"a": "1", "b": "x", "c": "2"}``; raises ValueError."""
    out: dict[str, str] = {}
    for item in items or []:
        for kv in item.split(","):
            if not kv.strip():
                continue
            k, sep, v = kv.partition("=")
            if not sep:
                raise ValueError(f"workload parameter {kv!r} is not key=value")
            out[k.strip().replace("-", "_")] = v.strip()
    return out


def make_workload(name: str, params: dict[str, Any] | None = None, seed: int = 0) -> Workload:
    """Build workload ``name`` with ``params`` (strings are converted to the default's
    type). Raises ValueError naming an unknown workload or parameter."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    build, defaults, has_arrivals = WORKLOADS[name]
    merged = dict(defaults)
    for k, v in (params or {}).items():
        if k not in defaults:
            raise ValueError(f"workload {name!r} has no parameter {k!r}; known: {', '.join(defaults)}")
        want = type(defaults[k])
        try:
            merged[k] = want(v) if not isinstance(v, want) else v
        except ValueError:
            raise ValueError(f"workload parameter {k}={v!r}: expected {want.__name__}") from None
        if isinstance(merged[k], (int, float)) and merged[k] < 0:
            raise ValueError(f"workload parameter {k} must be >= 0")
    if "long_fraction" in merged and not 0 <= merged["long_fraction"] <= 1:
        raise ValueError("long_fraction must be in [0, 1]")
    for k in ("turns", "num_groups", "prompts_per_group", "output_len"):
        if k in merged and merged[k] < 1:
            raise ValueError(f"workload parameter {k} must be >= 1")
    return Workload(name, merged, seed, build, has_arrivals)
