"""The seam between the decision core and a store that shares its view with other replicas.

The decision core does no I/O (DESIGN.md sections 2 and 4). When several gateway
replicas share one fleet view, a store in the gateway (:mod:`gateway.store`) does the
sharing in the background; what it exchanges with the core is defined here, as pure
functions of the core's own objects:

- :class:`RoutingStore`: what the router calls on the request path, once per dispatch
  (:meth:`~routing.core.DecisionCore.attach_store` hands the store to the core).
  ``record_dispatch`` only queues the prefix blocks the dispatch placed; the store
  publishes them later, off the request path.
- :func:`load_snapshot`: this replica's load per backend, as the numbers it publishes.
- :func:`fold_remote_loads`: the other replicas' snapshots, summed into each backend's
  ``load.remote`` (:class:`~routing.load.RemoteLoad`) and ``remote_in_flight``;
  :func:`clear_remote_loads` forgets them (a view older than the lease is worse than none).
- The other replicas' prefix blocks enter the core's index through
  :meth:`~routing.prefix_index.PrefixIndex.record`.

With no store attached (one replica, the offline replay, the benchmarks) nothing is
shared and the request path makes no call at all.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from routing.fleet import Fleet
from routing.load import RemoteLoad

# a snapshot's numbers per backend: queued, queued prefill tokens, running, decode
# tokens remaining, KV tokens, in flight, then the learned speed (prefill tokens/s,
# TTFT overhead s, ITL base s, ITL per stream s, samples)
SNAPSHOT_FIELDS = 11


class RoutingStore(Protocol):
    """Where the router reports what it placed, for the other replicas to learn."""

    def record_dispatch(self, backend: str, hashes: tuple[int, ...]) -> None:
        """``backend`` got a request whose prompt has the prefix blocks ``hashes``.
        Called on the request path: no I/O, no waiting."""


def load_snapshot(fleet: Fleet) -> dict[str, list[float]]:
    """This replica's own load on each backend of ``fleet`` (:data:`SNAPSHOT_FIELDS`
    numbers each). Snapshots are absolute: a lost one is repaired by the next."""
    out = {}
    for name, b in fleet.backends.items():
        ld = b.load
        out[name] = [ld.queued, ld.queued_prefill_tokens, ld.running, ld.decode_tokens_remaining, ld.kv_tokens,
                     b.in_flight, *ld.local_speed()]
    return out


def fold_remote_loads(fleet: Fleet, snapshots: Iterable[dict[str, list[float]]]) -> None:
    """Make the other replicas' ``snapshots`` (one per replica, from :func:`load_snapshot`)
    the remote load of ``fleet``'s backends: summed per backend, their speeds listed.
    A backend no snapshot names has no remote load; entries of unknown backends and
    short entries are ignored."""
    totals: dict[str, RemoteLoad] = {name: RemoteLoad() for name in fleet.backends}
    in_flight: dict[str, int] = dict.fromkeys(fleet.backends, 0)
    for snap in snapshots:
        for name, v in snap.items():
            t = totals.get(name)
            if t is None or len(v) < SNAPSHOT_FIELDS:
                continue
            t.queued += v[0]
            t.queued_prefill_tokens += v[1]
            t.running += v[2]
            t.decode_tokens_remaining += v[3]
            t.kv_tokens += v[4]
            in_flight[name] += int(v[5])
            t.speeds.append((v[6], v[7], v[8], v[9], int(v[10])))
    for name, b in fleet.backends.items():
        b.load.remote = totals[name]
        b.remote_in_flight = in_flight[name]


def clear_remote_loads(fleet: Fleet) -> None:
    """Forget the other replicas' load on every backend of ``fleet``."""
    for b in fleet.backends.values():
        b.load.remote = RemoteLoad()
        b.remote_in_flight = 0
