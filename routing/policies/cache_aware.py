"""``cache_aware``: the SGLang router's cache-aware load balancer, reproduced as the baseline.

Source: sgl-project/sglang, ``sgl-router/src/policies/cache_aware.rs`` and
``sgl-router/src/tree.rs`` (the algorithm of PR #2114, "cache-aware load-balancing
router v1", Nov 2024; the files moved to ``sgl-model-gateway/src/policies/``), also
shipped by vllm-project/router (``src/policies/cache_aware.rs``) and
lightseekorg/smg (``model_gateway/src/policies/cache_aware.rs``). Per request:

1. Load is each worker's count of in-flight requests. The system is *imbalanced* when
   ``max_load - min_load > balance_abs_threshold`` **and**
   ``max_load > balance_rel_threshold * min_load``; then the request goes to the
   least-loaded worker (shortest queue, the first one on ties), and the tree still
   records it.
2. Otherwise the per-model approximate radix tree (:mod:`routing.radix_tree`) is
   matched against the request text: ``match_rate = matched chars / request chars``.
   If ``match_rate > cache_threshold`` the request goes to the tenant of the deepest
   matched node; otherwise to the worker with the smallest tree (most cache room).
3. The chosen worker is inserted into the tree along the request's text.
4. Every ``eviction_interval_secs`` a background thread evicts LRU leaves until each
   worker's tree holds at most ``max_tree_size`` characters.

Defaults are the router's published CLI defaults (``RouterArgs`` in
``sgl-router/py_src/sglang_router/router_args.py``, ``--cache-threshold`` etc.):
``cache_threshold = 0.3``, ``balance_abs_threshold = 64``,
``balance_rel_threshold = 1.5``, ``eviction_interval_secs = 120``,
``max_tree_size = 2**26`` characters per worker. (The Rust ``CacheAwareConfig::default``
of early versions, ``0.5 / 32 / 1.1 / 30 s / 10,000``, is not what the router runs with
by default.)

Adaptations to this gateway, each named:

- A policy does no I/O and runs no background task, so eviction runs lazily in
  virtual terms: after a dispatch, once ``eviction_interval_requests`` dispatches
  have passed since the last run and some tree is over ``max_tree_size``. 400
  dispatches is about 120 s of the Mooncake conversation trace at its native
  3.4 req/s. A replay in virtual time may instead call :meth:`CacheAware.evict` every
  120 virtual seconds (and pass ``eviction_interval_requests=0``).
- The tree is updated in :meth:`CacheAware.on_dispatch` (the router calls it right
  after the choice), not inside ``choose``; the touch of the matched tenant that
  upstream ``prefix_match`` performs is replayed there too.
- Upstream matches over all tenants and, when its pick is unhealthy, falls back to
  the first healthy worker. Here the router has already removed ineligible backends
  (unhealthy, cooling down, excluded after a failure), so the match follows only
  nodes held by an eligible backend, and the smallest tree and the shortest queue
  are taken among the eligible backends. With every backend eligible this is the
  upstream behaviour exactly.
- Load is ``in_flight``, unweighted, as upstream (it ignores capacities).
- Sessions (not upstream): a request of a session whose home
  (:mod:`routing.sessions`) is a candidate goes home unless step 1 finds the load
  imbalanced (then it moves to the least-loaded backend, its new home); the tree
  still records it.

Upstream later changed step 2's miss branch: since sgl-project/sglang PR #14650
(Dec 2025, "cache-aware router should pick min load instead of min tenant size"),
and in vllm-project/router and SMG, a miss goes to the least-loaded worker.
``miss_policy="min_load"`` selects that variant; the default, ``"smallest_tree"``, is
the algorithm as published and documented in both files' header comments.
"""

from __future__ import annotations

from collections.abc import Sequence

from routing.backend import BackendState
from routing.policies.base import BasePolicy, Decision, Match, RouteRequest
from routing.radix_tree import ApproxRadixTree, _Node

#: ``RouterArgs`` defaults, sgl-router/py_src/sglang_router/router_args.py.
CACHE_THRESHOLD = 0.3
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5
EVICTION_INTERVAL_S = 120
MAX_TREE_SIZE_CHARS = 2**26


class CacheAware(BasePolicy):
    """The SGLang router's ``cache_aware`` policy (see the module docstring).

    - ``cache_threshold``: minimum match rate (matched / request characters, in [0, 1])
      for cache-affinity routing; the comparison is strict (``>``).
    - ``balance_abs_threshold``: in-flight request spread that may trigger shortest-queue.
    - ``balance_rel_threshold``: max/min in-flight ratio that may trigger shortest-queue.
    - ``max_tree_size``: characters per backend kept in a model's tree after eviction.
    - ``eviction_interval_requests``: dispatches between lazy evictions (0: never by
      itself; call :meth:`evict`).
    - ``miss_policy``: ``"smallest_tree"`` (published algorithm) or ``"min_load"``
      (upstream since PR #14650).

    Raises :class:`ValueError` on an unknown ``miss_policy``.
    """

    name = "cache_aware"

    def __init__(self, cache_threshold: float = CACHE_THRESHOLD,
                 balance_abs_threshold: int = BALANCE_ABS_THRESHOLD,
                 balance_rel_threshold: float = BALANCE_REL_THRESHOLD,
                 max_tree_size: int = MAX_TREE_SIZE_CHARS,
                 eviction_interval_requests: int = 400,
                 miss_policy: str = "smallest_tree") -> None:
        if miss_policy not in ("smallest_tree", "min_load"):
            raise ValueError(f"unknown miss_policy {miss_policy!r}")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self.eviction_interval_requests = eviction_interval_requests
        self.miss_policy = miss_policy
        self.trees: dict[str, ApproxRadixTree] = {}
        self._since_eviction: dict[str, int] = {}
        # The match made by the last ``choose``, replayed as a touch in ``on_dispatch``.
        self._pending: tuple[RouteRequest, _Node, str] | None = None

    def choose(self, request: RouteRequest, candidates: Sequence[BackendState], match: Match) -> Decision:
        self._pending = None
        max_load = max(b.requests for b in candidates)
        min_load = min(b.requests for b in candidates)
        if (max_load - min_load > self.balance_abs_threshold
                and max_load > self.balance_rel_threshold * min_load):
            chosen = min(candidates, key=lambda b: b.requests)  # first on ties
            return Decision(chosen, self.name, "imbalance",
                            {"max_load": float(max_load), "min_load": float(min_load),
                             "in_flight": float(chosen.requests)})

        by_name = {b.name: b for b in candidates}
        home = by_name.get(match.home) if match.home is not None else None
        if home is not None:  # a session's turn goes home unless the load is imbalanced
            return Decision(home, self.name, "session_home", {"in_flight": float(home.requests)})
        text = request.prompt_text
        tree = self.trees.get(request.model)
        matched, tenant, node = (0, None, None) if tree is None else tree.match(text, by_name)
        rate = matched / len(text) if text else 0.0
        detail = {"match_rate": rate, "matched_chars": float(matched)}
        if tenant is not None and node is not None:
            self._pending = (request, node, tenant)
        if rate > self.cache_threshold and tenant is not None:
            chosen = by_name[tenant]
            reason = "cache_hit"
        elif self.miss_policy == "smallest_tree":
            chosen = by_name[tree.smallest_tenant(by_name)] if tree is not None else candidates[0]
            reason = "cache_miss"
        else:
            chosen = min(candidates, key=lambda b: b.requests)
            reason = "cache_miss"
        detail["in_flight"] = float(chosen.requests)
        return Decision(chosen, self.name, reason, detail)

    def on_dispatch(self, request: RouteRequest, decision: Decision) -> None:
        tree = self.trees.get(request.model)
        if tree is None:
            tree = self.trees[request.model] = ApproxRadixTree()
            self._since_eviction[request.model] = 0
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] is request:
            tree.touch(pending[1], pending[2])
        name = decision.backend.name
        tree.insert(request.prompt_text, name)
        n = self._since_eviction[request.model] = self._since_eviction[request.model] + 1
        if (self.eviction_interval_requests and n >= self.eviction_interval_requests
                and max(tree.tenant_chars.values()) > self.max_tree_size):
            tree.evict(self.max_tree_size)
            self._since_eviction[request.model] = 0

    def evict(self) -> int:
        """Run the LRU eviction on every model's tree now (upstream's periodic task).
        Returns the number of characters detached."""
        freed = 0
        for model, tree in self.trees.items():
            freed += tree.evict(self.max_tree_size)
            self._since_eviction[model] = 0
        return freed


class CacheAwareMinLoad(CacheAware):
    """``cache_aware_min_load``: :class:`CacheAware` with the current upstream miss rule
    (a low match goes to the least-loaded backend; SGLang PR #14650, Dec 2025, also in
    vllm-project/router and SMG). Benchmarks run both so that ours is compared with the
    stronger of the two."""

    name = "cache_aware_min_load"

    def __init__(self) -> None:
        super().__init__(miss_policy="min_load")
