"""Continuing a stream by token ids (:mod:`gateway.pipeline.migration`): with the
model's tokenizer configured, a stream whose backend failed is continued by a
completions request whose prompt is the prompt's token ids followed by those of the
answer relayed so far (:meth:`gateway.apis.base.Api.token_continuation`), so the engine
re-renders and re-tokenizes nothing. The answer's ids are the engine's own when it
streamed them (``return_token_ids``, asked of the backends whose config says their
engine can: :func:`ask_token_ids`) and they decode to the text relayed, else the text
tokenized by the gateway; the prompt's are the engine's (its first chunk's
``prompt_token_ids``) or the gateway's tokenization of the prompt (the one routing
used)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.pipeline.context import Continuation, RequestContext
    from gateway.runtime import GatewayState


def by_token_ids(state: GatewayState, ctx: RequestContext, m: Continuation, data: dict[str, Any], text: str,
                 tokens: int, ids: list[int] | None,
                 prompt_ids: list[int] | None) -> tuple[dict[str, Any], list[int], int, str] | None:
    """The token continuation (:meth:`~gateway.apis.base.Api.token_continuation`) of
    request ``data`` after the leg that relayed ``text`` (``tokens`` tokens; ``ids``:
    their ids as its engine streamed them, or ``None``; ``prompt_ids``: the prompt's ids
    its engine reported, or ``None``), the ids of ``text`` it resends, the leg's tokens
    and where the ids came from (``"engine token ids"``, ``"token ids"``). The ids are
    the engine's when they decode to ``text`` (else a stop string or a character cut
    mid-token held back text that the ids hold), and the leg's tokens are then their
    count; else ``text`` tokenized by the model's tokenizer (the seam may then differ
    from what was generated, as with a text continuation) and ``tokens``. ``None``
    when there is no tokenizer, the API has no token continuation or refuses this one,
    the prompt's ids are unknown (its engine did not report them and the gateway could
    not render the prompt) or an earlier continuation was made from the text.
    Sets ``m.prompt_ids`` and, when unknown, ``m.prompt_tokens``."""
    api = ctx.parsed.api
    tokenizer = state.core.tokenizers.get(ctx.model)
    if tokenizer is None or api.token_leg is None or (m.used and m.leg is None):
        return None
    if m.prompt_ids is None:
        req = ctx.request
        known = prompt_ids if prompt_ids else (req.token_ids if req is not None else None)
        if not known:
            return None
        m.prompt_ids = list(known)
    if ids is not None and tokenizer.tokenizer.decode(ids, skip_special_tokens=True) == text:
        tokens, resent = len(ids), "engine token ids"
    else:
        ids, resent = (tokenizer.encode(text, False) if text else []), "token ids"
    token_ids = [*m.prompt_ids, *m.ids, *ids]
    limit = state.core.fleet.describe(ctx.model).max_model_len
    body = api.token_continuation(data, token_ids, m.tokens + tokens,
                                  limit - len(token_ids) if limit is not None else None)
    if body is None:
        return None
    if m.prompt_tokens is None:
        m.prompt_tokens = len(m.prompt_ids)
    return body, ids, tokens, resent


def ask_token_ids(state: GatewayState, ctx: RequestContext, body: bytes) -> bytes:
    """The streamed request ``body`` for a backend whose engine streams the token ids it
    generates when asked (``return_token_ids`` in its config): with ``"return_token_ids":
    true`` spliced in when the stream may be continued by token ids (its model's
    tokenizer configured, its API's token continuation, eligible for a continuation as
    :func:`gateway.pipeline.migration.scan_for` says; a token continuation always), else
    ``body``. A client that set the field itself gets its own choice."""
    data = ctx.data or ctx.parsed.data
    if "return_token_ids" in data:  # the client's own choice, carried by a token continuation too
        return body
    m = ctx.migration
    if m is None or not m.used:
        api = ctx.parsed.api
        if api.token_leg is None or not api.streams_token_ids or ctx.model not in state.core.tokenizers or \
                not state.cfg.migration.limit(ctx.model) or not api.continuable(data) or \
                (ctx.request is not None and ctx.request.remote_prefill):
            return body
    elif m.leg is None:
        return body
    i = body.find(b"{") + 1
    return body[:i] + b'"return_token_ids":true,' + body[i:]


def id_list(v: Any) -> bool:
    """Whether ``v`` is a list of token ids."""
    return isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v)
