"""Subscriptions to the engines' KV-cache events (ZMQ, vLLM's format).

For every backend with ``kv_events`` in the config and every data-parallel rank of it
(rank ``r`` publishes on the endpoint's port + ``r``, as vLLM's
``ZmqEventPublisher.offset_endpoint_port`` places it), one task of the gateway's own
event loop reads a pyzmq asyncio SUB socket: multipart messages ``[topic, seq
(8-byte big-endian), payload]``, every message already queued at each wake-up (up to
:data:`DRAIN_MAX`). No thread of ours; libzmq's I/O thread queues what arrives while
the loop is busy.

Sequence numbers are checked (:class:`routing.core.SequenceTracker`):

- a gap (``seq`` later than the next expected) is filled from the engine's replay
  socket: vLLM's ROUTER takes the start seq as 8 bytes big-endian and answers
  ``[seq, payload]`` for each buffered batch from there, then ``seq = -1`` with an
  empty payload (vLLM 0.32 puts the topic frame first: ``[topic, seq, payload]`` and
  ``[b"", -1, b""]``; both are read). We speak it from a DEALER with REQ's empty
  delimiter frame (a REQ socket accepts one reply per request; the ROUTER sends many). When the replay
  does not start at the missing seq (its buffer moved on), fails or sends nothing
  for ``replay_timeout_s``, the backend's precise entries of that rank are dropped
  and its lookups fall back to approximate until it stores again;
- the first message of a subscription asks for a replay from 0, so that a gateway
  started after the engine learns what the engine's buffer still holds (whatever the
  replay cannot give is simply not known: nothing to drop);
- a ``seq`` lower than this engine run's (vLLM counts from 0 at start) is an engine
  restart: that rank's precise entries are dropped, and the new run's earlier messages
  are asked for as on a first message. A restart can also hide behind a dropped
  connection (the socket monitor says so) when the new run has sent more messages than
  the old one by the time we hear from it: the first message after a reconnection is
  checked by replaying the last batch applied and comparing it (xxh3 of the payload)
  with what was applied; another batch there, or no replay, means a new run;
- replayed batches that the live socket delivers again are skipped.

Payloads go to the decision core (:meth:`routing.core.DecisionCore.kv_event_batch`),
which decodes them and updates the prefix index; a bad payload is counted there,
never raised here. :class:`KVEventSubscribers` follows the config: started by
:func:`gateway.runtime.connect`, changed by every reload, stopped at shutdown.
"""

from __future__ import annotations

import asyncio
import logging
from typing import cast

import xxhash
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from gateway.config import GatewayConfig, KVEvents
from routing.core import DUPLICATE, GAP, RESTART, DecisionCore, SequenceTracker

log = logging.getLogger("gateway.engine_signals.kv_event_subscriber")

END_SEQ = -1
DRAIN_MAX = 256  # messages read per wake-up at most, so that other tasks get the loop


def rank_endpoint(endpoint: str, rank: int) -> str:
    """``endpoint`` with its port moved up by ``rank`` (``tcp://h:5557``, 2 ->
    ``tcp://h:5559``); rank 0 and ``ipc://`` addresses are unchanged."""
    if rank == 0 or not endpoint.startswith("tcp://"):
        return endpoint
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


class RankSubscriber:
    """One data-parallel rank of one backend: its SUB socket, its sequence numbers,
    its replays. :meth:`run` until cancelled."""

    def __init__(self, core: DecisionCore, ctx: zmq.asyncio.Context, backend: str, rank: int, spec: KVEvents) -> None:
        self.core = core
        self.ctx = ctx
        self.backend = backend
        self.rank = rank
        self.endpoint = rank_endpoint(spec.endpoint, rank)
        self.replay_endpoint = rank_endpoint(spec.replay_endpoint, rank) if spec.replay_endpoint else None
        self.topic = spec.topic.encode()
        self.replay_timeout_s = spec.replay_timeout_s
        self.tracker = SequenceTracker()
        self.last_digest: int | None = None  # xxh3 of the last payload applied
        self.reconnected = False  # the PUB connection dropped since the last message

    async def run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sub.connect(self.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        # what is already queued is read without the event loop (a non-blocking read
        # each): one wake-up takes a burst of messages instead of one
        sub_now: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)
        monitor_now: zmq.Socket[bytes] = zmq.Socket.shadow(monitor.underlying)
        log.info("subscribed to the KV events of %s (rank %d) at %s", self.backend, self.rank, self.endpoint)
        try:
            while True:
                await poller.poll()
                for _ in range(DRAIN_MAX):
                    if cast(int, monitor_now.get(zmq.EVENTS)) & zmq.POLLIN:
                        parse_monitor_message(monitor_now.recv_multipart())  # only EVENT_DISCONNECTED is asked for
                        self.reconnected = True
                    try:
                        frames = sub_now.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if len(frames) == 3:
                        await self.on_live(frames[1], frames[2])
                    else:  # not [topic, seq, payload]: counted as undecodable
                        self.core.kv_event_batch(self.backend, self.rank, b"")
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    def apply(self, payload: bytes) -> None:
        self.core.kv_event_batch(self.backend, self.rank, payload)
        self.last_digest = xxhash.xxh3_64_intdigest(payload)

    async def on_live(self, seq_bytes: bytes, payload: bytes) -> None:
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        expected = self.tracker.expected
        verify = self.reconnected and expected is not None
        self.reconnected = False
        verdict = self.tracker.observe(seq)
        if verdict == DUPLICATE:
            return
        restart = verdict == RESTART
        if verify and not restart and expected is not None and not await self.same_run(expected - 1):
            restart = True  # a new run whose sequence passed ours before we heard of it
            self.tracker.reset_to(seq)
        if restart:
            log.info("KV events of %s (rank %d) restarted at seq %d: its precise entries are dropped",
                     self.backend, self.rank, seq)
            self.core.kv_event_restart(self.backend, self.rank)
        catch_up = expected is None or restart  # a new subscription, or a new run
        gap = verdict == GAP and not restart
        if gap or (catch_up and seq > 0 and self.replay_endpoint is not None):
            start = 0 if catch_up else self.tracker.expected
            assert start is not None
            if await self.fill(start, seq, initial=catch_up):
                return  # the replay brought seq itself too
        self.apply(payload)
        if gap:
            self.tracker.reset_to(seq)

    async def same_run(self, seq: int) -> bool:
        """After the connection to the publisher dropped: whether the engine still
        holds, at ``seq``, the batch applied last (the same run), rather than a new
        run's (a restart whose sequence numbers passed ours meanwhile). Without a
        replay socket, or when it fails, it counts as a new run."""
        if self.replay_endpoint is None or self.last_digest is None:
            return False
        batches = await self.replay(seq)
        if not batches:
            return False
        return batches[0][0] == seq and xxhash.xxh3_64_intdigest(batches[0][1]) == self.last_digest

    async def fill(self, start: int, live_seq: int, *, initial: bool) -> bool:
        """Replay from ``start`` and apply it. For a gap, the replay must cover
        ``start`` .. ``live_seq - 1`` without a hole (else the rank's precise entries
        are dropped); for a new subscription's catch-up (``initial``), the longest run
        without a hole that ends just before ``live_seq`` is applied (an earlier part
        after a hole could hold a store whose removal is in the hole). Returns whether
        ``live_seq`` itself was applied."""
        batches = await self.replay(start) if self.replay_endpoint is not None else None
        batches = batches or []
        if initial:
            run: list[tuple[int, bytes]] = []
            for s, payload in reversed([b for b in batches if b[0] < live_seq]):
                if s != live_seq - 1 - len(run):
                    break
                run.append((s, payload))
            run.reverse()
        else:
            run = []
            for s, payload in batches:
                if s != start + len(run):
                    break
                run.append((s, payload))
            filled = bool(run) and run[-1][0] >= live_seq - 1
            self.core.kv_event_gap(self.backend, self.rank, filled)
            if not filled:
                return False
        for _, payload in run:
            self.apply(payload)
        if not run:
            return False
        self.tracker.replayed(run[0][0], run[-1][0])
        return run[-1][0] >= live_seq

    async def replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """The batches the engine's replay socket holds from ``start`` on, in order, or
        ``None`` when the replay failed (no answer within ``replay_timeout_s``)."""
        assert self.replay_endpoint is not None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            out: list[tuple[int, bytes]] = []
            while True:
                if not await dealer.poll(int(self.replay_timeout_s * 1000)):
                    log.warning("the KV-event replay of %s (rank %d) from %s sent nothing for %.1f s",
                                self.backend, self.rank, self.replay_endpoint, self.replay_timeout_s)
                    return None
                frames = await dealer.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]  # REQ's delimiter
                if len(frames) not in (2, 3) or len(frames[-2]) != 8:  # [topic,] seq, payload
                    log.warning("the KV-event replay of %s (rank %d) sent %d frames, not [topic,] seq, payload",
                                self.backend, self.rank, len(frames))
                    return None
                s = int.from_bytes(frames[-2], "big", signed=True)
                if s == END_SEQ:
                    out.sort(key=lambda sp: sp[0])
                    return out
                if s >= start:
                    out.append((s, frames[-1]))
        finally:
            dealer.close(linger=0)


class KVEventSubscribers:
    """Every backend's subscriptions, following the config (:meth:`configure`)."""

    def __init__(self, core: DecisionCore) -> None:
        self.core = core
        self.ctx = zmq.asyncio.Context()
        self.running: dict[str, tuple[KVEvents, list[asyncio.Task]]] = {}

    def configure(self, cfg: GatewayConfig) -> None:
        """Start the subscriptions of new or changed ``kv_events`` and stop the ones
        gone, in the running loop (synchronously). A backend whose subscription
        changes forgets its precise entries: the new address may be another engine."""
        wanted = {b.name: b.kv_events for b in cfg.backends if b.kv_events is not None}
        for name in list(self.running):
            spec, tasks = self.running[name]
            if wanted.get(name) != spec:
                for t in tasks:
                    t.cancel()
                del self.running[name]
                if name in wanted:
                    self.core.kv_event_reset(name)
        for name, spec in wanted.items():
            if name in self.running:
                continue
            tasks = [asyncio.create_task(self._run(name, r, spec), name=f"kv-events-{name}-{r}")
                     for r in range(spec.data_parallel_size)]
            self.running[name] = (spec, tasks)

    async def _run(self, backend: str, rank: int, spec: KVEvents) -> None:
        """One rank's subscription until cancelled. An unexpected error is logged and the
        subscription starts again (after 1 s, doubling to 30 s while it keeps failing);
        what it missed meanwhile counts as a gap replay could not fill."""
        delay = 1.0
        while True:
            sub = RankSubscriber(self.core, self.ctx, backend, rank, spec)
            try:
                await sub.run()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("the KV-event subscription of %s (rank %d) failed; starting it again in %.0f s",
                              backend, rank, delay)
            self.core.kv_event_gap(backend, rank, filled=False)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)

    async def stop(self) -> None:
        """Cancel every subscription, wait for them (bounded), then close whatever
        socket is left and the context (never blocking on unsent messages)."""
        tasks = [t for _, ts in self.running.values() for t in ts]
        self.running.clear()
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        self.ctx.destroy(linger=0)
