"""The router: candidates for a model, eligibility, then the policy's choice."""

from __future__ import annotations

import random
from dataclasses import dataclass

from routing.backend import BackendState
from routing.fleet import Fleet, NoBackendAvailable, Reservation
from routing.gaps import RetentionFit
from routing.policies import Decision, Match, Policy, RouteRequest
from routing.policies.base import NOTHING
from routing.policies.estimated_ttft import estimate_ttft
from routing.prefix_index import PrefixIndex
from routing.session_kv import SessionRouting
from routing.sessions import SessionTable
from routing.store import RoutingStore

EXPIRE_EVERY_S = 1.0  # the prefix index's expiry and the speeds' ageing, at most this often
PRIOR_MIN_SAMPLES = 5  # a backend's own samples before its speed counts toward its pool's prior
MIXED = frozenset({"mixed"})
PREFILL = frozenset({"prefill"})
DECODE = frozenset({"decode"})
SERVING = frozenset({"mixed", "decode"})


@dataclass(frozen=True, slots=True)
class Plan:
    """Where a request goes: ``kind`` is ``single`` (one backend among ``roles``) or
    ``disaggregated`` (a prefill leg on the ``prefill`` pool, then the decode leg on
    the ``decode`` pool). ``uncached_tokens`` is the prompt minus the best prefix hit
    anywhere in the fleet."""

    kind: str
    roles: frozenset[str] | None
    uncached_tokens: float


class Router(SessionRouting):
    """Turns a :class:`RouteRequest` into a :class:`Decision` and a :class:`Reservation`.

    Eligible candidates are the healthy backends serving the model (all of them when
    none is healthy), minus draining backends, ``request.exclude`` and backends cooling
    down or whose circuit breaker is open. When exclusion leaves nothing, the excluded
    backends come back (a retry may return to a backend that failed once); when only
    cooling backends remain, :class:`NoBackendAvailable` carries the wait until the
    first one is eligible.
    """

    def __init__(self, fleet: Fleet, policy: Policy, index: PrefixIndex | None = None,
                 block_tokens: int = 64, store: RoutingStore | None = None) -> None:
        self.fleet = fleet
        self.policy = policy
        self.index = index or PrefixIndex()
        self.block_tokens = block_tokens
        self.store = store  # learns the dispatched prefix blocks, for other replicas (routing.store)
        self.sessions = SessionTable()  # each session's home (routing.sessions), configured by the core
        self._waiting = self.sessions.waiting  # (read for every candidate)
        # per backend without live KV events, how long its engine keeps an idle prefix (learn_cached)
        self.retention: dict[str, RetentionFit] = {}
        self._factors: dict[str, tuple[list[float], list[float]]] = {}  # (routing.session_kv.bin_factors)
        self.index.on_gone = self._kv_gone
        self._next_expire = 0.0
        # model -> {engine block size: backends publishing KV events in it}, set by the core
        self.event_backends: dict[str, dict[int, list[str]]] = {}
        self.canaries: dict[str, tuple[str, str, float]] = {}
        self._kv_turnover = self.kv_turnover  # one bound method for every request
        # the last match made, for the plan, route and reservation of one request
        self._last_match: Match | None = None
        self._canary_rng = random.Random()
        for b in fleet.backends.values():
            self.index.set_capacity(b.name, self.capacity_blocks(b))

    def forget_backend(self, name: str) -> None:
        """Backend ``name`` lost its cache (it restarted or left the fleet): its prefix
        entries go, and its sessions hold nothing there any more."""
        self.index.forget_backend(name)
        self.sessions.backend_emptied(name)

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
        if request.roles is not None:
            all_candidates = [b for b in all_candidates if b.spec.role in request.roles]
            if not all_candidates:
                raise NoBackendAvailable(request.model)
        if request.pools is not None:
            all_candidates = [b for b in all_candidates if b.spec.pool in request.pools]
            if not all_candidates:
                raise NoBackendAvailable(request.model)
        if request.subset is not None:
            all_candidates = [b for b in all_candidates if b.name in request.subset]
            if not all_candidates:
                raise NoBackendAvailable(request.model)
        all_candidates = [b for b in all_candidates if not b.draining]  # draining: no new requests
        if not all_candidates:
            raise NoBackendAvailable(request.model)
        # b.ready_at(now) <= now, inlined: no cooldown and a closed breaker is the usual case
        warm = [b for b in all_candidates if b.healthy and b.cooldown_until <= now and
                (b.breaker.state == "closed" or b.ready_at(now) <= now)]
        if not warm:
            # When every health check failed, the checks may be wrong: try them all.
            if not any(b.healthy for b in all_candidates):
                warm = [b for b in all_candidates if b.ready_at(now) <= now]
            else:
                all_candidates = [b for b in all_candidates if b.healthy]
        if not warm:
            soonest = min(all_candidates, key=lambda b: b.ready_at(now))
            wait = soonest.ready_at(now) - now
            breaker_open = soonest.breaker.state != "closed" and soonest.breaker.ready_at(now) >= soonest.cooldown_until
            raise NoBackendAvailable(request.model, retry_after_s=max(wait, 0.0), breaker_open=breaker_open)
        if request.exclude:
            fresh = [b for b in warm if b.name not in request.exclude]
            if fresh:
                return fresh
        return warm

    def set_canaries(self, canaries: dict[str, tuple[str, str, float]], rng: random.Random | None = None) -> None:
        """Canary splits: ``{model: (stable pool, canary pool, canary weight in [0, 1])}``."""
        self.canaries = canaries
        if rng is not None:
            self._canary_rng = rng

    def canary_pools(self, model: str) -> tuple[frozenset[str] | None, frozenset[str] | None]:
        """(pools this request may use, pools to fall back to) for ``model``: with a
        canary split, the canary pool for a ``weight`` fraction of requests (with the
        stable pool as fallback) and the stable pool for the rest; otherwise any pool."""
        split = self.canaries.get(model)
        if split is None:
            return None, None
        stable, canary, weight = split
        if self._canary_rng.random() < weight:
            return frozenset({canary}), frozenset({stable})
        return frozenset({stable}), None

    def match(self, request: RouteRequest, now: float) -> Match:
        """What the prefix index holds of ``request`` at monotonic time ``now``
        (seconds): the :class:`~routing.policies.Match` that planning, choosing and
        reserving read. The same request at the same time gets the same match (a plan,
        then a route, then a reservation make one)."""
        last = self._last_match
        if last is not None and last.request is request and last.now == now:
            return last
        if now >= self._next_expire:
            self.index.expire(now)
            self.index.expire_speculative(now)
            self.refresh_speeds(now)
            self.sessions.expire(now)
            self._factors.clear()  # valued again: time passed, the gaps were learned
            for w in self.sessions.waiting.values():
                w.value = None
            self._next_expire = now + EXPIRE_EVERY_S
        matched = self.index.match(request.block_hashes, now)
        exact = self._match_tokens(request, request.token_keys, now) if request.token_keys else NOTHING
        m = Match(request, now, matched, exact, None, self._kv_turnover)
        if request.session is not None:
            self._at_home(m, request.session, now)
        self._last_match = m
        return m

    def _match_tokens(self, request: RouteRequest, token_keys: dict[int, tuple[int, ...]],
                      now: float) -> dict[str, int]:
        """Token-exact evidence for the backends whose KV events are live: it decides
        their matched tokens (none held is a precise zero); the others keep the
        approximate match."""
        by_size = self.event_backends.get(request.model)
        if not by_size:
            return {}
        engines = self.index.engines
        exact: dict[str, int] = {}
        # an engine computes at least the prompt's last token: a prompt of whole blocks
        # reuses all but its last block (vLLM: max_cache_hit_length = num_tokens - 1)
        usable = len(request.token_ids) - 1 if request.token_ids is not None else None
        for size, names in by_size.items():
            keys = token_keys.get(size)
            if keys is None:
                continue
            live = [n for n in names if engines[n].live]
            if not live:
                continue
            held = self.index.match_tokens(keys, live, now)
            cap = len(keys) if usable is None else max(usable, 0) // size
            for n in live:
                exact[n] = min(held.get(n, 0), cap) * size
        return exact

    def evidence(self, request: RouteRequest, match: Match, backend: str) -> str:
        """What stands behind ``request``'s matched tokens on ``backend`` (its
        ``match``): ``precise`` (every matched block confirmed by its engine; a zero of
        a live backend too), ``speculative`` (some only dispatched) or ``approximate``."""
        tokens = match.exact_tokens.get(backend) if match.exact_tokens else None
        if tokens is None:
            return "approximate"
        e = self.index.engines[backend]
        keys = request.token_keys.get(e.block_size, ()) if request.token_keys else ()
        return "precise" if self.index.all_precise(backend, keys[:tokens // e.block_size]) else "speculative"

    def refresh_speeds(self, now: float) -> None:
        """Age every backend's learned speeds by the time passed, and note each
        backend's peers' speed (``BackendLoad.peer_ttft``): the (lower) median TTFT
        overhead of the other backends of its pool that have measured theirs and, for
        a backend without a speed hint, their median prefill rate scaled by the
        backends' weights (an engine's rate seen at its start may be long gone). A long-silent backend is judged
        by it when it is probed again (:mod:`routing.policies.estimated_ttft`): as fast
        as its peers, not as the built-in default nor as it last showed; a backend with
        no sample of its own yet (a scale-out) starts from it
        (:meth:`routing.load.BackendLoad.seed_from_peers`)."""
        pools: dict[str, list[BackendState]] = {}
        for b in self.fleet.backends.values():
            b.load.age(now)
            pools.setdefault(b.spec.pool, []).append(b)
        for members in pools.values():
            measured = [b for b in members if b.load.ttft_fit.samples >= PRIOR_MIN_SAMPLES]
            if not measured:
                continue
            for b in members:
                peers = [p for p in measured if p is not b]
                if not peers:
                    continue
                rates = sorted((1.0 / p.load.ttft_fit.slope) / p.spec.weight for p in peers)
                overheads = sorted(p.load.ttft_fit.intercept for p in peers)
                mid = (len(peers) - 1) // 2
                fit = b.load.ttft_fit
                if b.load.prior_from == "hint":
                    slope = fit.prior_slope
                else:
                    slope = 1.0 / (rates[mid] * b.spec.weight)
                    b.load.seed_from_peers(overheads[mid], slope)
                b.load.peer_ttft = (overheads[mid], slope)

    def plan(self, request: RouteRequest, now: float, long_prompt_tokens: int) -> Plan:
        """Choose the pools for ``request`` (DESIGN.md section 3, "Pools").

        - With both a ``prefill`` and a ``decode`` pool: a prompt whose uncached part
          exceeds ``long_prompt_tokens`` runs disaggregated; a shorter one is served by
          a ``mixed`` backend, or, when there is none, by a ``decode`` backend that
          prefills it locally (cheaper than a KV transfer for a short prompt).
        - With a ``prefill`` pool only: long prompts go there, short ones to ``mixed``.
        - Otherwise any ``mixed`` or ``decode`` backend serves it.

        Raises :class:`~routing.fleet.UnknownModel`.
        """
        candidates = self.fleet.candidates(request.model)
        roles = {b.spec.role for b in candidates}
        match = self.match(request, now)
        best = max((match.cached_tokens(b.name) for b in candidates), default=0.0)
        uncached = request.prompt_tokens - best
        long = uncached > long_prompt_tokens
        if "prefill" in roles and "decode" in roles:
            if long:
                return Plan("disaggregated", PREFILL, uncached)
            return Plan("single", MIXED if "mixed" in roles else DECODE, uncached)
        if "prefill" in roles:
            if long or "mixed" not in roles:
                return Plan("single", PREFILL, uncached)
            return Plan("single", MIXED, uncached)
        return Plan("single", None, uncached)

    def route(self, request: RouteRequest, now: float) -> tuple[Decision, Reservation]:
        """Choose a backend and reserve its load: the request's uncached prompt tokens
        join the backend's prefill queue and its blocks are recorded in the prefix
        index (approximate blocks always; token-exact blocks, speculatively, when the
        backend publishes KV events). Raises what :meth:`eligible` raises."""
        candidates = self.eligible(request, now)
        match = self.match(request, now)
        if candidates[0].adapter_base(request.model) is not None:
            match.adapter_set = self.fleet.adapter_sets.members(request.model)
        decision = self.policy.choose(request, candidates, match)
        chosen = decision.backend
        cached = match.cached_tokens(chosen.name)
        detail = decision.detail
        detail.setdefault("matched_tokens", cached)
        detail["output_tokens"] = request.output_tokens
        if match.exact_tokens:
            decision.evidence = self.evidence(request, match, chosen.name)
        if request.session is not None:
            self._place(request, candidates, match, decision, cached, now)
        reservation = self._reserve(request, chosen, cached, now)
        load = reservation.request_load
        if load is not None:  # what the estimate is judged by (the backend's EstimateError)
            load.estimate_s = detail.get("ttft_est_s", 0.0)
        self.policy.on_dispatch(request, decision)
        return decision, reservation

    def reserve(self, request: RouteRequest, b: BackendState, now: float) -> Reservation:
        """Reserve ``request``'s load on ``b`` (its uncached prompt tokens join ``b``'s
        prefill queue) and record its blocks in the prefix index (token-exact ones
        speculatively when ``b`` publishes KV events): what :meth:`route`
        does once it chose, and what a data plane does when a request was served by
        another backend than the one routed to (a proxy's own retry)."""
        return self._reserve(request, b, self.match(request, now).cached_tokens(b.name), now)

    def _reserve(self, request: RouteRequest, b: BackendState, cached: float, now: float) -> Reservation:
        """:meth:`reserve` of ``request`` on ``b``, which holds ``cached`` of its prompt
        tokens (the match's :meth:`~routing.policies.Match.cached_tokens`)."""
        load = b.load.admit(uncached_tokens=request.prompt_tokens - cached, prompt_tokens=request.prompt_tokens,
                            output_tokens=request.output_tokens, now=now, stream=request.stream)
        self.index.record(b.name, request.block_hashes, now)
        if request.token_keys:
            e = self.index.engines.get(b.name)
            if e is not None:
                keys = request.token_keys.get(e.block_size)
                if keys:
                    self.index.record_speculative(b.name, keys, now)
        if self.store is not None:
            self.store.record_dispatch(b.name, request.block_hashes)
        adapter = request.model if b.adapter_base(request.model) is not None else None
        return self.fleet.reserve(b, load, now, adapter)

    def alternatives(self, request: RouteRequest, chosen: BackendState, now: float, limit: int) -> list[BackendState]:
        """Up to ``limit`` other eligible backends for ``request`` besides ``chosen``, by
        estimated TTFT (:func:`routing.policies.estimated_ttft.estimate_ttft`), soonest
        first: where a proxy that retries by itself goes next. Nothing is reserved."""
        if limit <= 0:
            return []
        try:
            candidates = [b for b in self.eligible(request, now) if b is not chosen]
        except NoBackendAvailable:
            return []
        match = self.match(request, now)
        candidates.sort(key=lambda b: estimate_ttft(b, request, match)[0])
        return candidates[:limit]
