"""Deterministic emulator tokenizer: text <-> stable integer token ids.

What a token is (the whole definition):

* The text is cut by one regular expression into *pieces*. A piece is either
  - an optional run of whitespace followed by at most ``MAX_WORD_CHARS`` (4) word
    characters (``\\w``: letters, digits, underscore; a longer word continues in
    further pieces of at most 4 characters, without whitespace), or
  - an optional run of whitespace followed by one other non-space character
    (punctuation, symbol, emoji), or
  - a run of whitespace at the end of the text.
  So ``"Hello, world!"`` is ``["Hell", "o", ",", " worl", "d", "!"]``: 6 tokens.
  For English prose this gives about 1.3 tokens per word, close to the ~0.75
  words/token rule of thumb for BPE tokenizers such as Llama-3's; exact agreement
  with any real tokenizer is not a goal.
* The id of a piece is ``ID_BASE + (blake2b-64(piece UTF-8) mod ID_SPACE)``: a pure
  function of the piece, identical across processes and runs (no PYTHONHASHSEED
  dependence), so prompt lengths, KV block boundaries and chained block hashes agree
  everywhere. Ids fall in ``[ID_BASE, ID_BASE + ID_SPACE)`` = ``[256, 128256)``,
  Llama-3's vocabulary size (128,256), so they look like real ids.
* ``detokenize`` is exact for every piece this process has encoded or generated
  (a bounded reverse table); unknown ids decode to ``" <id>"``.

Output text: ``output_token_id(seed, i)`` deterministically picks the i-th generated
token from a small vocabulary of common English words (each one piece, with a
leading space), so ``encode(decode(generated_ids)) == generated_ids``: a multi-turn
conversation that sends the previous answer back gets the same ids and hits the
engine's prefix cache, as on a real engine.

Cost: one ``re.findall`` and one ``blake2b`` per piece, memoized in a bounded dict;
about 1 microsecond per token on a laptop once warm.
"""

from __future__ import annotations

import hashlib
import re

MAX_WORD_CHARS = 4
"""Longest run of word characters in one token (characters, not bytes)."""

ID_BASE = 256
"""Ids below this are reserved (EOS and specials); emulator ids start here."""

VOCAB_SIZE = 128_256
"""Llama-3 vocabulary size (meta-llama/Meta-Llama-3-8B config.json: vocab_size=128256)."""

ID_SPACE = VOCAB_SIZE - ID_BASE

EOS_TOKEN_ID = 2
"""Id reported for the emulated end-of-sequence token (never part of the text)."""

_PIECE_RE = re.compile(r"\s*\w{1,%d}|\s*[^\w\s]|\s+" % MAX_WORD_CHARS)

_MEMO_LIMIT = 200_000
_piece_to_id: dict[str, int] = {}
_id_to_piece: dict[int, str] = {}

# Common English words for generated text; each is a single piece (<= 4 word chars,
# leading space), so generated text re-tokenizes to the same ids, and every generated
# token is exactly one whitespace-separated word (no punctuation tokens): a client that
# counts words in the text counts tokens.
_OUTPUT_WORDS = (
    " the", " of", " and", " to", " a", " in", " is", " it", " that", " for",
    " was", " on", " are", " with", " as", " be", " at", " this", " have", " from",
    " or", " one", " had", " by", " word", " but", " not", " what", " all", " were",
    " we", " when", " your", " can", " said", " they", " each", " she", " which",
    " do", " how", " their", " if", " will", " up", " out", " many", " then", " them",
    " so", " some", " her", " make", " like", " him", " into", " time", " has", " look",
    " two", " more", " go", " see", " no", " way", " could", " my", " than", " been",
    " call", " who", " its", " now", " find", " long", " down", " day", " did", " get",
    " come", " made", " may", " part",
)


def piece_id(piece: str) -> int:
    """Stable token id of one piece (see module docstring); memoized."""
    tid = _piece_to_id.get(piece)
    if tid is None:
        digest = hashlib.blake2b(piece.encode("utf-8"), digest_size=8).digest()
        tid = ID_BASE + int.from_bytes(digest, "little") % ID_SPACE
        if len(_piece_to_id) >= _MEMO_LIMIT:
            _piece_to_id.clear()
            _id_to_piece.clear()
            _remember_output_vocab()
        _piece_to_id[piece] = tid
        _id_to_piece.setdefault(tid, piece)
    return tid


def split(text: str) -> list[str]:
    """The pieces (tokens as strings) of ``text``; ``"".join(split(t)) == t``."""
    return _PIECE_RE.findall(text)


def tokenize(text: str) -> list[int]:
    """Token ids of ``text``: one id per piece, deterministic across runs."""
    memo = _piece_to_id
    out = []
    for p in _PIECE_RE.findall(text):
        tid = memo.get(p)
        out.append(tid if tid is not None else piece_id(p))
    return out


def count_tokens(text: str) -> int:
    """Number of tokens in ``text`` (same as ``len(tokenize(text))``, cheaper)."""
    return len(_PIECE_RE.findall(text))


def detokenize(token_ids: list[int]) -> str:
    """Text of ``token_ids``; exact for ids this process has seen, ``" <id>"`` otherwise.

    The EOS id decodes to the empty string.
    """
    rev = _id_to_piece
    parts = []
    for tid in token_ids:
        if tid == EOS_TOKEN_ID:
            continue
        p = rev.get(tid)
        parts.append(p if p is not None else f" <{tid}>")
    return "".join(parts)


def _remember_output_vocab() -> None:
    global _OUTPUT_IDS
    # Keep only words that are exactly one piece, so generated text re-tokenizes exactly.
    _OUTPUT_IDS = tuple(piece_id(w) for w in _OUTPUT_WORDS if split(w) == [w])


_OUTPUT_IDS: tuple[int, ...] = ()
_remember_output_vocab()


def output_token_id(seed: int, index: int) -> int:
    """The ``index``-th generated token id (0-based) of a request seeded by ``seed``.

    Deterministic: a 64-bit integer mix (splitmix64 finalizer) of ``seed`` and
    ``index`` picks one word of the output vocabulary.
    """
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 29
    return _OUTPUT_IDS[x % len(_OUTPUT_IDS)]


def generate_text(seed: int, num_tokens: int) -> str:
    """Convenience: the text of the first ``num_tokens`` generated tokens for ``seed``."""
    return detokenize([output_token_id(seed, i) for i in range(num_tokens)])
