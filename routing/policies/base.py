"""The policy interface: what a policy may know of a request (:class:`RouteRequest`),
what it answers (:class:`Decision`) and the :class:`Policy` protocol itself."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from routing.backend import BackendState


@dataclass(slots=True)
class RouteRequest:
    """What a policy may know about a request.

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
    - ``token_ids``: the prompt's token ids as the engine will see them, when the
      model's tokenizer is known (``None`` otherwise).
    - ``token_keys``: the token-exact keys of the prompt's full blocks per engine
      block size (``{block_size: keys}``, see :func:`routing.estimate.token_block_keys`),
      computed from ``token_ids``: the key of precise prefix entries.
    - ``stream``: the answer is streamed, so its first token will be seen (a whole
      answer shows only its end).
    - Set by the router before ``choose``: ``now`` (monotonic seconds),
      ``matched_blocks`` (per backend, leading approximate blocks it probably holds)
      and, for backends whose KV events are live and whose block size ``token_keys``
      has, ``exact_tokens`` (leading prompt tokens held, from token-exact entries,
      precise or speculative), which overrides ``matched_blocks``; for a LoRA
      adapter, ``adapter_set``: the backends it is placed on, in join order
      (:mod:`routing.lora`; empty before its first placement; ``None`` for a base model);
      and ``kv_turnover``, a function of a candidate giving (KV tokens its cache can
      take without evicting, share of its evicted blocks asked for again)
      (:meth:`routing.router.Router.kv_turnover`; ``None``: not known).
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
    now: float = 0.0
    matched_blocks: dict[str, int] = field(default_factory=dict)
    matched_at: float | None = None
    exact_tokens: dict[str, int] = field(default_factory=dict)
    adapter_set: tuple[str, ...] | None = None
    kv_turnover: Callable[[BackendState], tuple[float, float]] | None = None

    def cached_tokens(self, backend: str) -> float:
        """Prompt tokens ``backend`` probably holds (all of them for a remote prefill)."""
        if self.remote_prefill:
            return float(self.prompt_tokens)
        if self.exact_tokens:
            exact = self.exact_tokens.get(backend)
            if exact is not None:
                return float(min(exact, self.prompt_tokens))
        blocks = self.matched_blocks.get(backend)
        if not blocks:
            return 0.0
        return min(blocks * self.tokens_per_block, float(self.prompt_tokens))


@dataclass(slots=True)
class Decision:
    """A policy's choice and why it was made.

    ``reason`` is a short token for metrics (``round_robin``, ``least_requests``,
    ``tie``...); ``detail`` carries numbers for the explanation header; ``evidence``
    (set by the router) is the kind of prefix-index evidence behind the chosen
    backend's matched tokens: ``precise``, ``speculative`` or ``approximate``.
    """

    backend: BackendState
    policy: str
    reason: str
    detail: dict[str, float] = field(default_factory=dict)
    evidence: str = "approximate"


class Policy(Protocol):
    """The policy interface.

    ``choose`` gets a non-empty list of eligible candidates (healthy, not excluded, not
    cooling down) and returns the decision without side effects; ``on_dispatch`` is
    called once after the router reserved the chosen backend.
    """

    name: str

    def choose(self, request: RouteRequest, candidates: Sequence[BackendState]) -> Decision: ...

    def on_dispatch(self, request: RouteRequest, decision: Decision) -> None: ...


class BasePolicy:
    """Convenience base: a no-op :meth:`on_dispatch`."""

    name = "base"

    def on_dispatch(self, request: RouteRequest, decision: Decision) -> None:
        return None
