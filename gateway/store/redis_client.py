"""The Redis client every shared store uses, made one way from a ``state.url``.

Every call gets ``timeout_s`` to connect and to answer and no automatic retry, so a
frozen server costs one timeout, never a hang; the background loops that use the
client (:mod:`gateway.store.background_sync`) bound each round on top of that.
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from typing import Any
from urllib.parse import unquote, urlsplit


def parse_sentinel_url(url: str) -> tuple[list[tuple[str, int]], str, int, str | None]:
    """``redis+sentinel://[:password@]host:port[,host:port...]/service[/db]`` to
    (sentinel addresses, master service name, db, password). Raises ``ValueError``."""
    rest = url.removeprefix("redis+sentinel://")
    password = None
    if "@" in rest:
        cred, rest = rest.rsplit("@", 1)
        password = unquote(cred.split(":", 1)[1] if ":" in cred else cred) or None
    hostpart, _, path = rest.partition("/")
    parts = [p for p in path.split("/") if p]
    if not hostpart or not parts:
        raise ValueError("expected redis+sentinel://host:port[,host:port...]/service[/db]")
    hosts = []
    for h in hostpart.split(","):
        host, _, port = h.rpartition(":")
        hosts.append((host or h, int(port) if host else 26379))
    return hosts, parts[0], int(parts[1]) if len(parts) > 1 else 0, password


def redis_client(url: str, *, timeout_s: float, cluster: bool = False) -> Any:
    """A redis-py asyncio client for a ``state.url``: standalone (``redis://``,
    ``rediss://``, ``unix://``), Cluster (``cluster=True``) or Sentinel
    (``redis+sentinel://``). Every call gets ``timeout_s`` to connect and to answer,
    and no automatic retry, so a frozen server costs one timeout, never a hang."""
    import redis.asyncio as aioredis

    kw: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
                          "retry_on_timeout": False, "health_check_interval": 0}
    if url.startswith("redis+sentinel://"):
        from redis.asyncio.sentinel import Sentinel

        hosts, service, db, password = parse_sentinel_url(url)
        sentinel = Sentinel(hosts, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        return sentinel.master_for(service, db=db, password=password, **kw)
    if cluster:
        from redis.asyncio.cluster import RedisCluster

        return RedisCluster.from_url(url, **kw)
    return aioredis.from_url(url, **kw)


def replica_id() -> str:
    """This process's name among the replicas sharing a store: host, PID and a random
    suffix (a restarted process on the same host and PID is a new replica)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def safe_url(url: str) -> str:
    """``url`` without its password (and path), for the log."""
    u = urlsplit(url)
    host = u.hostname or u.path
    return f"{u.scheme}://{host}{':' + str(u.port) if u.port else ''}"


async def close_client(client: Any, key: str, timeout_s: float) -> None:
    """Delete this replica's ``key`` (best effort: the others then stop counting it at
    once rather than at its lease's end) and close ``client``. Each step waits at most
    ``max(timeout_s, 1)`` seconds; never raises but ``CancelledError`` (of the caller)."""
    if client is None:
        return
    bound = max(timeout_s, 1.0)
    for step in (lambda: client.delete(key), client.aclose):
        try:
            async with asyncio.timeout(bound):
                await step()
        except Exception:  # noqa: BLE001 - best effort on shutdown
            pass
