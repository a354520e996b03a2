"""The engines' KV-cache events as the decision core takes them: one payload applied to the
prefix index (decoded by :mod:`routing.kv_event_decoding`), a sequence gap, a changed
subscription, a restarted rank; counted per backend in :class:`KVEventStats`.

:class:`KVEventIntake` is a part of :class:`routing.core.DecisionCore`, which holds the
attributes declared here; the subscriber (``gateway/engine_signals/kv_event_subscriber.py``)
calls these methods on the core.
"""

from __future__ import annotations

import logging

from routing.kv_event_decoding import KVEventDecodeError, KVEventStats, apply_batch, decode_batch
from routing.prefix_index import PrefixIndex

log = logging.getLogger("routing.kv_event_decoding")


class KVEventIntake:
    """The KV events of the backends that publish them, on the decision core's state."""

    index: PrefixIndex
    kv_stats: dict[str, KVEventStats]  # per backend publishing KV events


    def kv_event_batch(self, backend: str, rank: int, payload: bytes) -> None:
        """Apply one KV-event payload (msgpack ``EventBatch``) from ``backend``'s
        data-parallel ``rank`` to the prefix index. Never raises on bad input: an
        undecodable payload or event is counted and logged once per backend."""
        stats = self.kv_stats.get(backend)
        if stats is None:
            return  # not (or no longer) a backend with events
        try:
            batch = decode_batch(payload)
        except KVEventDecodeError as e:
            stats.batches += 1
            stats.decode_errors += 1
            stats.first_error = stats.first_error or str(e)
            if "payload" not in stats.warned:
                stats.warned.add("payload")
                log.warning("undecodable KV event payload from %s (counted, skipped): %s", backend, e)
            return
        for msg in apply_batch(self.index, backend, rank, batch, stats):
            log.warning("%s (counted, skipped; logged once)", msg)

    def kv_event_gap(self, backend: str, rank: int, filled: bool) -> None:
        """``backend``'s ``rank`` skipped sequence numbers; ``filled``: a replay
        supplied them. Unfilled, its precise entries of that rank are dropped and its
        lookups fall back to approximate until its next stored block."""
        stats = self.kv_stats.get(backend)
        if stats is None:
            return
        stats.gaps += 1
        if filled:
            stats.replays += 1
            return
        stats.replay_failures += 1
        self.index.clear_precise(backend, rank)
        self.index.set_live(backend, False)
        if "gap" not in stats.warned:
            stats.warned.add("gap")
            log.warning("KV events of %s (rank %d) lost a gap that replay could not fill: its precise prefix "
                        "entries were dropped (logged once)", backend, rank)

    def kv_event_reset(self, backend: str) -> None:
        """``backend``'s subscription changed (maybe to another engine): its precise
        entries go and its lookups are approximate until it stores again."""
        if backend in self.kv_stats:
            self.index.clear_precise(backend)
            self.index.set_live(backend, False)

    def kv_event_restart(self, backend: str, rank: int) -> None:
        """``backend``'s ``rank`` restarted (its sequence numbers went back): its cache
        is empty, so are its precise entries of that rank."""
        stats = self.kv_stats.get(backend)
        if stats is None:
            return
        stats.restarts += 1
        self.index.clear_precise(backend, rank)
