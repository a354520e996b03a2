"""The prefix cache of encodings: a prompt's text cut into segments whose token ids
are kept, so that a conversation's next turn encodes only its new text.

Rendering a template costs little; encoding costs in proportion to the prompt's tokens
(``docs/results/routing_cost.md`` has the numbers). The rendered text is cut into segments just
before the tokenizer's special tokens (``<|im_start|>``...), and each segment's ids are
kept in an LRU keyed by the segment's 128-bit hash. Cutting there is exact:
``tokenizers`` splits its input at added tokens before the normalizer, pre-tokenizer
and model see it, so no BPE merge crosses such a point. Special tokens that absorb the
whitespace before them (``lstrip``), match only as whole words (``single_word``), match
on normalized text (``normalized``) or can overlap another added token are not cut
points. Special tokens the post-processor adds (BOS...) go once around the whole prompt.

A segment longer than :data:`CHUNK_CHARS` (one long message) is cut again about every
:data:`CHUNK_CHARS` characters, counted from its start, where the tokenizer allows it
(:meth:`PrefixCachedEncoder.chunk_cut_pattern`: before a single space between two
non-space characters, for byte-level BPE tokenizers whose pre-tokenizer never lets a
token cross that point). A message that grows from one request to the next (an
agent's transcript, a document being extended) then re-encodes only its last chunk
and what was added; chunks are keyed by their text like segments.
"""

from __future__ import annotations

import json
import re
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import xxhash
from tokenizers import Tokenizer

from routing.tokenizer.errors import Unsupported

OFFLOAD_CHARS = 4096
"""Text still to encode beyond this many characters is better encoded off the event
loop (``tokenizers`` releases the GIL while it encodes): below it, the hop to a
thread costs more than the encoding."""

MIN_SEGMENT_CHARS = 64
"""A cut point closer than this to the previous one is skipped: many tiny segments
cost more in lookups than they save in encoding."""

CHUNK_CHARS = 2048
"""A segment longer than this is cut into chunks of about this many characters (see
the module docstring), where the tokenizer allows it."""

DEFAULT_CACHE_TOKENS = 1 << 21
"""Token ids the prefix cache of one model holds (4 bytes each)."""

# Split regexes (Llama 3's, Qwen 2's) after which, with ByteLevel(use_regex=False), a
# single space between two non-space characters always starts a new piece (see
# PrefixCachedEncoder.chunk_cut_pattern)
_SEPARABLE_SPLITS = frozenset({  # the patterns as tokenizer.json spells them
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",  # noqa: E501
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
})

_CHUNK_CUT = re.compile(r"(?<=\S) (?=\S)")


class SegmentCache:
    """An LRU of segment token ids (``array('I')``) keyed by the segment text's 128-bit
    hash, bounded by ``max_tokens`` ids in all. Used from one thread (the event loop)."""

    def __init__(self, max_tokens: int = DEFAULT_CACHE_TOKENS) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self.hits = self.misses = 0
        self._lru: OrderedDict[bytes, array[int]] = OrderedDict()

    def get(self, key: bytes) -> array[int] | None:
        ids = self._lru.get(key)
        if ids is None:
            self.misses += 1
            return None
        self._lru.move_to_end(key)
        self.hits += 1
        return ids

    def put(self, key: bytes, ids: array[int]) -> None:
        if len(ids) > self.max_tokens or key in self._lru:
            return
        self._lru[key] = ids
        self.tokens += len(ids)
        while self.tokens > self.max_tokens:
            _, old = self._lru.popitem(last=False)
            self.tokens -= len(old)

    def __len__(self) -> int:
        return len(self._lru)


def id_array(values: Sequence[int]) -> array[int]:
    """``values`` as the token-id array of a cached segment (``array('I')``)."""
    return array("I", values)


class Tokenization:
    """One prompt on its way to token ids: the segments the cache already had and
    the texts still to encode.

    :meth:`encode` does the expensive part and touches nothing shared, so it may run
    in another thread (see :attr:`offload`); :meth:`token_ids` then assembles the ids
    and fills the cache, on the thread that made the tokenization.
    """

    __slots__ = ("_tok", "_parts", "_todo", "_encoded", "_add_special", "_truncate", "uncached_chars")

    def __init__(self, tok: PrefixCachedEncoder, parts: list[array[int] | int], todo: list[tuple[bytes, str]],
                 add_special: bool, truncate: int | None) -> None:
        self._tok = tok
        self._parts = parts  # cached ids, or the index in ``todo`` of a segment to encode
        self._todo = todo
        self._encoded: list[list[int]] | None = None
        self._add_special = add_special
        self._truncate = truncate
        self.uncached_chars = sum(len(t) for _, t in todo)

    @property
    def offload(self) -> bool:
        """Whether :meth:`encode` is long enough to run off the event loop."""
        return self.uncached_chars > OFFLOAD_CHARS

    def encode(self) -> None:
        """Encode the segments the cache did not have (thread-safe: ``tokenizers``
        encodes in Rust with the GIL released)."""
        if self._todo and self._encoded is None:
            encs = self._tok.tokenizer.encode_batch_fast([t for _, t in self._todo], add_special_tokens=False)
            self._encoded = [e.ids for e in encs]

    def token_ids(self) -> array[int]:
        """The prompt's token ids (``array('I')``), encoding first if :meth:`encode`
        was not called. New segments go into the model's prefix cache."""
        self.encode()
        cache = self._tok.cache
        encoded = [id_array(e) for e in self._encoded] if self._encoded is not None else []
        if cache is not None:
            for (key, _), ids in zip(self._todo, encoded):
                cache.put(key, ids)
        out = array("I")
        if self._add_special:
            out.extend(self._tok.head)
        for p in self._parts:
            out.extend(encoded[p] if isinstance(p, int) else p)
        if self._add_special:
            out.extend(self._tok.tail)
        if self._truncate is not None and len(out) > self._truncate:
            out = out[-self._truncate:]
        return out


class PrefixCachedEncoder:
    """Encoding through the prefix cache: the base of
    :class:`~routing.tokenizer.model_tokenizer.ModelTokenizer`, which sets
    ``tokenizer``, ``cache`` (``None``: no cache), ``head`` and ``tail`` (the ids the
    post-processor puts around a prompt), and the cut patterns ``_cuts`` (before the
    special tokens that are safe cut points) and ``_chunk_cut``
    (:meth:`chunk_cut_pattern`)."""

    tokenizer: Tokenizer
    cache: SegmentCache | None
    head: tuple[int, ...]
    tail: tuple[int, ...]
    _cuts: re.Pattern[str] | None
    _chunk_cut: re.Pattern[str] | None

    def _cut_pattern(self) -> re.Pattern[str] | None:
        added = list(self.tokenizer.get_added_tokens_decoder().values())
        contents = [a.content for a in added if a.content]
        safe = []
        for a in added:
            c = a.content
            if not (a.special and c) or a.lstrip or a.single_word or a.normalized:
                continue
            if any(_overlaps(o, c) for o in contents if o != c):
                continue
            safe.append(c)
        if not safe:
            return None
        return re.compile("|".join(re.escape(c) for c in sorted(safe, key=len, reverse=True)))

    def chunk_cut_pattern(self) -> re.Pattern[str] | None:
        """Where a long segment may be cut again without changing its ids, or ``None``.

        Before a single space between two non-space characters, for a tokenizer with no
        normalizer, a BPE model without dropout, no added token that contains
        whitespace or strips it (``lstrip``/``rstrip``), and as pre-tokenizer GPT-2's
        regex (``ByteLevel`` with ``use_regex``, no ``add_prefix_space``) or Llama 3's or
        Qwen 2's ``Split`` regex followed by ``ByteLevel`` without its own. In each of
        those regexes only a whitespace run takes a space other than as its first
        character, so a piece ends before such a space (a non-space precedes it) and the
        next piece starts at it whatever came before; BPE merges within pieces, so the
        two sides encode as they do within the whole text. Python's ``\\S`` is narrower
        than the tokenizer's (``str.isspace`` counts more characters as whitespace), so
        it never allows a cut the tokenizer's regex would not."""
        spec = json.loads(self.tokenizer.to_str())
        model = spec.get("model") or {}
        if spec.get("normalizer") is not None or model.get("type") != "BPE" or model.get("dropout"):
            return None
        for a in spec.get("added_tokens") or ():
            if a.get("lstrip") or a.get("rstrip") or any(ch.isspace() for ch in a.get("content", "")):
                return None
        pre = spec.get("pre_tokenizer") or {}

        def byte_level(p: dict[str, Any], regex: bool) -> bool:
            return p.get("type") == "ByteLevel" and not p.get("add_prefix_space") and p.get("use_regex", True) == regex

        if byte_level(pre, True):
            return _CHUNK_CUT
        steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
        if steps and len(steps) == 2 and byte_level(steps[1], False):
            split = steps[0]
            if (split.get("type") == "Split" and split.get("behavior") == "Isolated" and not split.get("invert")
                    and (split.get("pattern") or {}).get("Regex") in _SEPARABLE_SPLITS):
                return _CHUNK_CUT
        return None

    def _chunk_ends(self, text: str, start: int, end: int) -> list[int]:
        """Where the chunks of segment ``text[start:end]`` end: at the first cut point
        :data:`CHUNK_CHARS` or more characters after the previous chunk's start, and at
        ``end``."""
        out = []
        if self._chunk_cut is not None:
            pos = start + CHUNK_CHARS
            while pos < end:
                m = self._chunk_cut.search(text, pos, end)
                if m is None:
                    break
                out.append(m.start())
                pos = m.start() + CHUNK_CHARS
        out.append(end)
        return out

    def text_tokenization(self, text: str, add_special_tokens: bool, truncate: int | None = None) -> Tokenization:
        """The tokenization of ``text``, cut at the special tokens that are safe cut
        points and looked up segment by segment in the prefix cache."""
        cache = self.cache
        if cache is None:
            _check_unicode(text)
            return Tokenization(self, [0] if text else [], [(b"", text)] if text else [], add_special_tokens, truncate)
        parts: list[array[int] | int] = []
        todo: list[tuple[bytes, str]] = []
        start = 0
        cuts = [m.start() for m in self._cuts.finditer(text)] if self._cuts is not None else []
        cuts.append(len(text))
        for cut in cuts:
            if cut - start < MIN_SEGMENT_CHARS and cut != len(text):
                continue
            if cut == start:
                continue
            for end in self._chunk_ends(text, start, cut):
                seg = text[start:end]
                try:
                    key = xxhash.xxh3_128_digest(seg.encode("utf-8"))
                except UnicodeEncodeError:
                    raise Unsupported("text with lone surrogates (not valid Unicode)") from None
                ids = cache.get(key)
                if ids is None:
                    parts.append(len(todo))
                    todo.append((key, seg))
                else:
                    parts.append(ids)
                start = end
        return Tokenization(self, parts, todo, add_special_tokens, truncate)


def _check_unicode(text: str) -> None:
    """Raises :class:`Unsupported` for text ``tokenizers`` cannot take: lone
    surrogates, which JSON's ``\\ud800`` escapes can carry."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise Unsupported("text with lone surrogates (not valid Unicode)") from None


def _overlaps(other: str, token: str) -> bool:
    """Whether an occurrence of added token ``other`` can cover the start of
    ``token`` without starting there (``token`` inside it, or a suffix of it being a
    prefix of ``token``): a cut before ``token`` would then split ``other``."""
    if token in other[1:]:
        return True
    return any(token.startswith(other[i:]) for i in range(1, len(other)))
