"""A model's own tokenizer: prompts as the token ids the engine will compute.

A :class:`ModelTokenizer` holds a Hugging Face ``tokenizers`` tokenizer
(``tokenizer.json``) and the model's chat template (``tokenizer_config.json``), and
turns an OpenAI request body into the prompt's token ids the way vLLM's OpenAI server
does:

- **Chat** (``/v1/chat/completions``): the messages rendered with the chat template as
  vLLM renders them (:mod:`routing.tokenizer.chat_template`), the text tokenized with
  ``add_special_tokens`` false unless the request says otherwise (vLLM's chat default:
  the template writes its own BOS).
- **Completions** (``/v1/completions``): a string prompt is tokenized with
  ``add_special_tokens`` true (vLLM's default; the request may say otherwise); a
  prompt that is already token ids passes through unchanged.
- ``truncate_prompt_tokens`` (vLLM) keeps the last *n* ids.

What cannot be reproduced exactly raises :class:`Unsupported` (the caller keeps the
approximate estimate): images, audio and other non-text parts (the engine expands them
into placeholder tokens), a per-request ``chat_template``, several prompts in one
completions request, a template that raises.

One module per concept:

- :mod:`routing.tokenizer.model_tokenizer`: :class:`ModelTokenizer`, a request's
  tokenization and the special tokens around a prompt, and :class:`TokenizeStats`, what
  a model's tokenizer did;
- :mod:`routing.tokenizer.chat_template`: chat template rendering (transformers' Jinja
  environment, vLLM's message parsing);
- :mod:`routing.tokenizer.prefix_cache`: the prefix cache of encodings (segments cut at
  special tokens and in long messages, their ids in an LRU) and :class:`Tokenization`,
  one prompt on its way to ids, whose encoding may run off the event loop;
- :mod:`routing.tokenizer.loading`: :func:`load_tokenizer`, from a model's files;
- :mod:`routing.tokenizer.errors`: :class:`TokenizerError` and :class:`Unsupported`.
"""

from routing.tokenizer.chat_template import compile_chat_template
from routing.tokenizer.errors import TokenizerError, Unsupported
from routing.tokenizer.loading import load_tokenizer
from routing.tokenizer.model_tokenizer import ModelTokenizer, TokenizeStats
from routing.tokenizer.prefix_cache import DEFAULT_CACHE_TOKENS, OFFLOAD_CHARS, SegmentCache, Tokenization

__all__ = ["DEFAULT_CACHE_TOKENS", "OFFLOAD_CHARS", "ModelTokenizer", "SegmentCache", "TokenizeStats", "Tokenization",
           "TokenizerError", "Unsupported", "compile_chat_template", "load_tokenizer"]
