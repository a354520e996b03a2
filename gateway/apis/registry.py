"""The APIs the gateway serves, by name and by client path. Adding an API is adding
its adapter module and one line to :data:`APIS`."""

from __future__ import annotations

from gateway.apis.anthropic_messages import CountTokens, Messages
from gateway.apis.base import Api
from gateway.apis.openai_completions import ChatCompletions, Completions
from gateway.apis.pooling import Embeddings, Rerank, Score
from gateway.apis.responses import InputTokens, Responses
from gateway.apis.tokenize import Detokenize, Tokenize

APIS: tuple[Api, ...] = (ChatCompletions(), Completions(), Responses(), InputTokens(), Messages(), CountTokens(),
                         Embeddings(), Rerank(), Score(), Tokenize(), Detokenize())
BY_NAME: dict[str, Api] = {a.name: a for a in APIS}
BY_PATH: dict[str, Api] = {p: a for a in APIS for p in (a.path, *a.aliases)}  # canonical client path -> API
CHAT, COMPLETIONS = BY_NAME["chat"], BY_NAME["completions"]
