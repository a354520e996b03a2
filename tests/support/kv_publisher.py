"""A KV-event publisher on 127.0.0.1 that behaves like vLLM's ``ZmqEventPublisher``:
a PUB socket sending ``[topic, seq (8-byte big-endian), payload]`` and a ROUTER replay
socket that answers a start seq (8 bytes big-endian) with ``[seq, payload]`` for each
buffered batch from there, then ``seq = -1`` and an empty payload. Test code chooses
the faults: drop a message, forget the buffer's head, restart with seq 0."""

from __future__ import annotations

import asyncio
import random
import socket
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import zmq
import zmq.asyncio

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVPublisher:
    def __init__(self, ctx: zmq.asyncio.Context, topic: str = "kv-events", buffer_steps: int = 10_000,
                 ports: tuple[int, int] | None = None) -> None:
        self.ctx = ctx
        self.topic = topic.encode()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{ports[0] if ports else '*'}")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(f"tcp://127.0.0.1:{ports[1] if ports else '*'}")
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.replay_requests: list[int] = []
        self.replay_silent = False  # answer no replay request (a hung replay socket)
        self.replay_topic_frame = False  # vLLM 0.32 replies [topic, seq, payload], older ones [seq, payload]
        self._task: asyncio.Task | None = None

    async def publish(self, payload: bytes, *, drop: bool = False) -> int:
        """Publish the next batch (``drop``: buffered for replay, never sent live, as
        when a subscriber's queue overflowed). Returns its seq."""
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if not drop:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def forget_before(self, seq: int) -> None:
        """The replay buffer moved on: batches before ``seq`` are gone."""
        while self.buffer and self.buffer[0][0] < seq:
            self.buffer.popleft()

    def restart(self) -> None:
        """An engine restart: sequence numbers start at 0 again, the buffer is empty."""
        self.seq = 0
        self.buffer.clear()

    async def restart_process(self) -> None:
        """An engine process restart: the sockets close (subscribers see the
        connection drop) and bind the same addresses again; sequence numbers start at
        0, the buffer is empty."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.pub = await self._rebind(zmq.PUB, self.endpoint)
        self.router = await self._rebind(zmq.ROUTER, self.replay_endpoint)
        self.restart()
        self.start()

    async def _rebind(self, kind: int, endpoint: str, tries: int = 500) -> zmq.asyncio.Socket:
        """A new socket bound to ``endpoint``, which libzmq's I/O thread releases a
        moment after the old socket's close: retried while it is still in use
        (bounded)."""
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        for _ in range(tries):
            try:
                sock.bind(endpoint)
                return sock
            except zmq.ZMQError as e:
                if e.errno != zmq.EADDRINUSE:
                    raise
                await asyncio.sleep(0.01)
        raise AssertionError(f"{endpoint} stayed in use")

    async def _serve_replay(self) -> None:
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            self.replay_requests.append(start)
            if self.replay_silent:
                continue
            head = [client, b"", self.topic] if self.replay_topic_frame else [client, b""]
            for seq, buf in list(self.buffer):
                if seq >= start:
                    await self.router.send_multipart([*head, seq.to_bytes(8, "big"), buf])
            end = [client, b"", b""] if self.replay_topic_frame else [client, b""]
            await self.router.send_multipart([*end, END_SEQ, b""])

    def start(self) -> None:
        self._task = asyncio.create_task(self._serve_replay())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.pub.close(linger=0)
        self.router.close(linger=0)


@asynccontextmanager
async def kv_publisher(topic: str = "kv-events") -> AsyncIterator[KVPublisher]:
    ctx = zmq.asyncio.Context()
    p = KVPublisher(ctx, topic)
    p.start()
    try:
        yield p
    finally:
        await p.close()
        ctx.term()


def _port_pair_free(port: int) -> bool:
    for p in (port, port + 1):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                return False
    return True


@asynccontextmanager
async def ranked_publishers(ranks: int, topic: str = "kv-events") -> AsyncIterator[list[KVPublisher]]:
    """``ranks`` publishers as a data-parallel engine places them: rank ``r`` on the
    PUB port + ``r`` and the replay port + ``r``."""
    ctx = zmq.asyncio.Context()
    pubs: list[KVPublisher] = []
    try:
        for _ in range(50):  # two free consecutive loopback ports, bounded search
            base = random.randrange(20000, 60000, 2 * ranks)
            if all(_port_pair_free(base + 2 * r) for r in range(ranks)):
                break
        else:
            raise AssertionError("no free loopback ports")
        for r in range(ranks):
            # PUB ports base, base+1, ...; replay ports base+ranks, base+ranks+1, ...
            p = KVPublisher(ctx, topic, ports=(base + r, base + ranks + r))
            p.start()
            pubs.append(p)
        yield pubs
    finally:
        for p in pubs:
            await p.close()
        ctx.term()


async def publish_until(pub: KVPublisher, payload: bytes, seen: Callable[[], bool], *, tries: int = 500) -> None:
    """Publish ``payload`` again and again until ``seen()`` (the subscriber got one):
    a SUB socket receives only what is sent after its connection is made (ZMQ's
    "slow joiner"). Bounded: fails after ``tries`` messages."""
    for _ in range(tries):
        await pub.publish(payload)
        for _ in range(5):
            await asyncio.sleep(0.002)
            if seen():
                return
    raise AssertionError("the subscriber never received a message")
