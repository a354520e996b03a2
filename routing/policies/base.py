"""The policy interface: what a policy may know of a request (:class:`RouteRequest`)
and of the fleet's caches for it (:class:`Match`), what it answers (:class:`Decision`)
and the :class:`Policy` protocol itself."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

import msgspec

from routing.backend import BackendState


class RouteRequest(msgspec.Struct, frozen=True, gc=False):
    """What a policy may know about a request: immutable, built once by the decision
    core (:meth:`routing.core.DecisionCore.request`) and given a new scope with
    :func:`msgspec.structs.replace` when an attempt changes it. What the router finds
    for it at one moment (prefix matches, the time) is a :class:`Match`, not part of it.
    A frozen msgspec struct: setting a field raises ``AttributeError``, and its fields
    are read as fast as slots (the router and the policies read them many times per
    request); ``gc=False``: it holds no reference back to itself, so the cyclic
    garbage collector need not track it.

    - ``model``: the requested model name.
    - ``exclude``: backend names that must not be chosen (they already failed it).
    - ``prompt_text``: the canonical prompt text (see :mod:`routing.estimate`), the
      string the ``cache_aware`` baseline matches in its radix trees.
    - ``prompt_bytes``: its length in UTF-8 bytes.
    - ``block_hashes``: chained hashes of its fixed-size blocks (block ``i``'s hash
      covers blocks ``0..i``), the key of the prefix index.
    - ``prompt_tokens``: estimated prompt length in tokens.
    - ``output_tokens``: expected completion length in tokens.
    - ``tokens_per_block``: estimated tokens in one prefix block.
    - ``roles``: pool roles the backend may have (``None``: any).
    - ``pools``: pool names the backend may belong to (``None``: any), set by a
      canary split (see :meth:`routing.router.Router.canary_pools`).
    - ``subset``: backend names the request may go to at all (``None``: any), e.g.
      a proxy's subset hint; unlike ``exclude`` it is never relaxed.
    - ``remote_prefill``: the prompt's KV arrives by transfer (decode leg of a
      disaggregated request): the backend computes no prefill for it.
    - ``stream``: the answer is streamed, so its first token will be seen (a whole
      answer shows only its end).
    - ``token_ids``: the prompt's token ids as the engine will see them, when the
      model's tokenizer is known (``None`` otherwise).
    - ``token_keys``: the token-exact keys of the prompt's full blocks per engine
      block size (``{block_size: keys}``, see :func:`routing.estimate.token_block_keys`),
      computed from ``token_ids``: the key of precise prefix entries.
    - ``session``: the session the request is a turn of (an opaque id the data plane
      scoped by the caller's key; ``None``: none), whose home the router looks up
      (:mod:`routing.sessions`).
    """

    model: str
    exclude: frozenset[str] = frozenset()
    prompt_text: str = ""
    prompt_bytes: int = 0
    block_hashes: tuple[int, ...] = ()
    prompt_tokens: int = 0
    output_tokens: int = 0
    tokens_per_block: float = 64.0
    roles: frozenset[str] | None = None
    pools: frozenset[str] | None = None
    subset: frozenset[str] | None = None
    remote_prefill: bool = False
    stream: bool = True
    token_ids: Sequence[int] | None = None
    token_keys: dict[int, tuple[int, ...]] | None = None
    session: str | None = None


NOTHING: Mapping[str, int] = MappingProxyType({})  # no backend holds anything


@dataclass(slots=True)
class Match:
    """What the router found for one :class:`RouteRequest` at one moment, which the
    policy chooses on (the router's own working state, built by
    :meth:`routing.router.Router.match`):

    - ``request``: the request matched;
    - ``now``: the monotonic time (seconds) of the match;
    - ``matched_blocks``: per backend, leading approximate blocks it probably holds;
    - ``exact_tokens``: for backends whose KV events are live and whose block size the
      request's ``token_keys`` has, leading prompt tokens held, from token-exact entries
      (precise or speculative); it overrides ``matched_blocks``;
    - ``adapter_set``: for a LoRA adapter, the backends it is placed on, in join order
      (:mod:`routing.lora`; empty before its first placement; ``None`` for a base model);
    - ``kv_turnover``: a function of a candidate giving (KV tokens its cache can take
      without evicting, share of its evicted blocks asked for again)
      (:meth:`routing.router.Router.kv_turnover`; ``None``: not known);
    - ``home``: the backend holding the request's session (``None``: no session, or a
      new one); ``matched_blocks`` counts what its last turn placed there, as far as
      its engine probably still holds it after the time it has been idle
      (:meth:`routing.router.Router.match`); ``home_queued``: that turn's uncached
      prompt tokens when another replica placed it (its load there, which that
      replica's snapshot may still show; 0: none); ``home_held``: the blocks the
      session's last turn placed there that this prompt extends (0: none), idle for
      ``home_idle`` seconds.
    """

    request: RouteRequest
    now: float = 0.0
    matched_blocks: Mapping[str, int] = field(default_factory=lambda: NOTHING)
    exact_tokens: Mapping[str, int] = field(default_factory=lambda: NOTHING)
    adapter_set: tuple[str, ...] | None = None
    kv_turnover: Callable[[BackendState], tuple[float, float]] | None = None
    home: str | None = None
    home_queued: float = 0.0
    home_held: int = 0
    home_idle: float = 0.0

    @classmethod
    def of(cls, request: RouteRequest, now: float = 0.0) -> Match:
        """A match of ``request`` at ``now`` that found nothing cached anywhere (a
        probe's, or a policy's outside a router)."""
        return cls(request, now)

    def cached_tokens(self, backend: str) -> float:
        """Prompt tokens ``backend`` probably holds (all of them for a remote prefill)."""
        r = self.request
        prompt = r.prompt_tokens
        if r.remote_prefill:
            return float(prompt)
        if self.exact_tokens:
            exact = self.exact_tokens.get(backend)
            if exact is not None:
                return float(prompt if prompt < exact else exact)
        blocks = self.matched_blocks.get(backend)
        if not blocks:
            return 0.0
        # the lesser of the two as min() takes it, without its call: this runs for
        # every candidate of every decision
        tokens = blocks * r.tokens_per_block
        return float(prompt) if prompt < tokens else tokens


@dataclass(slots=True)
class Decision:
    """A policy's choice and why it was made.

    ``reason`` is a short token for metrics (``round_robin``, ``least_requests``,
    ``tie``...); ``detail`` carries numbers for the explanation header; ``evidence``
    (set by the router) is the kind of prefix-index evidence behind the chosen
    backend's matched tokens: ``precise``, ``speculative`` or ``approximate``;
    ``session`` and ``placement`` (set by the router for a request of a session): its
    id, and whether it went to the session's ``home``, ``moved`` or is ``new``; for a
    turn that went home counting its session's context as held on approximate
    evidence, ``held_tokens`` (that context's prompt tokens) and ``idle_s`` (how long
    it had been idle), which the engine's reported cached tokens are compared with
    (:meth:`routing.router.Router.learn_cached`).
    """

    backend: BackendState
    policy: str
    reason: str
    detail: dict[str, float] = field(default_factory=dict)
    evidence: str = "approximate"
    session: str | None = None
    placement: str = ""
    held_tokens: float = 0.0
    idle_s: float = 0.0


class Policy(Protocol):
    """The policy interface.

    ``choose`` gets a non-empty list of eligible candidates (healthy, not excluded, not
    cooling down) and what the router found for the request (``match``) and returns
    the decision without side effects; ``on_dispatch`` is called once after the router
    reserved the chosen backend.
    """

    name: str

    def choose(self, request: RouteRequest, candidates: Sequence[BackendState], match: Match) -> Decision: ...

    def on_dispatch(self, request: RouteRequest, decision: Decision) -> None: ...


class BasePolicy:
    """Convenience base: a no-op :meth:`on_dispatch`."""

    name = "base"

    def on_dispatch(self, request: RouteRequest, decision: Decision) -> None:
        return None
