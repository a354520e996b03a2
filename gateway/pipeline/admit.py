"""Admission: whether and when an authenticated, parsed request may be routed.

A :class:`Ticket` holds what admitting one request took (a place in the batch gate, the
caller's limits permit, the admission queue's charge) and gives it all back once, in
:meth:`Ticket.release`, with the tokens the request was answered with. Admission raises
:class:`~gateway.errors.ClientError` 429 (a key over its limits) or 503 (a saturated
fleet); what it took before raising is still released by :meth:`Ticket.release`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway.pipeline.context import RequestContext
from gateway.pipeline.openai_request import ParsedRequest
from gateway.tenancy.keys import Caller

if TYPE_CHECKING:
    from gateway.runtime import GatewayState


class Ticket:
    """What admitting one request holds until it is settled."""

    __slots__ = ("charge", "gate", "kv", "permit")

    def __init__(self) -> None:
        self.gate: Any = None  # gateway.batch.batch_gate.BatchGate, once entered
        self.kv = 0.0  # the KV tokens the gate counts for it
        self.permit: Any = None  # gateway.tenancy.limits.Permit
        self.charge: Any = None  # gateway.tenancy.fair_queue.Charge

    async def admit(self, state: GatewayState, caller: Caller, parsed: ParsedRequest, batch: bool,
                    in_process: bool, arrival: float) -> float:
        """Admit ``parsed`` for ``caller``: the caller's limits first (a token limit
        charges the prompt and ``max_tokens`` up front), then the batch gate when it is
        a batch line (``batch``: ``x-turbo-priority: batch`` from a key granted it, or
        ``in_process``, a batch line served without a socket, under its owner's
        limits), then the admission queue. Returns the request's arrival time: a batch
        line's TTFT starts once the gate let it in."""
        key = caller.key
        adm = state.cfg.admission
        charged = adm.max_in_flight_per_backend is not None and (
            adm.fairness == "tokens" or (adm.session_fairness == "las" and parsed.session is not None))
        token_limit = key is not None and key.tokens_per_minute is not None
        prompt = state.core.prompt_tokens(parsed.model, parsed.prompt_text) if charged or token_limit else 0
        self.permit = state.limiter.acquire(key, prompt + (parsed.max_tokens or 0) if token_limit else 0.0)
        gate = state.batch_gate
        if gate is not None and (batch or in_process):
            self.kv = await gate.enter(parsed)
            self.gate = gate  # entered: left in release()
            arrival = state.loop.time()
        adm_queue = state.admission
        session = parsed.session
        charge = adm_queue.admit_now(parsed.model, caller.name, prompt, caller.weight, session)
        if charge is None:  # it queues
            charge = await adm_queue.admit(parsed.model, caller.name, caller.priority, prompt, caller.weight,
                                           session)
        self.charge = charge
        return arrival

    def release(self, state: GatewayState, ctx: RequestContext | None) -> None:
        """Give back what admission took, correcting the charges to what ``ctx`` (``None``:
        it never got that far) was answered with."""
        dispatched = ctx is not None and bool(ctx.attempts)
        if self.charge is not None:
            prompt_used, cached, completion = (ctx.usage if ctx is not None else None) or (None, None, None)
            self.charge.settle(prompt_used, completion, dispatched=dispatched, cached_tokens=cached)
        if self.permit is not None:
            self.permit.release(ctx.tokens if ctx is not None else None, dispatched=dispatched)
            state.admission.pump()
        if self.gate is not None:
            self.gate.leave(self.kv)
