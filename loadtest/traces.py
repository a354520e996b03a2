"""Public LLM serving traces (``../shared/traces``): loading, time scaling, and the
mapping from Mooncake ``hash_ids`` to prompt text and token ids.

Shared by the offline replay (:mod:`loadtest.replay`, virtual time) and the HTTP
benchmark client (:mod:`loadtest.workloads`, real time).

* Mooncake traces (``timestamp`` ms, ``input_length``, ``output_length``,
  ``hash_ids`` of 512-token blocks chained like a prefix cache: equal leading ids mean
  an equal prefix). Azure 2023 traces (``TIMESTAMP``, ``ContextTokens``,
  ``GeneratedTokens``): lengths and arrival times, no prefix information.
* Two renderings of one trace request, both keeping the trace's prefix sharing
  exactly (equal ids give equal blocks, different ids different blocks):
  :func:`request_tokens_and_text` for the offline replay (token ids for the engine
  model, 4-bytes-per-token text for the router) and :func:`block_words` /
  :func:`trace_prompt_text` for HTTP (one short English word per token: exactly one
  token each for the simulator's tokenizer, about one for a BPE tokenizer such as
  Llama-3's; check ``usage.prompt_tokens`` against ``input_length`` once per model, as
  ``traces/README.md`` advises).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import random
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path

TRACE_BLOCK_TOKENS = 512  # Mooncake hash_ids granularity
BYTES_PER_TOKEN = 4  # the replay's text has exactly this many bytes per token
TRACES_DIR = Path(os.environ.get("TG_TRACES_DIR", Path(__file__).resolve().parents[2] / "shared" / "traces"))
TRACES = {
    "mooncake_conversation": ("mooncake/conversation_trace.jsonl", "mooncake"),
    "mooncake_synthetic": ("mooncake/synthetic_trace.jsonl", "mooncake"),
    "azure_conv": ("azure2023/AzureLLMInferenceTrace_conv.csv", "azure"),
    "azure_code": ("azure2023/AzureLLMInferenceTrace_code.csv", "azure"),
}
# Default prompt cap (tokens): a prefix of the trace's hash_ids is kept, so prefix
# sharing is preserved. The offline replay raises max_model_len to fit it.
MAX_INPUT_TOKENS = 32768


@dataclass(slots=True)
class TraceRequest:
    """One trace row: ``arrival_s`` (seconds from the trace start), token counts, and
    the prefix block ids (Mooncake) or ``None`` (Azure: no sharing).

    ``direct_backend``: the backend name a client outside the gateway sends this
    request to (another team's client, a batch job, a second gateway): the offline
    replay has that engine serve it without the router seeing it. ``None`` (every
    trace's rows): the request goes through the gateway.

    ``session``: the session the request is a turn of, as the router sees it
    (:func:`conversation_sessions`), or ``None``."""

    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: list[int] | None = None
    direct_backend: str | None = None
    session: str | None = None


def load_trace(name: str, limit: int | None = None, max_input_tokens: int = MAX_INPUT_TOKENS,
               traces_dir: Path | None = None) -> list[TraceRequest]:
    """The first ``limit`` requests of trace ``name`` (a key of :data:`TRACES`), prompts
    capped at ``max_input_tokens``. Raises KeyError for an unknown name and OSError when
    the file is missing (set ``TG_TRACES_DIR`` to the traces folder)."""
    rel, kind = TRACES[name]
    path = (traces_dir or TRACES_DIR) / rel
    out: list[TraceRequest] = []
    if kind == "mooncake":
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                n_in = min(r["input_length"], max_input_tokens)
                ids = r["hash_ids"][: math.ceil(n_in / TRACE_BLOCK_TOKENS)]
                out.append(TraceRequest(r["timestamp"] / 1000.0, n_in, max(1, r["output_length"]), ids))
                if limit and len(out) >= limit:
                    break
    else:
        with open(path, newline="") as f:
            t0 = None
            for row in csv.DictReader(f):  # naive local times: only their differences are used
                t = datetime.strptime(row["TIMESTAMP"][:26], "%Y-%m-%d %H:%M:%S.%f").timestamp()  # noqa: DTZ007
                t0 = t if t0 is None else t0
                out.append(TraceRequest(t - t0, min(max(1, int(row["ContextTokens"])), max_input_tokens),
                                        max(1, int(row["GeneratedTokens"]))))
                if limit and len(out) >= limit:
                    break
    return out


def shared_prefix_trace(tenants: int = 150, requests: int = 1500, system_prompt_len: int = 6144,
                        question_len: int = 1200, output_len: int = 128, rate: float = 6.0,
                        seed: int = 0) -> list[TraceRequest]:
    """A many-tenant shared-prefix workload as a Mooncake-style trace: each request is
    one tenant's system prompt (``system_prompt_len`` tokens, the same for every
    request of that tenant) followed by a question of its own (``question_len``
    tokens), asking ``output_len`` tokens; tenants drawn uniformly, Poisson arrivals at
    ``rate`` requests/s, reproducible from ``seed``. The shape of llm-d's "KV-Cache Wins
    You Can See" benchmark (150 tenants, 6k-token system prompts, 1.2k-token
    questions). Block ids are positive and distinct between tenants and questions, so
    equal ids mean an equal prefix exactly as in the Mooncake traces. Raises
    ``ValueError`` unless ``system_prompt_len`` is a positive multiple of
    :data:`TRACE_BLOCK_TOKENS` (a block is either all system prompt or all question)
    and the other numbers are positive."""
    if system_prompt_len <= 0 or system_prompt_len % TRACE_BLOCK_TOKENS:
        raise ValueError(f"system_prompt_len must be a positive multiple of {TRACE_BLOCK_TOKENS}, "
                         f"got {system_prompt_len}")
    if min(tenants, requests, question_len, output_len) <= 0 or not rate > 0:
        raise ValueError("tenants, requests, question_len, output_len and rate must be positive")
    rng = random.Random(seed)
    sys_blocks = system_prompt_len // TRACE_BLOCK_TOKENS
    q_blocks = math.ceil(question_len / TRACE_BLOCK_TOKENS)
    first_question = 1 + tenants * sys_blocks
    out: list[TraceRequest] = []
    t = 0.0
    for i in range(requests):
        tenant = rng.randrange(tenants)
        ids = [1 + tenant * sys_blocks + b for b in range(sys_blocks)]
        ids += [first_question + i * q_blocks + b for b in range(q_blocks)]
        out.append(TraceRequest(t, system_prompt_len + question_len, output_len, ids))
        t += rng.expovariate(rate)
    return out


def conversation_sessions(reqs: list[TraceRequest]) -> list[TraceRequest]:
    """``reqs`` with each request's ``session`` set to the conversation it continues.
    Mooncake rows name no conversation, but a conversation resends its history: a
    request continues the latest earlier request whose whole prompt, its full
    512-token blocks (at least two, since every row of the conversation trace shares
    block 0), is a prefix of its own ``hash_ids``; it starts a session of its own
    otherwise. On the first 2,000 rows of the conversation trace: 482 continuations,
    1,518 sessions (1,207 of one turn). Rows without ``hash_ids`` get none."""
    latest: dict[tuple[int, ...], str] = {}
    out: list[TraceRequest] = []
    for i, r in enumerate(reqs):
        if r.hash_ids is None:
            out.append(r)
            continue
        ids = tuple(r.hash_ids)
        session = next((latest[ids[:k]] for k in range(len(ids), 1, -1) if ids[:k] in latest), f"c{i}")
        full = ids[:-1]  # the last block may be partial: the next turn's differs
        if len(full) >= 2:
            latest[full] = session
        out.append(dataclasses.replace(r, session=session))
    return out


def scale_time(reqs: list[TraceRequest], factor: float) -> list[TraceRequest]:
    """Multiply inter-arrival times by ``factor`` (< 1 compresses: more load)."""
    return [dataclasses.replace(r, arrival_s=r.arrival_s * factor) for r in reqs]


def trace_rate(reqs: list[TraceRequest]) -> float:
    """Mean request rate of a trace slice in requests/s: ``(n - 1) / (last - first
    arrival)``; ``inf`` when every request arrives at once."""
    if len(reqs) < 2:
        return math.inf
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    return (len(reqs) - 1) / span if span > 0 else math.inf


def scale_to_rate(reqs: list[TraceRequest], rate: float) -> list[TraceRequest]:
    """Rescale arrival times so the slice's mean rate is ``rate`` requests/s, starting
    at 0; the shape of the arrival process (bursts, idle gaps) is kept."""
    if not reqs:
        return []
    t0 = reqs[0].arrival_s
    shifted = [dataclasses.replace(r, arrival_s=r.arrival_s - t0) for r in reqs]
    own = trace_rate(shifted)
    if math.isinf(own) or rate <= 0 or math.isinf(rate):
        return [dataclasses.replace(r, arrival_s=0.0) for r in shifted] if math.isinf(rate) else shifted
    return scale_time(shifted, own / rate)


def _unique_ids(i: int, n_blocks: int) -> list[int]:
    # Azure rows have no prefix ids: give each request its own (negative) block ids
    return [-(i * 1000 + b + 1) for b in range(n_blocks)]


def block_ids(r: TraceRequest, i: int) -> list[int]:
    """The request's block ids: its ``hash_ids``, or ids unique to request ``i``."""
    return r.hash_ids if r.hash_ids is not None else _unique_ids(i, math.ceil(r.input_tokens / TRACE_BLOCK_TOKENS))


def request_tokens_and_text(r: TraceRequest, i: int) -> tuple[list[int], str]:
    """Token ids for the engine and canonical text for the router. Block ``h`` of the
    trace is 512 token ids ``h*512 .. h*512+511`` and the text ``f"[{h:x}]"`` repeated to
    2,048 bytes, so that equal ids give equal blocks on both sides."""
    ids = block_ids(r, i)
    tokens: list[int] = []
    parts: list[str] = []
    remaining = r.input_tokens
    for h in ids:
        n = min(TRACE_BLOCK_TOKENS, remaining)
        base = (h % (1 << 22)) * TRACE_BLOCK_TOKENS
        tokens.extend(range(base, base + n))
        unit = f"[{h:x}]"
        block = (unit * (TRACE_BLOCK_TOKENS * BYTES_PER_TOKEN // len(unit) + 1))[: n * BYTES_PER_TOKEN]
        parts.append(block)
        remaining -= n
    return tokens, "".join(parts)


# --- text for HTTP prompts --------------------------------------------------------------

# Short common English words (at most 4 letters): each, with its leading space, is one
# token for the simulator's tokenizer (loadtest/sim/tokenizer.py: whitespace + up to 4
# word characters) and about one for BPE vocabularies. 256 of them, so that a word is
# one base-256 digit.
WORDS: tuple[str, ...] = tuple(w for w in dict.fromkeys("""
the of and to in is was he for it with as his on be at by had are but from or have an
they which one you were her all she there been if has when who will more no out so said
what up its into than them can only two may then do some time like new now over such
our man me even most made also did many off way well back much work year down day old
any same good each take come give both long life show part city case tell data hand
high line fact area word sure form room open next high plan rate main term kind idea
book face left real four five best full head age land past need view care mind road
game body home door side war name team air fire line king red blue gold fish bird tree
rock sand star moon sun rain snow wind hill lake sea farm farm cow dog cat pig
hat cap coat shoe shop bank card cash coin deal sale cost pay fee tax bill loan debt
gain loss rise fall run walk talk sing read play ask call send keep hold turn move
live stay wait meet help join lead pick pull push cut draw drop fill hang hide hit
hunt kick kiss lift lock look mark mix pack pass ring rub save seal sell sort spin
step stop swim test tie trip vote wash wear win wish wrap zoom able bad big cold cool
dark deep dry easy fair fast fine flat free glad hard hot huge just kind late
lazy loud low mad near neat nice odd pure rare rich safe shy slow soft tall thin tiny
ugly warm weak wet wide wild wise yes zero top end art law oil job bed box
cup egg leg arm ear eye lip toe map net pen pot van web key gas ice
""".split()) if len(w) <= 4)[:256]
_ID_DIGITS = 6  # leading words of a block that spell its id (256**6 distinct ids)


def _zigzag(h: int) -> int:
    return 2 * h if h >= 0 else -2 * h - 1


@lru_cache(maxsize=65536)
def _block_words_full(h: int, salt: str) -> tuple[str, ...]:
    z = _zigzag(h)
    head = []
    for _ in range(_ID_DIGITS):
        head.append(WORDS[z & 0xFF])
        z >>= 8
    rng = random.Random(f"{salt}/{h}")
    tail = [WORDS[rng.randrange(256)] for _ in range(TRACE_BLOCK_TOKENS - _ID_DIGITS)]
    return tuple(head + tail)


def block_words(h: int, n: int = TRACE_BLOCK_TOKENS, salt: str = "") -> str:
    """The text of trace block ``h``: ``n`` (<= 512) words, each with a leading space.

    The first 6 words spell ``h`` in base 256 (so different ids give different blocks,
    for any id in ``[-2**47, 2**47)``), the rest are drawn from a generator seeded by
    ``(salt, h)`` (equal ids give byte-identical blocks). Truncating a block keeps its
    first ``n`` words, so the last block of a prompt is a prefix of the full block.
    ``salt`` namespaces a whole run (a different salt shares nothing with this one)."""
    return "".join(" " + w for w in _block_words_full(h, salt)[:n])


def trace_prompt_text(r: TraceRequest, i: int, salt: str = "") -> str:
    """Prompt text of trace request ``i``: its blocks' words concatenated, the last
    block truncated so that the text has exactly ``r.input_tokens`` words
    (``input_length - 512 * (n - 1)`` in the last block)."""
    parts = []
    remaining = r.input_tokens
    for h in block_ids(r, i):
        if remaining <= 0:
            break
        n = min(TRACE_BLOCK_TOKENS, remaining)
        parts.append(block_words(h, n, salt))
        remaining -= n
    return "".join(parts)


def random_words(n: int, rng: random.Random) -> str:
    """``n`` words drawn from ``rng`` (about ``n`` tokens), each with a leading space."""
    return "".join(" " + WORDS[rng.randrange(256)] for _ in range(n))
