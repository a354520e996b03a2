"""The router: candidates for a model, eligibility, then the policy's choice."""

from __future__ import annotations

from routing.fleet import BackendState, Fleet, NoBackendAvailable, Reservation
from routing.policies import Decision, Policy, RouteRequest
from routing.prefix_index import PrefixIndex

EXPIRE_EVERY_S = 1.0


class Router:
    """Turns a :class:`RouteRequest` into a :class:`Decision` and a :class:`Reservation`.

    Eligible candidates are the healthy backends serving the model (all of them when
    none is healthy), minus ``request.exclude`` and minus backends cooling down. When exclusion leaves nothing, the excluded
    backends come back (a retry may return to a backend that failed once); when only
    cooling backends remain, :class:`NoBackendAvailable` carries the wait until the
    first one is eligible.
    """

    def __init__(self, fleet: Fleet, policy: Policy, index: PrefixIndex | None = None,
                 block_tokens: int = 64) -> None:
        self.fleet = fleet
        self.policy = policy
        self.index = index or PrefixIndex()
        self.block_tokens = block_tokens
        self._next_expire = 0.0
        for b in fleet.backends.values():
            self.index.set_capacity(b.name, self.capacity_blocks(b))

    def capacity_blocks(self, b: BackendState) -> int:
        """``b``'s KV capacity in prefix-index blocks."""
        return max(1, int(b.load.kv_capacity_tokens // self.block_tokens))

    def set_kv_capacity(self, b: BackendState, tokens: int) -> None:
        """Learned ``b``'s KV cache size (tokens), e.g. from ``vllm:cache_config_info``."""
        b.load.kv_capacity_tokens = float(tokens)
        b.load.kv_capacity_known = True
        self.index.set_capacity(b.name, self.capacity_blocks(b))

    def eligible(self, request: RouteRequest, now: float) -> list[BackendState]:
        """Backends the policy may choose from at monotonic time ``now`` (seconds).

        Raises :class:`~routing.fleet.UnknownModel` and :class:`NoBackendAvailable`.
        """
        all_candidates = self.fleet.candidates(request.model)
        healthy = [b for b in all_candidates if b.healthy]
        # When every health check failed, the checks may be wrong: try them all.
        all_candidates = healthy or all_candidates
        warm = [b for b in all_candidates if b.cooldown_until <= now]
        if not warm:
            wait = min(b.cooldown_until for b in all_candidates) - now
            raise NoBackendAvailable(request.model, retry_after_s=max(wait, 0.0))
        if request.exclude:
            fresh = [b for b in warm if b.name not in request.exclude]
            if fresh:
                return fresh
        return warm

    def route(self, request: RouteRequest, now: float) -> tuple[Decision, Reservation]:
        """Choose a backend and reserve its load: the request's uncached prompt tokens
        join the backend's prefill queue and its blocks are recorded in the prefix
        index. Raises what :meth:`eligible` raises."""
        candidates = self.eligible(request, now)
        if now >= self._next_expire:
            self.index.expire(now)
            self._next_expire = now + EXPIRE_EVERY_S
        request.now = now
        request.matched_blocks = self.index.match(request.block_hashes, now)
        decision = self.policy.choose(request, candidates)
        b = decision.backend
        cached = request.cached_tokens(b.name)
        decision.detail.setdefault("matched_tokens", cached)
        load = b.load.admit(uncached_tokens=request.prompt_tokens - cached, prompt_tokens=request.prompt_tokens,
                            output_tokens=request.output_tokens, now=now)
        self.index.record(b.name, request.block_hashes, now)
        reservation = self.fleet.reserve(b, load)
        self.policy.on_dispatch(request, decision)
        return decision, reservation
