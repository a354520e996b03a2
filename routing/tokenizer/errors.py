"""The errors of a model's tokenizer: one that cannot be loaded, and a prompt it
cannot reproduce exactly."""

from __future__ import annotations


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded: a missing file, invalid JSON, a tokenizer
    ``tokenizers`` refuses, a chat template with a syntax error. The message names
    the file."""


class Unsupported(Exception):
    """This request's prompt cannot be reproduced exactly (the caller keeps the
    approximate estimate); the message says why."""
