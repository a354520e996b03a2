"""The request context: one client request's state, the one type every step takes.

:class:`RequestContext` is made by the director (:mod:`gateway.pipeline.director`) once
the request was parsed and admitted, and handed to every step after it: the attempt
(:mod:`~gateway.pipeline.attempt`, or the endpoint picker's hand-off), the relay
(:mod:`~gateway.pipeline.relay`), settlement (:mod:`~gateway.pipeline.settlement`) and the
prefill leg (:mod:`~gateway.pipeline.prefill`). :data:`Send` is the type of the attempt
step. Steps import their types from here, never from one another.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gateway.errors import UpstreamError
from gateway.ops.metrics import GatewayMetrics
from gateway.pipeline.downstream import Downstream
from gateway.pipeline.keepalive import KeepAlives
from gateway.pipeline.openai_request import ParsedRequest
from gateway.pipeline.stream_scan import StreamScan
from gateway.tenancy.keys import ANONYMOUS
from routing.core import (
    Decision,
    NoBackendAvailable,
    PromptEstimate,
    Reservation,
    RouteRequest,
)

if TYPE_CHECKING:
    from gateway.apis.base import Api
    from gateway.ops.tracing import RequestTrace
    from gateway.runtime import GatewayState
    from gateway.upstream.client import BackendClient

# One attempt on one backend: ``(state, ctx, client, reservation)``; answers the client
# through ``ctx.down`` and settles, or raises an UpstreamError when the request may be
# tried elsewhere (see gateway.pipeline.attempt.run, gateway.epp.picker.hand_off).
Send = Callable[["GatewayState", "RequestContext", "BackendClient", Reservation], Awaitable[None]]

# Why a model could not serve a request: the last attempt's failure, or why no backend
# could be tried (exactly one of the two is set).
Failure = tuple[UpstreamError | None, NoBackendAvailable | None]


class ServedMetrics:
    """The metric children one answered request updates, for one (model, backend,
    pool, API): looked up once per (model, backend, pool, API) instead of once per update. Those
    with a further label are kept per label value as they are first asked for:
    :meth:`prefix` per routing evidence, :meth:`key_tokens` per key label."""

    __slots__ = ("_key_tokens", "_metrics", "_prefix", "cached_tokens", "completion_tokens", "e2e", "model", "ok",
                 "pool", "pool_ok", "pool_ttft", "predicted_cached_tokens", "prompt_tokens", "reported_prompt_tokens",
                 "ttft")

    def __init__(self, m: GatewayMetrics, model: str, backend: str, pool: str, api: str) -> None:
        self._metrics, self.model = m, model
        self.pool = pool
        self.ttft = m.child(m.ttft, model, api)
        self.pool_ttft = m.child(m.pool_ttft, pool)
        self.e2e = m.child(m.e2e, model, api)
        self.ok = m.child(m.requests, model, backend, "200")
        self.pool_ok = m.child(m.pool_requests, pool, "200")
        self.prompt_tokens = m.child(m.prompt_tokens, model, api)
        self.completion_tokens = m.child(m.completion_tokens, model, api)
        self.cached_tokens = m.child(m.cached_tokens, model, api)
        self.predicted_cached_tokens = m.child(m.predicted_cached_tokens, model)
        self.reported_prompt_tokens = m.child(m.reported_prompt_tokens, model)
        self._prefix: dict[str, tuple[Any, Any]] = {}
        self._key_tokens: dict[str, tuple[Any, Any, Any]] = {}

    def prefix(self, evidence: str) -> tuple[Any, Any]:
        """The (predicted, reported) cached prompt tokens children of routing ``evidence``."""
        c = self._prefix.get(evidence)
        if c is None:
            m = self._metrics
            c = self._prefix[evidence] = (m.child(m.prefix_predicted_tokens, evidence),
                                          m.child(m.prefix_reported_tokens, evidence))
        return c

    def key_tokens(self, key: str) -> tuple[Any, Any, Any]:
        """The (prompt, cached prompt, completion) token children of key label ``key``
        (:meth:`gateway.ops.metrics.GatewayMetrics.key_label`) for this model."""
        c = self._key_tokens.get(key)
        if c is None:
            m, model = self._metrics, self.model
            c = self._key_tokens[key] = (m.child(m.key_tokens, key, model, "prompt"),
                                         m.child(m.key_tokens, key, model, "cached_prompt"),
                                         m.child(m.key_tokens, key, model, "completion"))
        return c


class Continuation:
    """A stream that may be continued on another backend when its own fails
    (:mod:`gateway.pipeline.migration`, which reads and writes these fields): at most
    ``limit`` continuations, ``used`` so far; the text and tokens relayed by the legs
    that ended (``text``, ``tokens``); the client's stream's identity fields (``head``:
    ``id``, ``created``, ``model``) and prompt tokens when its first leg reported them;
    ``charged``: the (prompt, cached prompt, completion) tokens of each leg that ended;
    ``source`` and ``reason``: the backend whose failure is being continued and why;
    ``continuing``: a continuation is being attempted (its first bytes not yet relayed);
    ``resent``: what the last continuation resent of the answer (``"text"``, ``"token
    ids"`` of the gateway's tokenizer, ``"engine token ids"``), for its log line;
    a continuation by token ids: ``leg``, the adapter of its stream (its path upstream,
    :attr:`gateway.apis.base.Api.token_leg`; ``None``: the client's API), ``prompt_ids``
    and ``ids``, the prompt's token ids and those of the text relayed by the legs that
    ended."""

    __slots__ = ("charged", "continuing", "head", "ids", "leg", "limit", "prompt_ids", "prompt_tokens", "reason",
                 "resent", "source", "text", "tokens", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.text = ""
        self.tokens = 0
        self.head: dict[str, Any] = {}
        self.prompt_tokens: int | None = None
        self.charged: list[tuple[int, int, int]] = []
        self.source = self.reason = self.resent = ""
        self.continuing = False
        self.leg: Api | None = None
        self.prompt_ids: list[int] | None = None
        self.ids: list[int] = []


@dataclass(slots=True)
class RequestContext:
    """One client request's progress across attempts (and fallback models)."""

    down: Downstream  # where the answer goes
    parsed: ParsedRequest
    request_id: str
    arrival: float  # loop time the request arrived
    send: Send  # the attempt step: the gateway's own, or the endpoint picker's (gateway.epp.picker)
    model: str = ""  # the model being served: the requested one, or a fallback (routing.fallbacks)
    data: dict[str, Any] | None = None  # the request object for ``model``
    fallback_reason: str = ""  # why ``model`` is a fallback ("" when it is the requested model)
    keepalive: KeepAlives | None = None  # where its keep-alive comments fall due, while its first event is awaited
    backend: str = ""  # the backend of the current (or last) attempt
    estimate: PromptEstimate | None = None
    request: RouteRequest | None = None  # what the decision core routes on the current model
    decision: Decision | None = None
    body: bytes = b""  # what is sent upstream: the client's bytes unless a leg rewrote them
    scan: StreamScan | None = None  # the stream being relayed, if any
    attempts: list[tuple[str, float, str]] = field(default_factory=list)  # (backend, start time, outcome)
    tokens: int | None = None  # prompt + completion tokens of a completed response (per-key token limits)
    usage: tuple[int, int, int] | None = None  # (prompt, cached prompt, completion) tokens of a completed response
    key_name: str = ANONYMOUS  # the caller's key name, whose usage ledger counts it (gateway.tenancy.usage_ledger)
    route_details: bool = True  # x-turbo-route carries the cache details (auth.route_details)
    served: ServedMetrics | None = None  # the answering backend's metric children, once it answered
    ttft_s: float | None = None  # arrival to the answer's first byte (s), once it went out
    subset: frozenset[str] | None = None  # the only backends it may go to (a proxy's subset hint), None: any
    trace: RequestTrace | None = None  # its spans, with tracing on (gateway.ops.tracing)
    answer: bytes | None = None  # a whole (non-streamed) answer's body, once relayed
    migration: Continuation | None = None  # a stream that may be continued elsewhere (gateway.pipeline.migration)
