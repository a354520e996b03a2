"""The prefill leg of a disaggregated request (vLLM's disaggregated-serving proxy flow).

The prompt is first prefilled on a ``prefill`` backend (``max_tokens`` 1, not
streamed, ``kv_transfer_params.do_remote_decode``); its answer's ``kv_transfer_params``
then go with the request to a ``decode`` backend, which pulls the KV cache instead of
recomputing it. The leg is an attempt like any other: the same transport, deadlines,
retry policy and failure reporting (a failing prefill backend opens its circuit
breaker like any backend).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import orjson

from gateway.errors import UpstreamError
from gateway.pipeline import attempt, settlement
from gateway.pipeline.context import RequestContext
from routing.core import PREFILL, NoBackendAvailable, RouteRequest

if TYPE_CHECKING:
    from gateway.runtime import GatewayState

log = logging.getLogger("gateway.pipeline")

_PREFILL_ONLY = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


def _prefill_body(data: dict[str, Any]) -> bytes:
    data = dict(data)
    data.pop("stream_options", None)
    data.update(stream=False, max_tokens=1, kv_transfer_params=_PREFILL_ONLY)
    if "max_completion_tokens" in data:
        data["max_completion_tokens"] = 1
    return orjson.dumps(data)


async def run(state: GatewayState, ctx: RequestContext, base: RouteRequest) -> dict[str, Any] | None:
    """Prefill ``ctx``'s prompt on the ``prefill`` pool, retrying on other prefill
    backends as the retry policy allows. Returns the ``kv_transfer_params`` the decode
    leg must carry, or ``None`` when the leg failed (the caller falls back to a backend
    that computes the prompt itself). A client that goes away cancels the leg with the
    request (its connection is closed, the engine aborts)."""
    loop = state.loop
    policy = state.retry
    parsed = ctx.parsed
    body = _prefill_body(ctx.data or parsed.data)
    path = attempt.PATHS[parsed.endpoint]
    excluded: set[str] = set()
    started = loop.time()
    for attempts in range(1, policy.max_attempts + 1):
        req = RouteRequest(ctx.model, frozenset(excluded), base.prompt_text, base.prompt_bytes, base.block_hashes,
                           base.prompt_tokens, 1, base.tokens_per_block, PREFILL, stream=False,
                           token_ids=base.token_ids, token_keys=base.token_keys)
        try:
            decision, reservation = state.core.route(req, loop.time())
        except NoBackendAvailable:
            return None
        backend = decision.backend
        client = state.clients[backend.name]
        try:
            payload = await attempt.fetch(client, path, body, ctx.request_id)
            obj = orjson.loads(payload)
        except (UpstreamError, orjson.JSONDecodeError) as e:
            err = e if isinstance(e, UpstreamError) else UpstreamError(backend.name, f"invalid JSON: {e}")
            settlement.attempt_failed(state, backend, reservation, err)
            delay = policy.after_failure(err, attempts, started, loop.time())
            if delay is None:
                return None
            excluded.add(backend.name)
            await asyncio.sleep(delay)
            continue
        except BaseException:  # the client left (cancelled), or a bug
            reservation.release(loop.time())
            raise
        end = loop.time()
        reservation.first_token(end)
        reservation.outcome(True, end)
        reservation.release(end, 1)
        params = obj.get("kv_transfer_params") if isinstance(obj, dict) else None
        if isinstance(params, dict):
            return params
        log.warning("prefill backend %s returned no kv_transfer_params; falling back", backend.name)
        return None
    return None
