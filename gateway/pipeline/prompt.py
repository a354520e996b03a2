"""Estimating the prompt: what the decision core routes on.

:func:`estimate` tokenizes the prompt with the model's own tokenizer when one is
configured (else the decision core estimates it from its bytes), asks the decision core
for the prompt's estimate and routing input (``ctx.estimate``, ``ctx.request``) and
refuses, unsent, a prompt whose exact token count fits no backend of the model;
:func:`counted_here` answers a request whose answer is that count (count_tokens,
input_tokens, tokenize), and :func:`estimated_here` with the estimate when no backend
serves its API.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from gateway.errors import REQUEST_ID_HEADER, ApiNotServed, BackendStatus
from gateway.pipeline import settlement
from gateway.pipeline.context import Failure, RequestContext
from gateway.pipeline.engine_errors import context_length_exceeded
from gateway.pipeline.openai_request import LARGE_BODY_BYTES, off_loop, prompt_token_ids

if TYPE_CHECKING:
    from gateway.runtime import GatewayState
    from routing.core import Tokenization


async def estimate(state: GatewayState, ctx: RequestContext) -> Failure | None:
    """Estimate ``ctx``'s prompt on ``ctx.model`` and set ``ctx.estimate`` and
    ``ctx.request``. Returns the context-length failure (an OpenAI 400, as an engine
    would answer it) when an exact count shows that it fits no backend, else ``None``."""
    parsed = ctx.parsed
    tz = tokenization(state, ctx)
    token_ids: Sequence[int] | None
    if tz is None or isinstance(tz, list):
        token_ids = tz
    else:
        if tz.offload:  # a long encoding: in the loop's default executor (tokenizers releases the GIL)
            await state.loop.run_in_executor(None, tz.encode)
        token_ids = tz.token_ids()
    args = (ctx.model, parsed.prompt_text, parsed.max_tokens, parsed.cache_salt, parsed.stream, token_ids, ctx.subset,
            parsed.session)
    if len(parsed.body) < LARGE_BODY_BYTES:  # the usual request: estimated at once, no coroutine to await
        ctx.estimate, req = state.core.request(*args)
    else:
        ctx.estimate, req = await off_loop(len(parsed.body), state.core.request, *args)
    ctx.request = req
    if token_ids is not None:  # an exact count: a prompt that fits on no backend is refused unsent
        limit = state.core.context_exceeded(ctx.model, len(token_ids), parsed.max_tokens)
        if limit is not None and not parsed.api.counts_tokens:  # a count of it is still answered
            answer = context_length_exceeded(limit, len(token_ids), parsed.max_tokens, parsed.endpoint)
            return BackendStatus("", answer[0], answer[1], "application/json", openai=answer), None
    return None


def tokenization(state: GatewayState, ctx: RequestContext) -> Tokenization | list[int] | None:
    """The tokenization of ``ctx``'s prompt by ``ctx.model``'s own tokenizer (its
    encoding still to do: :meth:`~routing.core.Tokenization.encode`, off the event loop
    when it is long, so other requests go on meanwhile; the prefix cache makes a
    conversation's next turn short), the prompt's token ids when it came as ids, or
    ``None`` (no tokenizer, or a prompt it cannot reproduce). The prompt
    is the API adapter's view of the request (a Responses or Messages request as the
    chat it renders); an API whose view is not what the engine tokenizes (rerank,
    score) is not tokenized. Without a tokenizer, a completions prompt given as token
    ids is taken as it is when a backend of the model publishes KV events (its
    token-exact keys need them)."""
    data, api = ctx.data or ctx.parsed.data, ctx.parsed.api
    tz = state.core.tokenization(ctx.model, api.prompt_kind, api.view(data)) if api.exact_view else None
    if tz is None:
        if api.name == "completions" and state.core.wants_token_ids(ctx.model):
            return prompt_token_ids(data)
        return None
    return tz


def counted_here(state: GatewayState, ctx: RequestContext) -> bool:
    """Answer ``ctx`` from its prompt's token ids when the API's answer is computed from
    them (:meth:`gateway.apis.base.Api.tokenizer_answer`: Anthropic's count_tokens,
    input_tokens, tokenize, detokenize) and the model's own tokenizer gave them;
    whether it did. No engine is asked. Raises :class:`~gateway.errors.ClientError`
    400 (a token id out of the vocabulary)."""
    req, model = ctx.request, ctx.model
    tokenizer = state.core.tokenizers.get(model)
    if req is None or req.token_ids is None or tokenizer is None:
        return False
    body = ctx.parsed.api.tokenizer_answer(req.token_ids, tokenizer, ctx.data or ctx.parsed.data,
                                           state.core.fleet.describe(model).max_model_len)
    if body is None:
        return False
    settlement.finish(state, ctx, 200)
    ctx.down.respond(200, body, {"Content-Type": "application/json", REQUEST_ID_HEADER: ctx.request_id})
    return True


ESTIMATED_HEADER = "x-turbo-token-count"  # "estimated": a token count the gateway estimated, no tokenizer exact


def estimated_here(state: GatewayState, ctx: RequestContext, failure: Failure) -> bool:
    """Answer ``ctx``, a request whose answer is its prompt's token count, with the
    gateway's estimate of it when no backend of its model serves its API
    (``failure``: :class:`~gateway.errors.ApiNotServed`); whether it did. The answer
    says ``x-turbo-token-count: estimated``."""
    est, (err, _) = ctx.estimate, failure
    if est is None or not isinstance(err, ApiNotServed):
        return False
    body = ctx.parsed.api.token_count_answer(est.prompt_tokens)
    if body is None:
        return False
    settlement.finish(state, ctx, 200)
    ctx.down.respond(200, body, {"Content-Type": "application/json", REQUEST_ID_HEADER: ctx.request_id,
                                 ESTIMATED_HEADER: "estimated"})
    return True
