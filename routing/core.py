"""The decision core: the one door from the data planes into ``routing/``.

It holds no HTTP and does no I/O on the request path. A data plane (the Python one in
``gateway/``; an Envoy endpoint picker next) gives it a parsed request and gets back
where the request goes; it then reports what happened, and the core learns from it::

    core = DecisionCore(specs, "estimated_ttft")
    tz = core.tokenization(model, endpoint, data)       # the model's own tokenizer, if configured
    tz.encode()                                         # (off the event loop when tz.offload)
    est, req = core.request(model, prompt_text, max_tokens, cache_salt,
                            token_ids=tz.token_ids())   # estimate
    plan = core.plan(req, now, long_prompt_tokens)      # pools: single or disaggregated
    decision, reservation = core.route(req, now)        # backend, explanation, load reserved
    reservation.first_token(t); reservation.outcome(ok, t); reservation.release(t, tokens)
    core.learn_usage(model, est.size_bytes, prompt_tokens, completion_tokens)
    core.learn_cached(decision, prompt_tokens, cached_tokens)   # the engine's reported prefix hit
    core.kv_event_batch(backend_name, rank, payload)    # an engine's KV events (ZMQ payload)

``Decision`` carries the chosen backend, the policy, the reason and the numbers behind
it (``detail``: ``matched_tokens``, ``ttft_est_s``); ``Reservation`` is the request's
load on that backend, released exactly once (:mod:`routing.fleet`). Startup and reload
both go through :meth:`DecisionCore.apply`, so a fleet is built one way.

Backends that publish KV-cache events (``BackendSpec.kv_block_size``) feed the prefix
index's token-exact entries through :meth:`DecisionCore.kv_event_batch`,
:meth:`DecisionCore.kv_event_gap` and :meth:`DecisionCore.kv_event_restart`; the
subscriber that reads their sockets (``gateway/engine_signals/kv_event_subscriber.py``) checks sequence numbers
with :class:`SequenceTracker`. A request whose token ids are known gets its
``token_keys`` for those backends' block sizes, computed once in :meth:`request`; a
model without such backends costs nothing more.

The names the data plane needs from ``routing/`` are re-exported here; ``gateway/``
imports nothing else of this package (``tests/unit/test_import_cycles.py`` checks it).
This module holds the core's state and the calls of one request; the core's other calls
are in two parts of it, each in its own module: what changes the fleet outside requests
(:mod:`routing.fleet_changes`: :meth:`~DecisionCore.apply`, served models, adapters, KV
capacity, restarts) and the engines' KV events (:mod:`routing.kv_event_intake`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from routing.backend import BackendSpec, BackendState, LoraActivity, ServedModel
from routing.estimate import PromptEstimate, TokenEstimator, canonical_prompt, chain_seed, token_block_keys
from routing.fleet import Fleet, NoBackendAvailable, Reservation, UnknownModel
from routing.fleet_changes import FleetChanges
from routing.kv_event_decoding import (
    DUPLICATE,
    GAP,
    OK,
    RESTART,
    KVEventStats,
    SequenceTracker,
)
from routing.kv_event_intake import KVEventIntake
from routing.load import EngineSample
from routing.policies import POLICIES, Decision, Match, RouteRequest, make_policy
from routing.policies.estimated_ttft import estimate_ttft
from routing.prefix_index import PrefixIndex
from routing.retry import (
    DEFAULT_BASE_BACKOFF_S,
    DEFAULT_FAILED_BACKEND_COOLDOWN_S,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_MAX_BACKOFF_S,
    RETRYABLE_STATUSES,
    RetryPolicy,
    retryable_status,
)
from routing.router import DECODE, PREFILL, SERVING, Plan, Router
from routing.sessions import SessionTable
from routing.store import RoutingStore, clear_remote_loads, fold_remote_loads, load_snapshot
from routing.tokenizer import DEFAULT_CACHE_TOKENS as DEFAULT_TOKENIZER_CACHE_TOKENS
from routing.tokenizer import ModelTokenizer, Tokenization, TokenizerError, TokenizeStats, Unsupported, load_tokenizer

__all__ = [
    "DECODE", "DEFAULT_TOKENIZER_CACHE_TOKENS", "DUPLICATE", "GAP", "OK", "POLICIES", "PREFILL", "RESTART", "SERVING",
    "BackendSpec", "BackendState", "Decision", "DecisionCore", "EngineSample", "Fleet", "KVEventStats", "LoraActivity",
    "Match", "ModelTokenizer", "NoBackendAvailable", "Plan", "PrefixIndex", "PromptEstimate", "Reservation",
    "RouteRequest", "RoutingStore", "SequenceTracker", "ServedModel", "SessionTable", "TokenizeStats", "Tokenization",
    "TokenizerError", "UnknownModel", "canonical_prompt", "clear_remote_loads", "estimate_ttft", "fold_remote_loads",
    "load_snapshot", "load_tokenizer", "DEFAULT_BASE_BACKOFF_S", "DEFAULT_FAILED_BACKEND_COOLDOWN_S",
    "DEFAULT_MAX_ATTEMPTS", "DEFAULT_MAX_BACKOFF_S", "RETRYABLE_STATUSES", "RetryPolicy", "retryable_status",
]


class DecisionCore(FleetChanges, KVEventIntake):
    """Estimate, plan, route and learn for one fleet.

    ``specs``: the backends; ``policy``: a name from :data:`routing.policies.POLICIES`;
    ``block_tokens``, ``prefix_ttl_s`` and ``prefix_index_max_blocks`` shape the prefix
    index (fixed for the core's life); ``speculative_s``: how long a token-exact entry
    recorded at dispatch waits for the engine's event (0: none recorded; changeable
    through ``core.index.speculative_s``). The view is this process's alone until a
    store that shares it is attached (:meth:`attach_store`). Raises ``ValueError`` on
    duplicate backend names and ``KeyError`` on an unknown policy.
    """

    def __init__(self, specs: list[BackendSpec], policy: str, *, block_tokens: int = 64,
                 prefix_ttl_s: float = 600.0, prefix_index_max_blocks: int = 2_000_000,
                 canaries: dict[str, tuple[str, str, float]] | None = None,
                 speculative_s: float = 5.0) -> None:
        self.fleet = Fleet([])
        self.estimator = TokenEstimator(block_tokens=block_tokens)
        self.index = PrefixIndex(ttl_s=prefix_ttl_s, max_blocks=prefix_index_max_blocks, speculative_s=speculative_s)
        self.kv_stats: dict[str, KVEventStats] = {}  # per backend publishing KV events
        self.policy_name = policy
        self.tokenizers: dict[str, ModelTokenizer] = {}
        self.tokenize_stats: dict[str, TokenizeStats] = {}
        self.router = Router(self.fleet, make_policy(policy), self.index, block_tokens=block_tokens)
        self.apply(specs, policy, canaries or {})

    def attach_store(self, store: RoutingStore) -> None:
        """Share this core's view with other replicas through ``store`` (built by the
        data plane on ``core.fleet`` and ``core.index``, see :mod:`routing.store`):
        every dispatch from now on is reported to it, without I/O."""
        self.router.store = store

    # ---- one request -----------------------------------------------------------------

    def tokenization(self, model: str, endpoint: str, data: dict[str, Any]) -> Tokenization | None:
        """The start of request ``data``'s tokenization by ``model``'s own tokenizer
        (``endpoint``: ``chat`` or ``completions``): rendered and looked up in the
        prefix cache, its encoding still to do (:meth:`Tokenization.encode`, off the
        event loop when :attr:`Tokenization.offload`). ``None`` when the model has no
        tokenizer or the prompt cannot be reproduced exactly (images, a per-request
        chat template, a template that raises: see :mod:`routing.tokenizer`); the
        request is then estimated as without a tokenizer."""
        tok = self.tokenizers.get(model)
        if tok is None:
            return None
        stats = self.tokenize_stats[model]
        try:
            tz = tok.tokenization(endpoint, data)
        except Unsupported:
            stats.unsupported += 1
            return None
        stats.exact += 1
        return tz

    def request(self, model: str, prompt_text: str, max_tokens: int | None, cache_salt: str | None = None,
                stream: bool = True, token_ids: Sequence[int] | None = None, subset: frozenset[str] | None = None,
                session: str | None = None) -> tuple[PromptEstimate, RouteRequest]:
        """Estimate a request (prompt tokens, prefix block hashes, expected output
        tokens) and the :class:`RouteRequest` that :meth:`plan` and :meth:`route` take
        (``stream``: its first token will be seen; ``subset``: the backends it may go to
        at all). ``token_ids``: the prompt's ids (from :meth:`tokenization`, or a
        completions prompt given as token ids), when there are: its token count is then
        exact, and ``token_keys`` holds its token-exact block keys for the block size of
        each backend of ``model`` that publishes KV events. ``session``: its session."""
        estimator = self.estimator
        est = estimator.estimate(model, prompt_text, max_tokens, cache_salt, token_ids)
        token_keys = None
        if token_ids is not None:
            if model in self.tokenize_stats:
                self.tokenize_stats[model].prompt_tokens += len(token_ids)
            token_keys = self.token_keys(model, token_ids, cache_salt)
        tokens_per_block = estimator.block_bytes / estimator.stats(model).bytes_per_token
        return est, RouteRequest(model, frozenset(), est.text, est.size_bytes, est.hashes, est.prompt_tokens,
                                 est.output_tokens, tokens_per_block, None, None, subset, False, stream, token_ids,
                                 token_keys, session)

    def wants_token_ids(self, model: str) -> bool:
        """Whether a backend of ``model`` publishes KV events (its requests' token ids,
        when known, make token-exact prefix keys); ``False`` costs a request nothing."""
        return model in self.router.event_backends

    def token_keys(self, model: str, token_ids: Sequence[int],
                   cache_salt: str | None = None) -> dict[int, tuple[int, ...]] | None:
        """The token-exact block keys of a prompt of ``model`` given as ``token_ids``, for
        the block sizes of the backends of ``model`` that publish KV events (``None``
        when none does): ``{block_size: keys}``, keyed as the engines' events are
        (:func:`routing.estimate.token_block_keys` chained from ``chain_seed(model,
        cache_salt)``)."""
        sizes = self.router.event_backends.get(model)
        if not sizes:
            return None
        seed = chain_seed(model, cache_salt)
        return {size: token_block_keys(token_ids, size, seed) for size in sizes}

    def context_exceeded(self, model: str, prompt_tokens: int, max_tokens: int | None) -> int | None:
        """``model``'s context length in tokens when an exactly counted prompt of
        ``prompt_tokens`` plus ``max_tokens`` (unset: at least one token) fits on no
        backend serving it (:meth:`Fleet.context_limit`), else ``None``. Call it only
        with an exact count (a tokenizer's): an estimate must never refuse a request."""
        limit = self.fleet.context_limit(model)
        if limit is None or prompt_tokens + (max_tokens or 1) <= limit:
            return None
        return limit

    def prompt_tokens(self, model: str, prompt_text: str) -> int:
        """The estimated prompt tokens of ``prompt_text`` (the same estimate routing
        uses, without hashing blocks): what per-key token limits charge up front."""
        return self.estimator.prompt_tokens(model, prompt_text)

    def plan(self, req: RouteRequest, now: float, long_prompt_tokens: int) -> Plan:
        """Which pools serve ``req`` (single, or a disaggregated prefill then decode).
        Raises :class:`UnknownModel`."""
        return self.router.plan(req, now, long_prompt_tokens)

    def route(self, req: RouteRequest, now: float) -> tuple[Decision, Reservation]:
        """Choose a backend for ``req`` at monotonic time ``now`` (seconds) and reserve
        its load. Raises :class:`UnknownModel` and :class:`NoBackendAvailable`."""
        return self.router.route(req, now)

    def reserve(self, req: RouteRequest, backend: BackendState, now: float) -> Reservation:
        """Reserve ``req``'s load on ``backend`` without choosing: a request that a
        proxy retried by itself was served by ``backend`` instead of the routed one."""
        return self.router.reserve(req, backend, now)

    def alternatives(self, req: RouteRequest, chosen: BackendState, now: float, limit: int) -> list[BackendState]:
        """Up to ``limit`` other backends for ``req`` after ``chosen``, soonest
        estimated TTFT first (nothing reserved): a proxy's retry order."""
        return self.router.alternatives(req, chosen, now, limit)

    def canary_pools(self, model: str) -> tuple[frozenset[str] | None, frozenset[str] | None]:
        """(pools this request may use, pools to fall back to) under a canary split."""
        return self.router.canary_pools(model)

    def cool_down(self, backend: BackendState, until: float) -> None:
        """Keep ``backend`` out of routing until monotonic time ``until`` (seconds)."""
        self.fleet.cool_down(backend, until)

    def learn_usage(self, model: str, prompt_bytes: int, prompt_tokens: int | None,
                    completion_tokens: int | None) -> None:
        """Learn bytes per token and typical output length from a response's ``usage``."""
        self.estimator.observe_usage(model, prompt_bytes, prompt_tokens, completion_tokens)

    def learn_cached(self, decision: Decision, prompt_tokens: int, cached_tokens: int) -> None:
        """The engine that served ``decision`` reported ``cached_tokens`` of its
        ``prompt_tokens`` cached: the session hit ratio, the engine's retention
        (:meth:`Router.learn_cached`)."""
        self.router.learn_cached(decision, prompt_tokens, cached_tokens)
