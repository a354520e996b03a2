"""Token estimation, canonical prompt rendering and chained block hashes.

Without the model's own tokenizer (:mod:`routing.tokenizer`, configured per model), the
gateway estimates prompt tokens from the canonical prompt's UTF-8 length with a
bytes-per-token ratio learned per model from the ``usage`` that backends return (seeded
with 4.0 bytes per token, OpenAI's rule of thumb for English: "one token generally
corresponds to ~4 characters"); with it, the prompt's token count is exact.

Prefix blocks are cut from the canonical text every ``block_bytes`` bytes (fixed at
start-up so that hashes stay stable while the ratio is learned) and hashed as a chain,
like vLLM's automatic prefix caching (block ``i``'s hash covers blocks ``0..i``; vLLM
docs, "Automatic Prefix Caching", design: ``hash(prefix tokens + block tokens)``). The
chain is seeded with the model name and an optional cache salt (vLLM's ``cache_salt``
request field), so equal text for two models, or two tenants, never collides.
"""

from __future__ import annotations

import functools
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import xxhash

DEFAULT_BYTES_PER_TOKEN = 4.0
DEFAULT_OUTPUT_TOKENS = 256
_EWMA_ALPHA = 0.05


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict):
                if isinstance(p.get("text"), str):
                    parts.append(p["text"])
                else:  # image, audio, file: a stable placeholder naming its content
                    blob = orjson.dumps(p, option=orjson.OPT_SORT_KEYS)
                    parts.append(f"<{p.get('type', 'part')}:{xxhash.xxh3_64_hexdigest(blob)}>")
            elif isinstance(p, str):
                parts.append(p)
        return "".join(parts)
    return orjson.dumps(content, option=orjson.OPT_SORT_KEYS).decode()


def canonical_prompt(endpoint: str, data: dict[str, Any]) -> str:
    """A stable text rendering of a request's prompt.

    Chat: tools (sorted-key JSON) first, then each message as ``<|role|>\\n{content}``
    plus its tool calls, in order, so that a conversation's next turn renders as an
    extension of the previous turn (its prefix blocks are shared). Completions: the
    prompt string, or the token ids joined by spaces. The same messages, tools and
    system prompt always give the same bytes.
    """
    if endpoint == "chat":
        out: list[str] = []
        tools = data.get("tools")
        if tools:
            out.append("<|tools|>\n" + orjson.dumps(tools, option=orjson.OPT_SORT_KEYS).decode() + "\n")
        for m in data.get("messages") or ():
            if not isinstance(m, dict):
                continue
            out.append(f"<|{m.get('role', '')}|>\n")
            out.append(_content_text(m.get("content")))
            calls = m.get("tool_calls")
            if calls:
                out.append(orjson.dumps(calls, option=orjson.OPT_SORT_KEYS).decode())
            out.append("\n")
        return "".join(out)
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        if prompt and all(isinstance(x, int) for x in prompt):
            return " ".join(map(str, prompt))
        return "\n".join(p if isinstance(p, str) else " ".join(map(str, p)) if isinstance(p, list) else str(p)
                         for p in prompt)
    return ""


def block_hashes(text: bytes, block_bytes: int, seed: int) -> tuple[int, ...]:
    """Chained 64-bit hashes of the full ``block_bytes``-byte blocks of ``text``.

    Only full blocks are hashed (an engine caches only full blocks). Hash ``i`` is
    ``xxh3_64(block_i, seed=hash_{i-1})`` with ``hash_{-1} = seed``.
    """
    out = []
    h = seed
    for start in range(0, len(text) - block_bytes + 1, block_bytes):
        h = xxhash.xxh3_64_intdigest(text[start:start + block_bytes], seed=h)
        out.append(h)
    return tuple(out)


def token_block_keys(token_ids: Sequence[int], block_size: int, seed: int) -> tuple[int, ...]:
    """Chained 64-bit keys of the full ``block_size``-token blocks of ``token_ids``: the
    token-exact counterpart of :func:`block_hashes`, the key of precise prefix entries.

    Key ``i`` is ``xxh3_64(uint32 little-endian token ids of block i, seed=key_{i-1})``
    with ``key_{-1} = seed`` (:func:`chain_seed` of the model or adapter and the
    ``cache_salt``). The key is ours, computed from token ids alone, the way llm-d keys
    the blocks of engine KV events, so that no engine hash function has to be
    reproduced: the ``token_ids`` of a vLLM ``BlockStored`` event and the gateway's own
    tokenization of a prompt give the same keys. Token ids must be in ``[0, 2**32)``.
    """
    if isinstance(token_ids, array) and token_ids.typecode == "I":
        ids = token_ids
    else:
        ids = array("I")
        ids.fromlist(token_ids if type(token_ids) is list else list(token_ids))
    if sys.byteorder != "little":
        ids = array("I", ids)
        ids.byteswap()
    step = 4 * block_size
    raw = ids.tobytes()
    raw = raw[:len(raw) - len(raw) % step]  # full blocks only
    out: list[int] = []
    append = out.append
    h = seed
    hash64 = xxhash.xxh3_64_intdigest
    for (block,) in struct.iter_unpack(f"{step}s", raw):  # the blocks, cut in C
        h = hash64(block, h)
        append(h)
    return tuple(out)


_CACHED_SALT_CHARS = 128  # longer cache_salt values (a client's field) are hashed, never cached


def chain_seed(model: str, cache_salt: str | None = None) -> int:
    """The first link of a model's hash chain (64-bit). Cached for the models served
    and short salts (a client may send any salt: a long one is never kept)."""
    if cache_salt is None or len(cache_salt) <= _CACHED_SALT_CHARS:
        return _chain_seed_cached(model, cache_salt)
    return _chain_seed(model, cache_salt)


def _chain_seed(model: str, cache_salt: str | None) -> int:
    return xxhash.xxh3_64_intdigest(f"{model}\x00{cache_salt or ''}".encode())


_chain_seed_cached = functools.lru_cache(maxsize=4096)(_chain_seed)


@dataclass(slots=True)
class ModelStats:
    """What one model has taught the estimator (EWMAs, alpha 0.05)."""

    bytes_per_token: float = DEFAULT_BYTES_PER_TOKEN
    output_tokens: float = DEFAULT_OUTPUT_TOKENS
    samples: int = 0


@dataclass(slots=True)
class PromptEstimate:
    """The routing view of one request's prompt: ``text`` (canonical), its UTF-8
    ``size_bytes``, ``hashes`` of its full blocks, ``prompt_tokens`` and expected
    ``output_tokens`` (tokens)."""

    text: str
    size_bytes: int
    hashes: tuple[int, ...]
    prompt_tokens: int
    output_tokens: int


def _tokens(size_bytes: int, bytes_per_token: float) -> int:
    return max(1, round(size_bytes / bytes_per_token))


@dataclass
class TokenEstimator:
    """Per-model token estimates, learned from ``usage``.

    ``block_tokens`` is the prefix-index block size in tokens; blocks are cut every
    ``block_tokens * 4`` bytes of canonical text.
    """

    block_tokens: int = 64
    models: dict[str, ModelStats] = field(default_factory=dict)

    @property
    def block_bytes(self) -> int:
        return int(self.block_tokens * DEFAULT_BYTES_PER_TOKEN)

    def stats(self, model: str) -> ModelStats:
        s = self.models.get(model)
        if s is None:
            s = self.models[model] = ModelStats()
        return s

    def prompt_tokens(self, model: str, text: str) -> int:
        """The estimated tokens of ``text``: its UTF-8 bytes over the model's learned
        bytes per token (at least 1)."""
        return _tokens(len(text.encode("utf-8", "surrogatepass")), self.stats(model).bytes_per_token)

    def estimate(self, model: str, text: str, max_tokens: int | None, cache_salt: str | None = None,
                 token_ids: Sequence[int] | None = None) -> PromptEstimate:
        """Estimate a request. ``max_tokens`` caps the expected output (0: a request
        that generates nothing, an embedding or a rerank, costs its prefill only). The prompt's
        tokens are ``len(token_ids)`` when the model's tokenizer gave them (exact),
        else counted as :meth:`prompt_tokens` counts them."""
        raw = text.encode("utf-8", "surrogatepass")
        s = self.stats(model)
        prompt_tokens = len(token_ids) if token_ids is not None else _tokens(len(raw), s.bytes_per_token)
        out = round(s.output_tokens)
        if max_tokens is not None:
            out = min(out, max_tokens)
        return PromptEstimate(text, len(raw), block_hashes(raw, self.block_bytes, chain_seed(model, cache_salt)),
                              prompt_tokens, max(out, 1) if max_tokens != 0 else 0)

    def observe_usage(self, model: str, prompt_bytes: int, prompt_tokens: int | None,
                      completion_tokens: int | None, finish_reason_length: bool = False) -> None:
        """Learn from a response's ``usage``: the model's bytes per token (clamped to
        [1, 16]) and its typical output length. An output cut by ``max_tokens``
        (``finish_reason_length``) only raises the output estimate, never lowers it."""
        s = self.stats(model)
        if prompt_tokens and prompt_tokens > 0 and prompt_bytes > 0:
            ratio = min(max(prompt_bytes / prompt_tokens, 1.0), 16.0)
            a = 0.5 if s.samples < 10 else _EWMA_ALPHA
            s.bytes_per_token += a * (ratio - s.bytes_per_token)
            s.samples += 1
        if completion_tokens is not None and completion_tokens > 0 and (
                not finish_reason_length or completion_tokens > s.output_tokens):
            s.output_tokens += _EWMA_ALPHA * (completion_tokens - s.output_tokens)
