"""The Responses API's stored responses and conversations, kept for the whole fleet.

An engine keeps the responses it made in its own memory, so ``previous_response_id``
would work only on that instance and die with it. The gateway keeps each stored
response instead (:mod:`gateway.pipeline.conversation`): in Redis at ``state.url`` when
one is configured (every replica sees it and it outlives any backend), else in this
process (the most recent ``responses.max_in_process`` records). Every record is kept
under its caller's key name: one tenant never reads another's. Three kinds:

- a response (:meth:`ResponseStore.get`, :meth:`~ResponseStore.put`,
  :meth:`~ResponseStore.delete`): the response object and the full input it answered
  (the previous turns expanded), as JSON; a background response's record is rewritten
  as its status changes (:mod:`gateway.pipeline.background`), and a cancel asked on one
  replica is seen by the replica running it (:meth:`~ResponseStore.ask_cancel`);
- a conversation (OpenAI's Conversations API, :mod:`gateway.server.stored_routes`):
  its object (:meth:`~ResponseStore.conversation`) and its items, a list appended to
  atomically (:meth:`~ResponseStore.append_items`: a Redis list), so two turns of one
  conversation on two replicas both land.

Writes are issued at once and not awaited by the request that made them; a read of a
record waits for the writes of it under way, and the writes of one record are made in
the order they were asked, so a client's next call never misses what its last one kept.
Records expire ``ttl_s`` after their last write.

Errors: :class:`StoreUnavailable` when Redis does not answer (the caller answers 503).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from gateway.store.redis_client import redis_client

log = logging.getLogger("gateway.store")

RESPONSE, CONVERSATION, ITEMS, CANCEL = "resp", "conv", "convitems", "cancel"  # the kinds of record


class StoreUnavailable(Exception):
    """The store (Redis) did not answer."""


class ResponseStore:
    """Stored responses and conversations by (owner, id) (see the module docstring).
    ``url``: Redis (``None``: this process, at most ``max_in_process`` records);
    records expire after ``ttl_s`` seconds either way; a response or item larger than
    ``max_record_bytes`` is not kept."""

    def __init__(self, url: str | None, namespace: str, *, ttl_s: int, max_in_process: int,
                 max_record_bytes: int, timeout_s: float = 0.25, cluster: bool = False) -> None:
        self.client = redis_client(url, timeout_s=timeout_s, cluster=cluster) if url else None
        self.prefix = f"tg:{{{namespace}}}:"
        self.ttl_s = ttl_s
        self.max_in_process = max_in_process
        self.max_record_bytes = max_record_bytes
        self.local: OrderedDict[str, tuple[float, Any]] = OrderedDict()  # key -> (expiry, bytes | list[bytes])
        self.writing: dict[str, asyncio.Future[None]] = {}  # key -> its last write under way
        self.tasks: set[asyncio.Task[None]] = set()  # the Redis writes under way

    @property
    def shared(self) -> bool:
        """Whether the records live in Redis (other replicas see them)."""
        return self.client is not None

    def _key(self, kind: str, owner: str, rid: str) -> str:
        return f"{self.prefix}{kind}:{hashlib.sha256(owner.encode()).hexdigest()[:24]}:{rid}"

    # ---- responses ---------------------------------------------------------------------

    async def get(self, owner: str, response_id: str) -> dict[str, Any] | None:
        """The record of ``owner``'s response ``response_id``, or ``None``. Raises
        :class:`StoreUnavailable`."""
        raw = await self._get(self._key(RESPONSE, owner, response_id))
        return orjson.loads(raw) if raw else None

    def put(self, owner: str, response_id: str, record: dict[str, Any]) -> bool:
        """Keep ``record`` as ``owner``'s response ``response_id`` for ``ttl_s``, from
        now on for this process (a read of it waits for the Redis write under way);
        ``False`` when it is larger than ``max_record_bytes`` (not kept). A Redis write
        that fails is logged: the record is then not kept."""
        raw = orjson.dumps(record)
        if len(raw) > self.max_record_bytes:
            return False
        self._set(self._key(RESPONSE, owner, response_id), raw)
        return True

    async def delete(self, owner: str, response_id: str) -> bool:
        """Forget ``owner``'s response ``response_id``; whether there was one. Raises
        :class:`StoreUnavailable`."""
        return await self._delete(self._key(RESPONSE, owner, response_id))

    def ask_cancel(self, owner: str, response_id: str) -> None:
        """Mark ``owner``'s background response ``response_id`` as to be cancelled,
        for the replica running it (:meth:`cancel_asked`)."""
        self._set(self._key(CANCEL, owner, response_id), b"1")

    async def cancel_asked(self, owner: str, response_id: str) -> bool:
        """Whether a cancel of ``owner``'s response ``response_id`` was asked. Raises
        :class:`StoreUnavailable`."""
        return bool(await self._get(self._key(CANCEL, owner, response_id)))

    # ---- conversations -----------------------------------------------------------------

    async def conversation(self, owner: str, cid: str) -> dict[str, Any] | None:
        """``owner``'s conversation object ``cid``, or ``None``. Raises
        :class:`StoreUnavailable`."""
        raw = await self._get(self._key(CONVERSATION, owner, cid))
        return orjson.loads(raw) if raw else None

    def put_conversation(self, owner: str, cid: str, obj: dict[str, Any]) -> None:
        """Keep ``obj`` as ``owner``'s conversation ``cid`` (its items apart), its
        items' expiry renewed with it."""
        self._set(self._key(CONVERSATION, owner, cid), orjson.dumps(obj))
        self._touch(self._key(ITEMS, owner, cid))

    async def items(self, owner: str, cid: str) -> list[dict[str, Any]]:
        """The items of ``owner``'s conversation ``cid``, oldest first. Raises
        :class:`StoreUnavailable`."""
        raws = await self._list(self._key(ITEMS, owner, cid))
        return [orjson.loads(r) for r in raws]

    def append_items(self, owner: str, cid: str, items: list[dict[str, Any]]) -> bool:
        """Append ``items`` to ``owner``'s conversation ``cid`` (atomically, whatever
        other replica appends meanwhile) and renew its expiry; ``False`` (nothing
        appended) when one is larger than ``max_record_bytes``."""
        raws = [orjson.dumps(i) for i in items]
        if any(len(r) > self.max_record_bytes for r in raws):
            return False
        if raws:
            self._push(self._key(ITEMS, owner, cid), raws)
            self._touch(self._key(CONVERSATION, owner, cid))
        return True

    async def remove_item(self, owner: str, cid: str, item: dict[str, Any]) -> bool:
        """Remove ``item`` (as :meth:`items` read it) from ``owner``'s conversation
        ``cid``; whether it was there. Raises :class:`StoreUnavailable`."""
        key = self._key(ITEMS, owner, cid)
        await self._settled(key)
        raw = orjson.dumps(item)
        if self.client is None:
            found = self._local(key)
            if not isinstance(found, list) or raw not in found:
                return False
            found.remove(raw)
            return True
        try:
            return bool(await self.client.lrem(key, 1, raw))
        except Exception as e:  # noqa: BLE001 - any redis-py error: the store is unavailable
            raise StoreUnavailable(str(e) or type(e).__name__) from None

    async def delete_conversation(self, owner: str, cid: str) -> bool:
        """Forget ``owner``'s conversation ``cid`` and its items; whether there was
        one. Raises :class:`StoreUnavailable`."""
        found = await self._delete(self._key(CONVERSATION, owner, cid))
        await self._delete(self._key(ITEMS, owner, cid))
        return found

    # ---- the two stores' primitives ----------------------------------------------------

    def _local(self, key: str) -> Any:
        found = self.local.get(key)
        if found is None:
            return None
        if found[0] < time.monotonic():
            del self.local[key]
            return None
        return found[1]

    def _keep_local(self, key: str, value: Any) -> None:
        self.local[key] = (time.monotonic() + self.ttl_s, value)
        self.local.move_to_end(key)
        while len(self.local) > self.max_in_process:
            self.local.popitem(last=False)

    async def _settled(self, key: str) -> None:
        pending = self.writing.get(key)
        if pending is not None:
            await asyncio.shield(pending)

    async def _get(self, key: str) -> bytes | None:
        await self._settled(key)
        if self.client is None:
            found = self._local(key)
            return found if isinstance(found, bytes) else None
        try:
            return await self.client.get(key)
        except Exception as e:  # noqa: BLE001 - any redis-py error: the store is unavailable
            raise StoreUnavailable(str(e) or type(e).__name__) from None

    async def _list(self, key: str) -> list[bytes]:
        await self._settled(key)
        if self.client is None:
            found = self._local(key)
            return list(found) if isinstance(found, list) else []
        try:
            return list(await self.client.lrange(key, 0, -1))
        except Exception as e:  # noqa: BLE001 - any redis-py error: the store is unavailable
            raise StoreUnavailable(str(e) or type(e).__name__) from None

    async def _delete(self, key: str) -> bool:
        await self._settled(key)
        if self.client is None:
            return self.local.pop(key, None) is not None
        try:
            return bool(await self.client.delete(key))
        except Exception as e:  # noqa: BLE001 - any redis-py error: the store is unavailable
            raise StoreUnavailable(str(e) or type(e).__name__) from None

    def _set(self, key: str, raw: bytes) -> None:
        if self.client is None:
            self._keep_local(key, raw)
            return
        client, ttl = self.client, self.ttl_s
        self._write(key, lambda: client.set(key, raw, ex=ttl))

    def _push(self, key: str, raws: list[bytes]) -> None:
        if self.client is None:
            found = self._local(key)
            self._keep_local(key, (found if isinstance(found, list) else []) + raws)
            return
        client, ttl = self.client, self.ttl_s

        async def push() -> None:
            async with client.pipeline(transaction=True) as p:
                p.rpush(key, *raws)
                p.expire(key, ttl)
                await p.execute()
        self._write(key, push)

    def _touch(self, key: str) -> None:
        if self.client is None:
            found = self._local(key)
            if found is not None:
                self._keep_local(key, found)
            return
        client, ttl = self.client, self.ttl_s
        self._write(key, lambda: client.expire(key, ttl))

    def _write(self, key: str, op: Callable[[], Awaitable[Any]]) -> None:
        """Issue the Redis write ``op`` of ``key`` after the one of it under way."""
        previous = self.writing.get(key)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.writing[key] = done
        task = asyncio.ensure_future(self._written(key, op, done, previous))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _written(self, key: str, op: Callable[[], Awaitable[Any]], done: asyncio.Future[None],
                       previous: asyncio.Future[None] | None) -> None:
        try:
            if previous is not None:
                await asyncio.shield(previous)
            await op()
        except Exception as e:  # noqa: BLE001 - any redis-py error: the record is not kept
            log.warning("a stored response or conversation was not written to Redis: %s", str(e) or type(e).__name__)
        finally:
            done.set_result(None)
            if self.writing.get(key) is done:
                del self.writing[key]

    async def close(self) -> None:
        if self.tasks:  # the writes under way finish first (each bounded by the client's timeout)
            await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.client is not None:
            await self.client.aclose()
