"""A model's own tokenizer: prompts as the token ids the engine will compute.

A :class:`ModelTokenizer` holds a Hugging Face ``tokenizers`` tokenizer
(``tokenizer.json``) and the model's chat template (``tokenizer_config.json``), and
turns an OpenAI request body into the prompt's token ids the way vLLM's OpenAI server
does:

- **Chat** (``/v1/chat/completions``): the messages are parsed as vLLM's
  ``entrypoints/chat_utils.py`` parses them (text parts joined by ``"\\n"`` for
  templates that take string content, kept as ``{"type": "text", "text"}`` parts for
  templates that loop over ``message['content']``; assistant ``tool_calls`` with their
  ``arguments`` parsed from JSON (``_postprocess_messages``), an empty list dropped;
  ``tool_call_id``, ``name``, ``reasoning``), then
  rendered with the chat template in the Jinja environment of transformers'
  ``apply_chat_template`` (``utils/chat_template_utils.py``:
  ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
  extensions=[loopcontrols])``, a ``tojson`` filter that does not escape HTML,
  ``raise_exception`` and ``strftime_now`` globals, the special tokens map as
  variables), with the request's ``add_generation_prompt`` (default true),
  ``continue_final_message``, ``documents``, ``tools`` and ``chat_template_kwargs``.
  The text is tokenized with ``add_special_tokens`` false unless the request says
  otherwise (vLLM's chat default: the template writes its own BOS).
- **Completions** (``/v1/completions``): a string prompt is tokenized with
  ``add_special_tokens`` true (vLLM's default; the request may say otherwise); a
  prompt that is already token ids passes through unchanged.
- ``truncate_prompt_tokens`` (vLLM) keeps the last *n* ids.

What cannot be reproduced exactly raises :class:`Unsupported` (the caller keeps the
approximate estimate): images, audio and other non-text parts (the engine expands them
into placeholder tokens), a per-request ``chat_template``, several prompts in one
completions request, a template that raises.

**Prefix cache.** Rendering a template costs little; encoding costs in proportion to the
prompt's tokens (``docs/results/routing_cost.md`` has the numbers). The rendered text is
cut into segments just before the tokenizer's special tokens (``<|im_start|>``...), and
each segment's ids are kept in an LRU keyed by the segment's 128-bit hash, so a
conversation's next turn encodes only its new text. Cutting there is exact:
``tokenizers`` splits its input at added tokens before the normalizer, pre-tokenizer
and model see it, so no BPE merge crosses such a point. Special tokens that absorb the
whitespace before them (``lstrip``), match only as whole words (``single_word``), match
on normalized text (``normalized``) or can overlap another added token are not cut
points. Special tokens the post-processor adds (BOS...) go once around the whole prompt.

A segment longer than :data:`CHUNK_CHARS` (one long message) is cut again about every
:data:`CHUNK_CHARS` characters, counted from its start, where the tokenizer allows it
(:meth:`ModelTokenizer.chunk_cut_pattern`: before a single space between two
non-space characters, for byte-level BPE tokenizers whose pre-tokenizer never lets a
token cross that point). A message that grows from one request to the next (an
agent's transcript, a document being extended) then re-encodes only its last chunk
and what was added; chunks are keyed by their text like segments.
"""

from __future__ import annotations

import json
import os
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import xxhash
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

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

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_JINJA = "chat_template.jinja"  # where transformers >= 4.47 saves the template

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# vLLM's text content parts and the field holding each one's text (chat_utils.MM_PARSER_MAP)
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "thinking": "thinking",
               "refusal": "refusal"}
_BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's per-request line, dropped by vLLM
# Split regexes (Llama 3's, Qwen 2's) after which, with ByteLevel(use_regex=False), a
# single space between two non-space characters always starts a new piece (see
# ModelTokenizer.chunk_cut_pattern)
_SEPARABLE_SPLITS = frozenset({  # the patterns as tokenizer.json spells them
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",  # noqa: E501
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
})
# chat_template_kwargs may not replace what the renderer itself passes
_RESERVED_KWARGS = frozenset({"messages", "tools", "documents", "chat_template", "tokenize"})


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded: a missing file, invalid JSON, a tokenizer
    ``tokenizers`` refuses, a chat template with a syntax error. The message names
    the file."""


# ---- the Jinja environment of transformers' apply_chat_template ----------------------

def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; transformers' does not.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)  # noqa: DTZ005 - local time, as transformers' strftime_now


class _Generation(jinja2.ext.Extension):
    """transformers' ``{% generation %}...{% endgeneration %}`` tag (it marks the
    assistant's tokens for training masks); rendering keeps its body unchanged."""

    tags = {"generation"}  # noqa: RUF012 - jinja2.ext.Extension declares it so

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def compile_chat_template(source: str) -> jinja2.Template:
    """``source`` compiled as transformers compiles a chat template. Raises
    ``jinja2.TemplateSyntaxError``."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _loops_over_content(source: str) -> bool:
    """Whether the template iterates over a message's ``content`` (``{% for part in
    message['content'] %}``): vLLM then passes content as a list of parts ("openai"
    content format) instead of a string (``chat_utils._detect_content_format``)."""
    try:
        ast = jinja2.Environment(extensions=[_Generation, jinja2.ext.loopcontrols]).parse(source)
    except jinja2.TemplateSyntaxError:
        return False
    for loop in ast.find_all(jinja2.nodes.For):
        node = loop.iter
        while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) and node.node is not None:
            node = node.node
        if isinstance(node, jinja2.nodes.Getattr) and node.attr == "content":
            return True
        if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const) \
                and node.arg.value == "content":
            return True
    return False


# ---- the prefix cache -----------------------------------------------------------------

class SegmentCache:
    """An LRU of segment token ids (``array('I')``) keyed by the segment text's 128-bit
    hash, bounded by ``max_tokens`` ids in all. Used from one thread (the event loop)."""

    def __init__(self, max_tokens: int = DEFAULT_CACHE_TOKENS) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self.hits = self.misses = 0
        self._lru: OrderedDict[bytes, array] = OrderedDict()

    def get(self, key: bytes) -> array | None:
        ids = self._lru.get(key)
        if ids is None:
            self.misses += 1
            return None
        self._lru.move_to_end(key)
        self.hits += 1
        return ids

    def put(self, key: bytes, ids: array) -> None:
        if len(ids) > self.max_tokens or key in self._lru:
            return
        self._lru[key] = ids
        self.tokens += len(ids)
        while self.tokens > self.max_tokens:
            _, old = self._lru.popitem(last=False)
            self.tokens -= len(old)

    def __len__(self) -> int:
        return len(self._lru)


def _ids(values: Sequence[int]) -> array:
    return array("I", values)


class Tokenization:
    """One prompt on its way to token ids: the segments the cache already had and
    the texts still to encode.

    :meth:`encode` does the expensive part and touches nothing shared, so it may run
    in another thread (see :attr:`offload`); :meth:`token_ids` then assembles the ids
    and fills the cache, on the thread that made the tokenization.
    """

    __slots__ = ("_tok", "_parts", "_todo", "_encoded", "_add_special", "_truncate", "uncached_chars")

    def __init__(self, tok: ModelTokenizer, parts: list[array | int], todo: list[tuple[bytes, str]],
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

    def token_ids(self) -> array:
        """The prompt's token ids (``array('I')``), encoding first if :meth:`encode`
        was not called. New segments go into the model's prefix cache."""
        self.encode()
        cache = self._tok.cache
        encoded = [_ids(e) for e in self._encoded] if self._encoded is not None else []
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


class Unsupported(Exception):
    """This request's prompt cannot be reproduced exactly (the caller keeps the
    approximate estimate); the message says why."""


@dataclass(frozen=True, slots=True)
class _Special:
    head: tuple[int, ...]
    tail: tuple[int, ...]


class ModelTokenizer:
    """One model's tokenizer and chat template (see the module docstring).

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
            self.openai_content = _loops_over_content(chat_template)
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

    # ---- rendering --------------------------------------------------------------------

    def render_chat(self, data: dict[str, Any]) -> str:
        """The chat request ``data``'s prompt text, rendered with the model's chat
        template as vLLM renders it. Raises :class:`Unsupported`."""
        if self.template is None:
            raise Unsupported("the model has no chat template")
        if data.get("chat_template") is not None:
            raise Unsupported("a per-request chat_template")
        messages = data.get("messages")
        if not isinstance(messages, list):
            raise Unsupported("no messages")
        conversation = [self._message(m) for m in messages]
        if self.developer_to_system and any(m["role"] == "developer" for m in conversation):
            conversation = _developer_as_system(conversation)
        user = data.get("chat_template_kwargs")
        if user is None:
            user = {}
        if not isinstance(user, dict) or _RESERVED_KWARGS & user.keys():
            raise Unsupported("chat_template_kwargs")
        # the request's own fields win over chat_template_kwargs unless null or "auto"
        # (vLLM's ChatCompletionRequest.build_chat_params and merge_kwargs)
        effort = data.get("reasoning_effort")
        fields = {"add_generation_prompt": data.get("add_generation_prompt", True),
                  "continue_final_message": data.get("continue_final_message", False),
                  "documents": data.get("documents"), "reasoning_effort": effort}
        if effort is not None and "enable_thinking" not in user:
            fields["enable_thinking"] = effort != "none"
        kwargs = {**user, **{k: v for k, v in fields.items() if v is not None and v != "auto"}}
        if kwargs.get("add_generation_prompt") is None:
            kwargs["add_generation_prompt"] = True
        if kwargs.get("continue_final_message") and kwargs["add_generation_prompt"]:
            raise Unsupported("add_generation_prompt with continue_final_message")  # vLLM answers 400
        documents = kwargs.pop("documents", None)
        return self._render(conversation, _tools(data.get("tools")), documents, **kwargs)

    def _message(self, m: Any) -> dict[str, Any]:
        """One message as vLLM's ``_parse_chat_message_content`` makes it."""
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise Unsupported("a message without a role")
        role = m["role"]
        content = m.get("content")
        if content is None:
            content = []
        elif isinstance(content, str):
            content = [content]
        elif not isinstance(content, list):
            raise Unsupported("content that is neither a string nor a list of parts")
        parts: list[str] = []
        for p in content:
            if isinstance(p, dict) and p.get("type") in _TEXT_PARTS:
                p = p.get(_TEXT_PARTS[p["type"]])
                if p is None:
                    continue
            if not isinstance(p, str):
                raise Unsupported("a non-text content part")
            if role == "system" and p.startswith(_BILLING_HEADER):
                p = p.partition("\n")[2]
                if not p:
                    continue
            parts.append(p)
        out: dict[str, Any] = {"role": role}
        if self.openai_content and role != "tool":
            out["content"] = [{"type": "text", "text": t} for t in parts]
        else:  # joined as strings, where vLLM drops the empty ones
            out["content"] = "\n".join(t for t in parts if t)
        if role == "assistant":
            calls = m.get("tool_calls")
            if calls:  # an empty list is dropped, so the template takes its plain assistant path
                if not isinstance(calls, list):
                    raise Unsupported("tool_calls that are not a list")
                out["tool_calls"] = [_tool_call(c) for c in calls]
            if m.get("reasoning") is not None:
                out["reasoning"] = out["reasoning_content"] = m["reasoning"]
        elif role == "tool" and "tool_call_id" in m:
            out["tool_call_id"] = m["tool_call_id"]
        for key in ("name", "task"):
            if isinstance(m.get(key), str):
                out[key] = m[key]
        if role == "developer":
            out["tools"] = m.get("tools")
        return out

    def _render(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                documents: Any, *, continue_final_message: bool = False, **kwargs: Any) -> str:
        """transformers' ``render_jinja_template`` for one conversation."""
        assert self.template is not None
        tag = "CONTINUE_FINAL_MESSAGE_TAG "
        final = ""
        if continue_final_message:
            content = conversation[-1].get("content") if conversation else None
            if isinstance(content, str):
                final = content
                conversation[-1] = {**conversation[-1], "content": final + tag}
            elif isinstance(content, list) and any("text" in p for p in content):
                at = max(i for i, p in enumerate(content) if "text" in p)  # the last text part
                final = content[at]["text"]
                content = [*content[:at], {**content[at], "text": final + tag}, *content[at + 1:]]
                conversation[-1] = {**conversation[-1], "content": content}
            else:
                raise Unsupported("continue_final_message without a final text message")
        try:
            text = self.template.render(messages=conversation, tools=tools, documents=documents,
                                        **{**self.special_tokens, **kwargs})
        except Exception as e:  # noqa: BLE001 - any failure of the template
            # raise_exception(), a sandbox refusal, a template bug: the engine refuses it too
            raise Unsupported(f"the chat template raised {type(e).__name__}: {e}") from None
        if continue_final_message:
            if final.strip() not in text or tag.strip() not in text:
                raise Unsupported("continue_final_message: the template dropped the final message")
            at = text.rindex(tag.strip())
            text = text[:at] if text[at:at + len(tag)] == tag else text[:at].rstrip()
        return text

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
            return Tokenization(self, [_ids(prompt)], [], False, truncate)
        raise Unsupported("a prompt that is neither one string nor one list of token ids")

    def text_tokenization(self, text: str, add_special_tokens: bool, truncate: int | None = None) -> Tokenization:
        """The tokenization of ``text``, cut at the special tokens that are safe cut
        points and looked up segment by segment in the prefix cache."""
        cache = self.cache
        if cache is None:
            _check_unicode(text)
            return Tokenization(self, [0] if text else [], [(b"", text)] if text else [], add_special_tokens, truncate)
        parts: list[array | int] = []
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

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """``text``'s ids in one encoding, no cache (the reference the cached path
        equals)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


_CHUNK_CUT = re.compile(r"(?<=\S) (?=\S)")


def _developer_as_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Developer messages become system messages (without their ``tools``), and the
    system messages are merged into one first message (``"\\n\\n"`` between their
    texts) when there is more than one or one that is not first, as vLLM's
    ``_convert_developer_to_system`` and ``_consolidate_system_messages`` do."""
    out = []
    for m in conversation:
        if m["role"] == "developer":
            m = {k: v for k, v in m.items() if k != "tools"}
            m["role"] = "system"
        out.append(m)
    texts: list[str] = []
    rest = []
    merge = False
    for i, m in enumerate(out):
        if m["role"] != "system":
            rest.append(m)
            continue
        merge = merge or i > 0 or bool(texts)
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] if isinstance(p, dict) else p for p in content
                                if isinstance(p, str) or (isinstance(p, dict) and "text" in p))
        if content:
            texts.append(content)
    if not merge:
        return out
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest]


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


def _tool_call(c: Any) -> dict[str, Any]:
    """An assistant tool call as vLLM passes it to the template: the fields of the
    OpenAI type in its declaration order (``id``, ``function`` with ``arguments`` and
    ``name``, ``type``; others dropped, as pydantic validates the request), then
    ``arguments`` parsed from their JSON string (``{}`` when empty) by
    ``_postprocess_messages``, as transformers' templates expect."""
    if not isinstance(c, dict) or c.get("type", "function") != "function" or not isinstance(c.get("function"), dict):
        raise Unsupported("a tool call that is not a function call")
    fn = c["function"]
    args = fn.get("arguments")
    if not args:
        args = {}
    elif not isinstance(args, (dict, list)):
        try:
            args = json.loads(args)
        except (TypeError, ValueError):
            raise Unsupported("tool call arguments that are not JSON") from None
    out: dict[str, Any] = {"id": c["id"]} if "id" in c else {}
    out["function"] = {"arguments": args, **({"name": fn["name"]} if "name" in fn else {})}
    if "type" in c:
        out["type"] = c["type"]
    return out


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    """``tools`` as vLLM dumps its pydantic models for the template
    (``ChatCompletionToolsParam``, ``FunctionDefinition``): ``type``, then
    ``function`` with ``name``, ``description`` and ``parameters`` (``None`` when
    absent), ``strict`` and ``defer_loading`` only when set; other fields dropped."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise Unsupported("tools that are not a list")
    out = []
    for t in tools:
        if (not isinstance(t, dict) or t.get("type", "function") != "function"
                or not isinstance(t.get("function"), dict)):
            raise Unsupported("a tool that is not a function")
        fn = t["function"]
        if not isinstance(fn.get("name"), str):
            raise Unsupported("a function without a name")
        f = {"name": fn["name"], "description": fn.get("description"), "parameters": fn.get("parameters")}
        defer = fn.get("defer_loading")
        if defer is None:
            defer = t.get("defer_loading")
        if fn.get("strict") is not None:
            f["strict"] = fn["strict"]
        if defer is not None:
            f["defer_loading"] = defer
        tool: dict[str, Any] = {"type": "function", "function": f}
        if t.get("defer_loading") is not None:
            tool["defer_loading"] = t["defer_loading"]
        out.append(tool)
    return out


# ---- loading from files ---------------------------------------------------------------

def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read: {e.strerror or e}") from None
    except ValueError as e:
        raise TokenizerError(f"{path}: invalid JSON: {e}") from None


def _token_text(v: Any) -> Any:
    """A special token as ``tokenizer_config.json`` writes it: a string, or an
    ``AddedToken`` object (``{"content": ...}``)."""
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return v


def _config_template(cfg: dict[str, Any], path: Path) -> str | None:
    t = cfg.get("chat_template")
    if t is None or isinstance(t, str):
        return t
    if isinstance(t, list):  # named templates: the default one, as vLLM picks without a request override
        for item in t:
            if isinstance(item, dict) and item.get("name") == "default" and isinstance(item.get("template"), str):
                return item["template"]
        return None
    raise TokenizerError(f"{path}: `chat_template` must be a string or a list of {{name, template}}")


# (tokenizer.json, template file, cache bound) -> (the files' versions, the tokenizer)
_loaded: dict[tuple[str, str | None, int], tuple[tuple, ModelTokenizer]] = {}
_loaded_lock = threading.Lock()


def _versions(*paths: Path | None) -> tuple:
    """Each file's (mtime, size), or ``None`` when absent: what says a file changed."""
    out = []
    for p in paths:
        try:
            st = p.stat() if p is not None else None
        except OSError:
            st = None
        out.append((st.st_mtime_ns, st.st_size) if st is not None else None)
    return tuple(out)


def load_tokenizer(path: str | os.PathLike[str], chat_template: str | os.PathLike[str] | None = None,
                   cache_tokens: int = DEFAULT_CACHE_TOKENS) -> ModelTokenizer:
    """Load a model's tokenizer from ``path``: a ``tokenizer.json`` file, or a
    directory holding ``tokenizer.json`` and optionally ``tokenizer_config.json``
    (chat template, special tokens, ``add_bos_token``/``add_eos_token``),
    ``special_tokens_map.json`` and ``chat_template.jinja``. ``chat_template``: a
    file whose text replaces the model's template (vLLM's ``--chat-template``).

    The same unchanged files give the same object (loaded once: config validation,
    start-up and reload share it). Raises :class:`TokenizerError` naming the file.
    """
    p = Path(path)
    if p.is_dir():
        tok_json = p / TOKENIZER_JSON
        cfg_path: Path | None = p / TOKENIZER_CONFIG
        if not tok_json.is_file():
            raise TokenizerError(f"{p}: no {TOKENIZER_JSON} in this directory")
    elif p.is_file():
        tok_json, cfg_path = p, None
    else:
        raise TokenizerError(f"{p}: no such file or directory")
    tpl_path = Path(chat_template) if chat_template is not None else None
    extra = (p / "special_tokens_map.json", p / CHAT_TEMPLATE_JINJA) if cfg_path is not None else (None, None)
    key = (str(tok_json), str(tpl_path) if tpl_path is not None else None, cache_tokens)
    versions = _versions(tok_json, cfg_path, tpl_path, *extra)
    with _loaded_lock:
        hit = _loaded.get(key)
        if hit is not None and hit[0] == versions:
            return hit[1]
        tok = _load(tok_json, cfg_path, tpl_path, cache_tokens)
        _loaded[key] = (versions, tok)  # replaces an older version of the same files
        return tok


def _load(tok_json: Path, cfg_path: Path | None, tpl_path: Path | None, cache_tokens: int) -> ModelTokenizer:
    try:
        tokenizer = Tokenizer.from_file(str(tok_json))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for a malformed file
        _read_json(tok_json)  # raises with a clear message when the file is not JSON at all
        raise TokenizerError(f"{tok_json}: not a valid tokenizers tokenizer: {e}") from None
    cfg: dict[str, Any] = {}
    template: str | None = None
    special: dict[str, Any] = {}
    add_bos = add_eos = None
    if cfg_path is not None:
        if cfg_path.is_file():
            loaded = _read_json(cfg_path)
            if not isinstance(loaded, dict):
                raise TokenizerError(f"{cfg_path}: a JSON object is expected")
            cfg = loaded
            template = _config_template(cfg, cfg_path)
        stm = cfg_path.parent / "special_tokens_map.json"
        overlay = _read_json(stm) if stm.is_file() else {}
        for name in _SPECIAL_NAMES:
            v = _token_text(overlay.get(name, cfg.get(name)))
            if isinstance(v, str):
                special[name] = v
        extra = overlay.get("additional_special_tokens", cfg.get("additional_special_tokens"))
        if isinstance(extra, list):
            special["additional_special_tokens"] = [_token_text(v) for v in extra]
        if isinstance(cfg.get("add_bos_token"), bool):
            add_bos = cfg["add_bos_token"]
        if isinstance(cfg.get("add_eos_token"), bool):
            add_eos = cfg["add_eos_token"]
        jinja_file = cfg_path.parent / CHAT_TEMPLATE_JINJA
        if template is None and jinja_file.is_file():
            template = _read_text(jinja_file)
    if tpl_path is not None:
        template = _read_text(tpl_path)
    return ModelTokenizer(tokenizer, template, special, add_bos_token=add_bos, add_eos_token=add_eos,
                          cache_tokens=cache_tokens, source=str(tok_json.parent if cfg_path else tok_json))


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{path}: not UTF-8 text: {e}") from None


__all__ = ["DEFAULT_CACHE_TOKENS", "OFFLOAD_CHARS", "ModelTokenizer", "SegmentCache", "Tokenization",
           "TokenizerError", "Unsupported", "compile_chat_template", "load_tokenizer"]
