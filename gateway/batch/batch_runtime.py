"""What a gateway with ``batch.enabled`` holds (:class:`BatchRuntime`), and the app key
it is held under (:data:`BATCH`): the batch API's handlers, the admin endpoints and the
app's lifecycle read it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from gateway.batch.worker import Consumer


class BatchRuntime:
    """What a gateway with ``batch.enabled`` holds: store, manager, gate, workers."""

    def __init__(self, cfg, store, manager, gate) -> None:
        self.cfg = cfg
        self.store = store
        self.manager = manager
        self.gate = gate
        self.consumer: Consumer | None = None  # the in-process one, when batch.workers > 0
        self.tasks: list[asyncio.Task] = []  # the manager and the in-process consumers, while the app runs


BATCH = web.AppKey("batch", BatchRuntime)
