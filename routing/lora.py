"""Where each LoRA adapter is placed: a bounded set of backends that grows under load.

The estimated TTFT (:mod:`routing.policies.estimated_ttft`) already charges a request for
an adapter the load of its weights on a backend where it is not at work
(:meth:`routing.load.BackendLoad.adapter_wait_s`). On its own that makes each request
cheapest near the adapter, but it does not hold the adapter anywhere: whenever another
backend's queue is shorter by more than one load, the adapter moves there, and over a
few seconds it visits every backend. Each visit takes one of that backend's adapter
slots (vLLM: ``max_loras`` adapters in a batch, ``max_cpu_loras`` adapters' weights in
host memory, least recently used first out), so the adapter it displaces pays a load
on its own next request there.

So each adapter has an ordered **placement set** (:class:`AdapterSets`): the backends it
is placed on, in the order they joined; the first is its home. For a request for
adapter ``a`` with estimated TTFTs ``T(b)`` over the candidates (seconds),
:func:`place` decides:

- **No member among the candidates** (its first request, or its members are all
  unhealthy, excluded or gone): the lowest estimate wins, near-ties (the policy's tie
  band) broken by rendezvous hashing (highest random weight of ``(a, b)``: Thaler and
  Ravishankar, "Using name-based mappings to increase hit rates", IEEE/ACM ToN 6(1),
  1998), so that every gateway replica, and every restart, gives an idle fleet's
  adapter the same home without sharing anything. The chosen backend joins.
- **Grow** by the best non-member ``o`` when both hold:

  - the set is smaller than the adapter's load needs, :func:`share_bound`:
    ``ceil(n_a * B / N)`` with ``n_a`` the adapter's requests in flight (the new one
    included), ``N`` all requests in flight on the ``B`` candidates: the fewest
    backends that carry its requests at no more than the fleet's mean load per
    backend (the capacity of consistent hashing with bounded loads, Mirrokni, Thorup
    and Zadimoghaddam, SODA 2018, at ``c = 1``). An adapter with a twentieth of the
    traffic of four backends gets one; one with all of it may take all four. Or the
    set is overloaded: even its least loaded member carries more than
    :data:`LOAD_FACTOR` (1.25) times the mean, past that paper's capacity at the ``c``
    the ``prefix_hash`` baseline uses, so that adapters whose homes happen to
    crowd one backend can still leave it;
  - the members are saturated: ``min_in T - T(o) > lora_load_s(o)``. ``T(o)`` already
    holds this request's own load on ``o`` (unless ``o`` still has the adapter's
    weights); the margin charges the second load a placement causes, the displaced
    adapter's. So the best member's queue costs two loads more than an idle
    backend's.

  ``o`` joins the set.
- **Otherwise a member**: the lowest estimate among the members, near-ties to the
  earliest joined, so that under light load the adapter's requests gather on its first
  members and the later ones fall idle.

**Shrink** (:meth:`AdapterSets.dispatched`): when a request for ``a`` is dispatched to a
member, the latest joined of the other members where ``a`` is no longer at work (none
of this replica's requests in flight, none running or waiting in the engine's fresh
``vllm:lora_requests_info``) leaves. Joining needs both conditions above; leaving needs
only idleness: that gap is the hysteresis, so a set does not flap at the edge of
saturation. A set loses at most one member per dispatch and is never empty once placed.

The set's size thus follows the adapter's own load (its share of the requests) and
the queues (in the estimate's unit, seconds), with no bound set by hand: one backend for
a light adapter, more as its traffic and its members' queues grow, fewer as it cools.
The Gateway API Inference Extension's LoRA affinity filter makes a like choice with
fixed numbers: it keeps a request on the pods where its adapter is active (or waiting)
with probability 0.999 (``LORA_AFFINITY_THRESHOLD``) over pods with a free adapter slot,
and lets it leave them once their queues pass 128 waiting requests
(``QUEUING_THRESHOLD_LORA``).

The sets are this replica's own, not shared through the state store: what they follow
is shared already (the other replicas' load, in the store; the adapters at work, in
the engines' metrics that every replica scrapes), an idle fleet gives the same home
everywhere (the rendezvous tie-break), and a set is cheap to rebuild: a new replica's
first request for an adapter that is at work somewhere goes where it works, which
costs no load. The share counts this replica's requests, so with several replicas it
is each replica's share of its own traffic. Cost per decision: a few passes over the
scored candidates, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import xxhash

from routing.backend import BackendState

# A placement set at its share of the traffic may still grow while even its least loaded
# member carries more than this many times the mean in-flight requests per backend (past
# its capacity in consistent hashing with bounded loads: Mirrokni, Thorup and
# Zadimoghaddam, SODA 2018): the ``c`` of the ``prefix_hash`` baseline, whose sources are
# given in :mod:`routing.policies.prefix_hash` (HAProxy, Vimeo, SGLang).
LOAD_FACTOR = 1.25

# (estimated TTFT in seconds, uncached prompt tokens), backend: what the policy scored
Scored = tuple[tuple[float, float], BackendState]


def rendezvous(adapter: str, backend: str) -> int:
    """The rendezvous weight of ``backend`` for ``adapter`` (a 64-bit int, the same in
    every process: ``xxh3_64`` of the two names)."""
    return xxhash.xxh3_64_intdigest(f"{adapter}\x00{backend}".encode())


def place(adapter: str, members: Sequence[str], scored: Sequence[Scored], tie_relative: float,
          tie_absolute_s: float) -> tuple[Scored, str]:
    """The scored candidate a request for LoRA ``adapter`` goes to, and why.

    ``members``: the adapter's placement set, in join order (empty before its first
    placement); ``scored``: every candidate's (estimated TTFT s, uncached tokens) and
    backend, non-empty; estimates within ``best * (1 + tie_relative) +
    tie_absolute_s`` of the best are near-ties. Reasons: ``adapter_home`` (no member
    among the candidates: the near-best with the highest rendezvous weight),
    ``adapter_grow`` (a non-member: the members are saturated, or none is a
    candidate) and ``adapter_set`` (a member). See the module docstring for the rule."""
    if members:
        rank = {name: i for i, name in enumerate(members)}
        inside = [s for s in scored if s[1].name in rank]
        if inside:
            best_in = min([s[0][0] for s in inside])
            outside = [s for s in scored if s[1].name not in rank]
            if outside and may_grow(adapter, inside, scored):
                out = min(outside, key=lambda s: s[0][0])
                if best_in - out[0][0] > out[1].load.lora_load_s:
                    return out, "adapter_grow"
            limit = best_in * (1 + tie_relative) + tie_absolute_s
            return min([s for s in inside if s[0][0] <= limit], key=lambda s: rank[s[1].name]), "adapter_set"
    best = min([s[0][0] for s in scored])
    limit = best * (1 + tie_relative) + tie_absolute_s
    home = max([s for s in scored if s[0][0] <= limit], key=lambda s: rendezvous(adapter, s[1].name))
    return home, "adapter_grow" if members else "adapter_home"


def may_grow(adapter: str, inside: Sequence[Scored], scored: Sequence[Scored]) -> bool:
    """Whether ``adapter``'s placement set, whose members among the candidates are
    ``inside``, may take one more of the candidates ``scored``: it is smaller than
    :func:`share_bound`, or its least loaded member carries more than
    :data:`LOAD_FACTOR` times the candidates' mean in-flight requests."""
    if len(inside) < share_bound(adapter, scored):
        return True
    total = 1 + sum([b.in_flight for _, b in scored])
    return min([b.in_flight for _, b in inside]) * len(scored) > LOAD_FACTOR * total


def share_bound(adapter: str, scored: Sequence[Scored]) -> int:
    """The most backends ``adapter`` may be placed on among the candidates of
    ``scored`` (see the module docstring): ``ceil(n_a * B / N)``, at least 1, with
    ``n_a`` its requests in flight on them and ``N`` all of theirs (this replica's,
    each counting the request being routed) and ``B`` their number."""
    mine = 1
    total = 1
    for _, b in scored:
        mine += b.adapter_streams.get(adapter, 0)
        total += b.in_flight
    return max(1, math.ceil(mine * len(scored) / total))


class AdapterSets:
    """Every LoRA adapter's placement set (see the module docstring): adapter name to
    the names of its backends, in join order. Kept by the :class:`routing.fleet.Fleet`;
    updated on every dispatch of an adapter's request (:meth:`dispatched`)."""

    __slots__ = ("sets",)

    def __init__(self) -> None:
        self.sets: dict[str, dict[str, None]] = {}

    def members(self, adapter: str) -> tuple[str, ...]:
        """``adapter``'s backends in join order (empty: not placed yet)."""
        s = self.sets.get(adapter)
        return tuple(s) if s else ()

    def dispatched(self, adapter: str, backend: BackendState, backends: dict[str, BackendState],
                   now: float) -> None:
        """A request for ``adapter`` was dispatched to ``backend`` at monotonic time
        ``now`` (s); ``backends``: the fleet's backends by name. A new backend joins the
        set; otherwise the latest joined other member that no longer runs the adapter
        (:meth:`routing.backend.BackendState.active_adapters`), or that left the fleet,
        leaves."""
        s = self.sets.get(adapter)
        if s is None:
            self.sets[adapter] = {backend.name: None}
            return
        if backend.name not in s:
            s[backend.name] = None
            return
        if len(s) > 1:
            for name in reversed(s):
                if name == backend.name:
                    continue
                b = backends.get(name)
                if b is None or adapter not in b.active_adapters(now)[0]:
                    del s[name]
                    return
