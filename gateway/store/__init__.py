"""State shared with the other replicas through Redis, and the loops that sync it.

| module | holds |
|---|---|
| :mod:`~gateway.store.redis_client` | the Redis client made from a ``state.url`` (standalone, Cluster, Sentinel), the replica's id, closing |
| :mod:`~gateway.store.background_sync` | the background loop of every store sync (a round every interval, bounded), its stop, and the check for a cancel a Redis call swallowed |
| :mod:`~gateway.store.routing_state` | where the routing state lives: in-process, or shared through Redis (load snapshots and prefix blocks) |

The decision core (``routing/``) does no I/O; it reports each dispatch to the store
attached to it and the store folds the other replicas' view into it, both through
:mod:`routing.store`. The per-key limits and the usage ledger sync with the same
loop (:mod:`gateway.tenancy.limits`, :mod:`gateway.tenancy.usage_ledger`).
"""
