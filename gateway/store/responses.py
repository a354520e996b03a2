"""The Responses API's stored responses, kept for the whole fleet.

An engine keeps the responses it made in its own memory, so ``previous_response_id``
would work only on that instance and die with it. The gateway keeps each stored
response instead (:mod:`gateway.pipeline.conversation`): in Redis at ``state.url`` when
one is configured (every replica sees it and it outlives any backend), else in this
process (the most recent ``responses.max_in_process``). A record is the response object
and the full input it answered (the previous turns expanded), as JSON, under its
caller's key name: one tenant never reads another's.

Errors: :class:`StoreUnavailable` when Redis does not answer (the caller answers 503).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from typing import Any

import orjson

from gateway.store.redis_client import redis_client

log = logging.getLogger("gateway.store")


class StoreUnavailable(Exception):
    """The store (Redis) did not answer."""


class ResponseStore:
    """Stored responses by (owner, response id): :meth:`get`, :meth:`put`,
    :meth:`delete`. ``url``: Redis (``None``: this process, at most ``max_in_process``
    records); records expire after ``ttl_s`` seconds either way. A record being written
    is waited for by a read of it, so a client's next turn never misses the turn it
    just got."""

    def __init__(self, url: str | None, namespace: str, *, ttl_s: int, max_in_process: int,
                 max_record_bytes: int, timeout_s: float = 0.25, cluster: bool = False) -> None:
        self.client = redis_client(url, timeout_s=timeout_s, cluster=cluster) if url else None
        self.prefix = f"tg:{{{namespace}}}:resp:"
        self.ttl_s = ttl_s
        self.max_in_process = max_in_process
        self.max_record_bytes = max_record_bytes
        self.local: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self.writing: dict[str, asyncio.Future[None]] = {}
        self.tasks: set[asyncio.Task[None]] = set()  # the Redis writes under way

    def _key(self, owner: str, response_id: str) -> str:
        return self.prefix + hashlib.sha256(owner.encode()).hexdigest()[:24] + ":" + response_id

    async def get(self, owner: str, response_id: str) -> dict[str, Any] | None:
        """The record of ``owner``'s response ``response_id``, or ``None``. Raises
        :class:`StoreUnavailable`."""
        key = self._key(owner, response_id)
        pending = self.writing.get(key)
        if pending is not None:
            await asyncio.shield(pending)
        if self.client is None:
            found = self.local.get(key)
            if found is None or found[0] < time.monotonic():
                return None
            raw: bytes | None = found[1]
        else:
            try:
                raw = await self.client.get(key)
            except Exception as e:  # noqa: BLE001 - any redis-py error: the store is unavailable
                raise StoreUnavailable(str(e) or type(e).__name__) from None
        return orjson.loads(raw) if raw else None

    def put(self, owner: str, response_id: str, record: dict[str, Any]) -> bool:
        """Keep ``record`` as ``owner``'s response ``response_id`` for ``ttl_s``, from
        now on for this process (a read of it waits for the Redis write under way);
        ``False`` when it is larger than ``max_record_bytes`` (not kept). A Redis write
        that fails is logged: the record is then not kept."""
        key = self._key(owner, response_id)
        raw = orjson.dumps(record)
        if len(raw) > self.max_record_bytes:
            return False
        if self.client is None:
            self.local[key] = (time.monotonic() + self.ttl_s, raw)
            self.local.move_to_end(key)
            while len(self.local) > self.max_in_process:
                self.local.popitem(last=False)
            return True
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.writing[key] = done
        task = asyncio.ensure_future(self._write(key, raw, done))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return True

    async def _write(self, key: str, raw: bytes, done: asyncio.Future[None]) -> None:
        assert self.client is not None
        try:
            await self.client.set(key, raw, ex=self.ttl_s)
        except Exception as e:  # noqa: BLE001 - any redis-py error: the record is not kept
            log.warning("a stored response was not written to Redis: %s", str(e) or type(e).__name__)
        finally:
            done.set_result(None)
            if self.writing.get(key) is done:
                del self.writing[key]

    async def delete(self, owner: str, response_id: str) -> bool:
        """Forget ``owner``'s response ``response_id``; whether there was one. Raises
        :class:`StoreUnavailable`."""
        key = self._key(owner, response_id)
        if self.client is None:
            return self.local.pop(key, None) is not None
        try:
            return bool(await self.client.delete(key))
        except Exception as e:  # noqa: BLE001 - any redis-py error: the store is unavailable
            raise StoreUnavailable(str(e) or type(e).__name__) from None

    async def close(self) -> None:
        if self.tasks:  # the writes under way finish first (each bounded by the client's timeout)
            await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.client is not None:
            await self.client.aclose()
