"""State shared with the other replicas through Redis, and the loops that sync it.

| module | holds |
|---|---|
| :mod:`~gateway.store.redis_client` | the Redis client made from a ``state.url`` (standalone, Cluster, Sentinel), the replica's id, closing |
| :mod:`~gateway.store.background_sync` | :class:`~gateway.store.background_sync.BackgroundSync`, the one background loop of every store sync and of the batch loops |
| :mod:`~gateway.store.routing_state` | where the routing state lives: in-process, or shared through Redis (load snapshots and prefix blocks) |
| :mod:`~gateway.store.sessions` | the sessions' homes, shared through Redis and kept across restarts |

The decision core (``routing/``) does no I/O; it reports each dispatch to the store
attached to it and the store folds the other replicas' view into it, both through
:mod:`routing.store`. The per-key limits and the usage ledger sync through the same
loop (:mod:`gateway.tenancy.limits`, :mod:`gateway.tenancy.usage_ledger`).
"""  # noqa: E501 - a table, one row a line
