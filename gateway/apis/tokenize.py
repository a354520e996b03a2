"""Tokenize and detokenize (``POST /tokenize``, ``POST /detokenize``), vLLM's shapes:

- ``/tokenize`` takes a prompt (``{"model", "prompt", "add_special_tokens": true}``) or a
  chat (``{"model", "messages", "tools", "add_generation_prompt": true,
  "continue_final_message": false, "add_special_tokens": false}``), ``return_token_strs``
  either way, and answers ``{"count", "max_model_len", "tokens", "token_strs"}``;
- ``/detokenize`` takes ``{"model", "tokens": [ids]}`` and answers ``{"prompt": text}``.

With the model's own tokenizer configured the gateway answers both itself (the chat
rendered by the model's template as vLLM renders it), no engine asked; otherwise, or
for what the tokenizer cannot reproduce (a per-request ``chat_template``, images), they
are routed like any API to a backend that serves them, on a prefill-only price.
llama.cpp's tokenize shape (``{"content", "add_special", "with_pieces"}``, with the
gateway's ``model``) is always forwarded: its answer's shape is the engine's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from gateway.apis.base import Api, Fields, check_chat_messages, missing, read_model
from gateway.errors import ClientError
from routing.core import ModelTokenizer


def _flag(data: dict[str, Any], field: str) -> None:
    v = data.get(field)
    if v is not None and not isinstance(v, bool):
        raise ClientError(400, f"`{field}` must be a boolean.", param=field, code="invalid_type")


class Tokenize(Api):
    """``POST /tokenize`` with a ``prompt`` (see the module docstring); its other forms
    are :class:`TokenizeChat` and :class:`TokenizeLlamaCpp` (:meth:`variant`)."""

    name, path, operation = "tokenize", "/tokenize", "tokenize"
    prompt_kind, prompt_param = "completions", "prompt"
    generates = False
    counts_tokens = True
    variants = True

    def variant(self, data: dict[str, Any]) -> Api:
        if "messages" in data:
            return TOKENIZE_CHAT
        return TOKENIZE_LLAMA_CPP if "content" in data and "prompt" not in data else self

    def read(self, data: dict[str, Any]) -> Fields:
        model = read_model(data)
        if not isinstance(data.get(self.prompt_param), str):
            raise missing(self.prompt_param, data, "a string")
        for field in ("add_special_tokens", "return_token_strs"):
            _flag(data, field)
        return Fields(model, False, True, 0)

    def tokenizer_answer(self, token_ids: Sequence[int], tokenizer: ModelTokenizer, data: dict[str, Any],
                         max_model_len: int | None) -> bytes | None:
        ids = list(token_ids)
        strs = [tokenizer.tokenizer.id_to_token(i) for i in ids] if data.get("return_token_strs") else None
        return orjson.dumps({"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs})


class TokenizeChat(Tokenize):
    """``POST /tokenize`` with ``messages``: rendered through the model's chat template."""

    prompt_kind, prompt_param = "chat", "messages"
    variants = False

    def read(self, data: dict[str, Any]) -> Fields:
        model = read_model(data)
        check_chat_messages(data)
        for field in ("add_generation_prompt", "continue_final_message", "add_special_tokens", "return_token_strs"):
            _flag(data, field)
        return Fields(model, False, True, 0)


class TokenizeLlamaCpp(Tokenize):
    """``POST /tokenize`` in llama.cpp's shape (``content``): always forwarded."""

    prompt_param = "content"
    exact_view = False  # never answered by the gateway: the engine's own answer shape
    variants = False

    def view(self, data: dict[str, Any]) -> dict[str, Any]:
        return {"prompt": data.get("content")}


class Detokenize(Api):
    """``POST /detokenize`` (see the module docstring)."""

    name, path, operation = "detokenize", "/detokenize", "detokenize"
    prompt_kind, prompt_param = "completions", "tokens"
    generates = False
    counts_tokens = True

    def read(self, data: dict[str, Any]) -> Fields:
        model = read_model(data)
        tokens = data.get("tokens")
        if not isinstance(tokens, list) or not tokens or not all(
                type(t) is int and 0 <= t < 1 << 32 for t in tokens):
            raise missing("tokens", data, "a non-empty array of token ids")
        return Fields(model, False, True, 0)

    def view(self, data: dict[str, Any]) -> dict[str, Any]:
        return {"prompt": data.get("tokens"), "add_special_tokens": False}

    def token_count_answer(self, prompt_tokens: int) -> bytes | None:
        return None  # an estimate has no text

    def tokenizer_answer(self, token_ids: Sequence[int], tokenizer: ModelTokenizer, data: dict[str, Any],
                         max_model_len: int | None) -> bytes | None:
        vocab = tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
        bad = next((t for t in token_ids if t >= vocab), None)
        if bad is not None:
            raise ClientError(400, f"Token id {bad} is out of vocabulary (size {vocab}).", param="tokens",
                              code="invalid_value")
        return orjson.dumps({"prompt": tokenizer.tokenizer.decode(list(token_ids), skip_special_tokens=False)})


TOKENIZE_CHAT, TOKENIZE_LLAMA_CPP = TokenizeChat(), TokenizeLlamaCpp()
