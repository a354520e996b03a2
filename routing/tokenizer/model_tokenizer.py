"""A model's own tokenizer: an OpenAI request body as the prompt's token ids, the way
vLLM's OpenAI server computes them (see :mod:`routing.tokenizer`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jinja2
from tokenizers import Tokenizer

from routing.tokenizer.chat_template import ChatTemplateRenderer, compile_chat_template, loops_over_content
from routing.tokenizer.errors import TokenizerError, Unsupported
from routing.tokenizer.prefix_cache import (
    DEFAULT_CACHE_TOKENS,
    PrefixCachedEncoder,
    SegmentCache,
    Tokenization,
    id_array,
)


@dataclass(frozen=True, slots=True)
class _Special:
    head: tuple[int, ...]
    tail: tuple[int, ...]


class ModelTokenizer(ChatTemplateRenderer, PrefixCachedEncoder):
    """One model's tokenizer and chat template (see :mod:`routing.tokenizer`).

    ``tokenizer``: a ``tokenizers.Tokenizer``; ``chat_template``: the Jinja source, or
    ``None`` (chat requests then give no token ids); ``special_tokens``: the template
    variables of transformers' special tokens map (``bos_token``, ``eos_token``...);
    ``add_bos_token``/``add_eos_token``: ``tokenizer_config.json``'s explicit values
    (``None``: the ``tokenizer.json`` post-processor decides); ``cache_tokens``: the
    prefix cache's bound in token ids (0: no cache). ``source`` names where it was
    loaded from (for messages). Raises :class:`TokenizerError` on a template syntax error.
    """

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None = None,
                 special_tokens: dict[str, Any] | None = None, *, add_bos_token: bool | None = None,
                 add_eos_token: bool | None = None, cache_tokens: int = DEFAULT_CACHE_TOKENS,
                 source: str = "<tokenizer>") -> None:
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self.tokenizer = tokenizer
        self.source = source
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self.template: jinja2.Template | None = None
        self.openai_content = False
        self.developer_to_system = False
        if chat_template is not None:
            try:
                self.template = compile_chat_template(chat_template)
            except jinja2.TemplateSyntaxError as e:
                raise TokenizerError(f"{source}: chat template syntax error at line {e.lineno}: {e.message}") from None
            self.openai_content = loops_over_content(chat_template)
        # vLLM's safe_apply_chat_template: a template that never names the developer
        # role gets developer messages as system messages, merged into one
        self.developer_to_system = chat_template is not None and not (
            '"developer"' in chat_template or "'developer'" in chat_template)
        self.cache = SegmentCache(cache_tokens) if cache_tokens > 0 else None
        sp = self._post_processor_specials(add_bos_token, add_eos_token)
        self.head, self.tail = sp.head, sp.tail
        self._cuts = self._cut_pattern()
        self._chunk_cut = self.chunk_cut_pattern()

    # ---- set-up -----------------------------------------------------------------------

    def _post_processor_specials(self, add_bos: bool | None, add_eos: bool | None) -> _Special:
        """The ids ``add_special_tokens=True`` puts before and after a prompt. Read from
        the post-processor on a probe text; ``tokenizer_config.json``'s explicit
        ``add_bos_token``/``add_eos_token`` rebuild them as transformers'
        ``update_post_processor`` does (``bos $A eos``)."""
        probe = "hello world"
        bare = self.tokenizer.encode(probe, add_special_tokens=False).ids
        full = self.tokenizer.encode(probe, add_special_tokens=True).ids
        head: tuple[int, ...] = ()
        tail: tuple[int, ...] = ()
        for i in range(len(full) - len(bare) + 1):
            if full[i:i + len(bare)] == bare:
                head, tail = tuple(full[:i]), tuple(full[i + len(bare):])
                break
        else:
            raise TokenizerError(f"{self.source}: the post-processor changes the prompt's own tokens; "
                                 "this tokenizer is not supported")
        for name, flag, where in (("bos_token", add_bos, "head"), ("eos_token", add_eos, "tail")):
            if flag is None:
                continue
            tid = self.token_id(self.special_tokens.get(name))
            if tid is None:
                continue
            if where == "head":
                head = (tid,) if flag else tuple(t for t in head if t != tid)
            else:
                tail = (tid,) if flag else tuple(t for t in tail if t != tid)
        return _Special(head, tail)

    def token_id(self, token: Any) -> int | None:
        """The id of a special token given as text (or ``None``)."""
        return self.tokenizer.token_to_id(token) if isinstance(token, str) else None
    # ---- tokenizing -------------------------------------------------------------------

    def tokenization(self, endpoint: str, data: dict[str, Any]) -> Tokenization:
        """The tokenization of request ``data`` (``endpoint``: ``chat`` or
        ``completions``). Raises :class:`Unsupported`."""
        truncate = data.get("truncate_prompt_tokens")
        if not (isinstance(truncate, int) and not isinstance(truncate, bool) and truncate > 0):
            truncate = None
        if endpoint == "chat":
            add_special = data.get("add_special_tokens", False)
            return self.text_tokenization(self.render_chat(data), bool(add_special), truncate)
        if data.get("prompt_embeds") is not None:
            raise Unsupported("prompt_embeds")
        prompt = data.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        add_special = data.get("add_special_tokens", True)
        if isinstance(prompt, str):
            return self.text_tokenization(prompt, bool(add_special is None or add_special), truncate)
        if isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in prompt):
            return Tokenization(self, [id_array(prompt)], [], False, truncate)
        raise Unsupported("a prompt that is neither one string nor one list of token ids")

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """``text``'s ids in one encoding, no cache (the reference the cached path
        equals)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


@dataclass(slots=True)
class TokenizeStats:
    """What one model's tokenizer did: requests tokenized exactly, requests it could
    not reproduce (estimated instead), and the exact prompt tokens counted."""

    exact: int = 0
    unsupported: int = 0
    prompt_tokens: int = 0
