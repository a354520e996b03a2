"""Streams continued on another backend when theirs fails: ``migration``
(:mod:`gateway.pipeline.migration`)."""

from __future__ import annotations

from pydantic import Field

from gateway.config.base import Strict


class Migration(Strict):
    """A streamed chat, completions or Messages answer (Responses: with the model's
    tokenizer) whose backend fails after output reached the client (an engine crash, a
    reset, an idle or total timeout) is continued on another backend of the model: the
    prompt followed by the text already sent (with the model's `tokenizer`: their token
    ids, on `/v1/completions`), for the rest of `max_tokens`, relayed into the same
    stream (docs/failure-contract.md says which requests are continued and what the
    client and the ledger see). Requests that cannot be continued faithfully end with an
    error event, as with this off."""

    enabled: bool = Field(
        True, description="Continue eligible streams on another backend. Off: a stream whose backend fails after "
        "its first byte ends with an error event.")
    max_per_request: int = Field(
        1, ge=0, le=10, description="Continuations one stream may have (each one also counts as an attempt "
        "under `retries.max_attempts` and `retries.budget_s`); 0: none.")
    max_kept_bytes: int = Field(
        8 * 1024 * 1024, ge=0, description="Bytes of one stream kept while it is open, to read the text relayed "
        "if its backend fails (about 250 bytes per token of a chat stream). A stream that reads more is not "
        "continued (it ends with the error event) and its bytes are let go; 0: no stream is continued.")
    models: dict[str, int] = Field(
        {}, description="Per model (the `model` name clients send): its own `max_per_request` (0: never "
        "continue that model's streams).")

    def limit(self, model: str) -> int:
        """How many continuations a stream of ``model`` may have (0: none)."""
        return self.models.get(model, self.max_per_request) if self.enabled else 0
