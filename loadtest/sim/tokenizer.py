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

A model's own tokenizer instead: :class:`HFTokenizer` loads a Hugging Face
``tokenizer.json`` (the file vLLM's tokenizer reads beside the checkpoint), so prompt
token ids, and with them KV block boundaries and the ``token_ids`` of KV events, are
the ones a real engine serving that model computes. Both kinds offer the
:class:`Tokenizer` interface; :data:`EMULATOR` is the emulator's.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Protocol

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
    global _OUTPUT_IDS  # noqa: PLW0603 - filled once, at import
    # Keep only words that are exactly one piece, so generated text re-tokenizes exactly.
    _OUTPUT_IDS = tuple(piece_id(w) for w in _OUTPUT_WORDS if split(w) == [w])


_OUTPUT_IDS: tuple[int, ...] = ()
_remember_output_vocab()


def output_token_id(seed: int, index: int) -> int:
    """The ``index``-th generated token id (0-based) of a request seeded by ``seed``.

    Deterministic: a 64-bit integer mix (splitmix64 finalizer) of ``seed`` and
    ``index`` picks one word of the output vocabulary.
    """
    return _OUTPUT_IDS[_mix(seed, index) % len(_OUTPUT_IDS)]


def generate_text(seed: int, num_tokens: int) -> str:
    """Convenience: the text of the first ``num_tokens`` generated tokens for ``seed``."""
    return detokenize([output_token_id(seed, i) for i in range(num_tokens)])


# --- the interface the engine and server use ------------------------------------------


class Tokenizer(Protocol):
    """What the simulated engine and server need from a tokenizer.

    ``tokenize(text, add_special_tokens)``: prompt text -> token ids (a completions
    prompt is tokenized with ``add_special_tokens=True``, a rendered chat with False,
    as vLLM does). ``detokenize(ids)``: generated ids -> text (EOS and other special
    tokens decode to nothing). ``output_token_id(seed, i)``: the i-th generated token
    of a request; generated text re-tokenizes to the same ids. ``prompt_text(ids)``: a
    prompt given as ids -> its text, special tokens kept (a rendered chat's ids give
    the rendered text back). ``eos_token_id``;
    ``vocab_size``: ids of the vocabulary, added tokens included.
    """

    eos_token_id: int
    vocab_size: int  # token ids are in [0, vocab_size)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def detokenize(self, token_ids: list[int]) -> str: ...

    def prompt_text(self, token_ids: list[int]) -> str: ...

    def output_token_id(self, seed: int, index: int) -> int: ...


class EmulatorTokenizer:
    """:class:`Tokenizer` of this module's emulated vocabulary (no special tokens)."""

    eos_token_id = EOS_TOKEN_ID
    vocab_size = VOCAB_SIZE

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return tokenize(text)

    def detokenize(self, token_ids: list[int]) -> str:
        return detokenize(token_ids)

    def prompt_text(self, token_ids: list[int]) -> str:
        return detokenize(token_ids)

    def output_token_id(self, seed: int, index: int) -> int:
        return output_token_id(seed, index)


EMULATOR = EmulatorTokenizer()

# EOS token names tried, in order, when no tokenizer_config.json names one.
_EOS_NAMES = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "</s>", "<eos>")


class HFTokenizer:
    """:class:`Tokenizer` backed by a Hugging Face ``tokenizer.json`` (the ``tokenizers``
    library, in Rust).

    ``path``: a ``tokenizer.json`` file, or a model directory holding one. The EOS
    token is ``eos_token`` of a ``tokenizer_config.json`` beside it, else the first of
    ``<|im_end|>``, ``<|eot_id|>``, ``<|endoftext|>``, ``</s>``, ``<eos>`` in the
    vocabulary. Generated tokens are drawn from the emulator's English output words
    that are exactly one token of this vocabulary (so generated text re-tokenizes to
    the same ids). Raises ValueError for a missing or unreadable file, a tokenizer
    without an EOS token, or one without any single-token output word; ImportError
    with the install hint when ``tokenizers`` is missing.
    """

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError:
            raise ImportError("a tokenizer.json needs the `tokenizers` package: pip install tokenizers") from None
        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise ValueError(f"tokenizer: no tokenizer.json at {str(path)!r}")
        try:
            self._tok = _HF.from_file(str(file))
        except Exception as e:  # the library raises its own Exception subclass
            raise ValueError(f"tokenizer: cannot load {str(file)!r}: {e}") from None
        self.path = file
        eos = None
        cfg = file.parent / "tokenizer_config.json"
        if cfg.is_file():
            try:
                name = json.loads(cfg.read_text(encoding="utf-8")).get("eos_token")
            except (OSError, ValueError, AttributeError):
                name = None
            if isinstance(name, dict):
                name = name.get("content")
            if isinstance(name, str):
                eos = self._tok.token_to_id(name)
        for name in _EOS_NAMES:
            if eos is not None:
                break
            eos = self._tok.token_to_id(name)
        if eos is None:
            raise ValueError(f"tokenizer {str(file)!r}: no EOS token (name it as eos_token in a "
                             "tokenizer_config.json beside it)")
        self.eos_token_id = eos
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        out = []
        for w in _OUTPUT_WORDS:
            ids = self._tok.encode(w, add_special_tokens=False).ids
            if len(ids) == 1 and self._tok.decode(ids) == w:
                out.append(ids[0])
        if not out:
            raise ValueError(f"tokenizer {str(file)!r}: none of the output words is a single token")
        self._output_ids = tuple(out)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def detokenize(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)

    def prompt_text(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=False)

    def output_token_id(self, seed: int, index: int) -> int:
        return self._output_ids[_mix(seed, index) % len(self._output_ids)]


def _mix(seed: int, index: int) -> int:
    """A 64-bit integer mix (splitmix64 finalizer) of ``seed`` and ``index``."""
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 29
    return x
