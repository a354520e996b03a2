"""The simulator's KV-cache events over real ZMQ sockets on 127.0.0.1.

A SUB client (and a REQ client for replay) in the test decodes every message with plain
``msgpack``, as any consumer of vLLM's events would, and checks the wire shapes of both
encodings, the sequence numbers, that the events mirror the engine's prefix cache through
evictions and preemptions, replay, and the fault modes (dropped batches, a stopped
publisher, a restart). Waits are condition waits with a bound, never sleeps.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from loadtest.sim.engine import block_hash, lora_extra_key
from loadtest.sim.server import start_backends
from loadtest.sim.spec import FaultConfig, KVEventsConfig, SimBackendConfig
from loadtest.sim.tokenizer import HFTokenizer

ROOT = Path(__file__).resolve().parents[4]
TOKENIZER = str(ROOT / "scripts" / "tokenizer.json")
MODEL = "sim-model"
SYSTEM = "You are a careful assistant for the billing team of a large company. " * 6
STORED_KEYS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
               "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"]
WAIT_S = 20.0


@asynccontextmanager
async def backend(**spec):
    cfg = SimBackendConfig.from_dict({"name": "sim-kv", "models": [MODEL], "speed": 50.0,
                                      "kv_events": {"topic": "kv-events"}, **spec})
    (b,), _ = await start_backends([cfg])
    try:
        async with aiohttp.ClientSession() as session:
            yield session, b
    finally:
        await b.cleanup()


class Subscriber:
    """A ZMQ SUB socket on the backend's PUB endpoint; ``recv()`` -> ``(seq, batch)``."""

    def __init__(self, endpoint: str, topic: bytes = b"kv-events"):
        self.sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)
        self.topic = topic

    async def recv(self, timeout: float = WAIT_S) -> tuple[int, list]:
        frames = await asyncio.wait_for(self.sock.recv_multipart(), timeout)
        assert len(frames) == 3, frames
        topic, seq, payload = frames
        assert topic == self.topic and len(seq) == 8
        return int.from_bytes(seq, "big"), msgpack.unpackb(payload)

    async def joined(self, session, url: str) -> int:
        """Wait until the subscription is live (a PUB drops messages for a subscriber it
        has not seen yet): trigger an AllBlocksCleared batch per round until one
        arrives. Returns the next seq the publisher will use."""
        for _ in range(200):
            async with session.post(url + "/reset_prefix_cache") as r:
                assert r.status == 200
            if await self.sock.poll(50):
                seq, _batch = await self.recv()
                while await self.sock.poll(0):  # earlier rounds' batches still in flight
                    seq, _batch = await self.recv()
                return seq + 1
        raise AssertionError("the SUB socket never received a batch")

    def close(self) -> None:
        self.sock.close(linger=0)


async def replay(endpoint: str, start: int, topic: bytes | None = b"kv-events") -> list[tuple[int, bytes]]:
    """Ask the replay socket for every buffered batch from ``start``: the ``(seq,
    payload)`` replies up to (without) the ``-1`` end marker. A DEALER sends what a
    REQ would (``[b"", start]``) but, unlike a REQ, takes more than one reply.
    ``topic``: the topic frame each reply carries (None: replies without one)."""
    req = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(endpoint)
    try:
        await req.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            frames = await asyncio.wait_for(req.recv_multipart(), WAIT_S)
            assert frames[0] == b""
            if topic is None:
                assert len(frames) == 3
                seq, payload = frames[1:]
            else:
                assert len(frames) == 4
                t, seq, payload = frames[1:]
            n = int.from_bytes(seq, "big", signed=True)
            if n == -1:
                assert payload == b"" and (topic is None or t == b"")
                return out
            assert topic is None or t == topic
            out.append((n, payload))
    finally:
        req.close(linger=0)


async def complete(session, url: str, prompt: str, max_tokens: int = 4) -> dict:
    async with session.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                             "max_tokens": max_tokens, "ignore_eos": True}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def tokenize(session, url: str, prompt: str) -> list[int]:
    async with session.post(url + "/tokenize", json={"model": MODEL, "prompt": prompt}) as r:
        assert r.status == 200
        return (await r.json())["tokens"]


async def stats(session, url: str) -> dict:
    async with session.get(url + "/admin/stats") as r:
        return await r.json()


async def set_faults(session, url: str, **faults) -> None:
    async with session.post(url + "/admin/faults", json=faults) as r:
        assert r.status == 200, await r.text()


async def events_until(sub: Subscriber, pred, limit: int = 1000) -> list[tuple[int, dict | list]]:
    """``(seq, event)`` pairs received up to the first for which ``pred(seq, event)``
    holds (the last pair; bounded)."""
    out = []
    for _ in range(limit):
        seq, (_ts, events, _rank) = await sub.recv()
        for e in events:
            out.append((seq, e))
            if pred(seq, e):
                return out
    raise AssertionError(f"no matching event in {limit} batches")


# ---- shapes ------------------------------------------------------------------------


async def test_block_stored_carries_the_prompt_tokens_of_a_real_tokenizer_as_vllm_0_32_sends():
    bs = 16
    async with backend(tokenizer=TOKENIZER, profile_overrides={"block_size": bs}) as (session, b):
        sub = Subscriber(b.kv_publisher.endpoint)
        try:
            seq0 = await sub.joined(session, b.url)
            prompt = SYSTEM + "How do I read an invoice?"
            ids = await tokenize(session, b.url, prompt)
            assert ids == HFTokenizer(TOKENIZER).tokenize(prompt)
            await complete(session, b.url, prompt)
            seq, batch = await sub.recv()
            assert seq == seq0
            ts, events, rank = batch
            assert isinstance(ts, float) and rank == 0 and len(events) == 1
            ev = events[0]
            assert list(ev) == STORED_KEYS  # omit_defaults: kv_cache_spec_sliding_window absent
            n = len(ids) // bs
            assert ev["type"] == "BlockStored" and ev["parent_block_hash"] is None
            assert ev["token_ids"] == ids[: n * bs] and ev["block_size"] == bs
            assert len(ev["block_hashes"]) == n and all(isinstance(h, int) for h in ev["block_hashes"])
            assert ev["medium"] == "GPU" and ev["extra_keys"] == [None] * n and ev["group_idx"] == 0
            assert ev["lora_id"] is None and ev["lora_name"] is None
            assert ev["kv_cache_spec_kind"] == "full_attention"
            # the hashes chain over the token ids the event carries
            parent = 0
            for i, h in enumerate(ev["block_hashes"]):
                parent = block_hash(parent, ev["token_ids"][i * bs:(i + 1) * bs])
                assert h == parent
            # generated tokens fill blocks too: later stores chain onto the prompt's last block
            first = ev["block_hashes"]

            # Same system prompt, another question: the shared blocks are hits, and the new
            # blocks' store names the last shared block as parent.
            prompt2 = SYSTEM + "Why was I charged twice this month, and what can I do about it?"
            ids2 = await tokenize(session, b.url, prompt2)
            shared = 0
            while shared < min(len(ids), len(ids2)) and ids[shared] == ids2[shared]:
                shared += 1
            body = await complete(session, b.url, prompt2)
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == shared // bs * bs
            got = await events_until(sub, lambda s, e: e["type"] == "BlockStored"
                                     and e["token_ids"][:bs] == ids2[shared // bs * bs:shared // bs * bs + bs])
            ev2 = got[-1][1]
            assert ev2["parent_block_hash"] == first[shared // bs - 1]
            assert ev2["token_ids"] == ids2[shared // bs * bs: len(ids2) // bs * bs]
        finally:
            sub.close()


async def test_an_adapters_blocks_are_its_own_and_its_events_name_it_as_vllm_0_32_does():
    """vLLM hashes a LoRA request's blocks with the adapter's name in their extra keys
    and its BlockStored carries ``lora_id`` (the server's ``lora_int_id``, 1, 2, ... in
    load order), ``lora_name`` and ``extra_keys`` of ``[name]`` per block
    (``_build_block_stored_event``, ``to_event_extra_keys``): an adapter's blocks hit
    for that adapter only."""
    bs = 16
    async with backend(lora={"adapters": ["ops-lora", "sql-lora"]},
                       profile_overrides={"block_size": bs}) as (session, b):
        sub = Subscriber(b.kv_publisher.endpoint)
        try:
            await sub.joined(session, b.url)
            prompt = SYSTEM + "How do I read an invoice?"
            ids = await tokenize(session, b.url, prompt)
            n = len(ids) // bs
            full = (len(ids) - 1) // bs * bs  # the last prompt token is always recomputed

            async def cached(model: str) -> int:
                async with session.post(b.url + "/v1/completions", json={
                        "model": model, "prompt": prompt, "max_tokens": 1}) as r:
                    assert r.status == 200, await r.text()
                    return (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"]

            assert await cached("sql-lora") == 0
            _, (_, events, _) = await sub.recv()
            ev = events[0]
            assert list(ev) == STORED_KEYS and ev["lora_id"] == 2 and ev["lora_name"] == "sql-lora"
            assert ev["extra_keys"] == [["sql-lora"]] * n and ev["token_ids"] == ids[:n * bs]
            parent = 0  # the hashes chain over the token ids and the adapter's extra key
            for i, h in enumerate(ev["block_hashes"]):
                parent = block_hash(parent, ids[i * bs:(i + 1) * bs], lora_extra_key("sql-lora"))
                assert h == parent
            assert await cached("sql-lora") == full
            # the same prompt for another adapter and for the base model: no hit, new blocks
            assert await cached("ops-lora") == 0
            assert await cached(MODEL) == 0
            stored = [e for _ in range(2) for e in (await sub.recv())[1][1] if e["type"] == "BlockStored"]
            assert [(e["lora_id"], e["lora_name"], e["parent_block_hash"]) for e in stored] == \
                [(1, "ops-lora", None), (None, None, None)]
            assert stored[1]["extra_keys"] == [None] * n
            assert len({e["block_hashes"][0] for e in (ev, *stored)}) == 3
        finally:
            sub.close()


async def test_tagged_arrays_with_bytes_hashes_for_older_engines():
    bs = 16
    async with backend(kv_events={"topic": "kv-events", "encoding": "array", "block_hash": "bytes",
                                  "replay_topic_frame": False},
                       profile_overrides={"block_size": bs, "num_gpu_blocks": 12}) as (session, b):
        sub = Subscriber(b.kv_publisher.endpoint)
        try:
            await sub.joined(session, b.url)
            ids = await tokenize(session, b.url, SYSTEM)
            await complete(session, b.url, SYSTEM)
            (_, ev), = await events_until(sub, lambda s, e: e[0] == "BlockStored")
            # tag, block_hashes, parent, token_ids, block_size, lora_id, medium, lora_name,
            # extra_keys, group_idx, kv_cache_spec_kind (the trailing default omitted)
            assert len(ev) == 11
            assert ev[1] and all(isinstance(h, bytes) and len(h) == 32 for h in ev[1])
            assert ev[2] is None and ev[3] == ids[: len(ids) // bs * bs] and ev[4] == bs
            assert ev[5:] == [None, "GPU", None, [None] * len(ev[1]), 0, "full_attention"]
            # a prompt that needs more than the never-used blocks: evictions as ["BlockRemoved", [hash], "GPU", 0]
            await complete(session, b.url, "Completely different words about trains and ships. " * 6)
            got = await events_until(sub, lambda s, e: e[0] == "BlockRemoved")
            removed = got[-1][1]
            assert removed[0] == "BlockRemoved" and removed[2:] == ["GPU", 0]
            assert len(removed[1]) == 1 and removed[1][0] in ev[1]
            async with session.post(b.url + "/reset_prefix_cache") as r:
                assert r.status == 200
            got = await events_until(sub, lambda s, e: e[0] == "AllBlocksCleared")
            assert got[-1][1] == ["AllBlocksCleared"]
            # older engines' replay replies: [seq, payload] without the topic frame
            replayed = await replay(b.kv_publisher.replay_endpoint, 0, topic=None)
            assert [s for s, _ in replayed] == list(range(got[-1][0] + 1))
        finally:
            sub.close()


# ---- the events mirror the cache ---------------------------------------------------


async def test_events_mirror_the_prefix_cache_through_evictions_and_preemptions():
    bs = 16
    # 24 blocks: four concurrent requests of ~10 blocks each cannot all stay resident
    async with backend(profile_overrides={"block_size": bs, "num_gpu_blocks": 24, "max_num_seqs": 4}) as (session, b):
        sub = Subscriber(b.kv_publisher.endpoint)
        try:
            await sub.joined(session, b.url)
            prompts = [f"Topic {i}: " + "a story about a dog, a cat and a bird in the park. " * 5 for i in range(8)]
            for rnd in range(2):
                await asyncio.gather(*(complete(session, b.url, p, max_tokens=60)
                                       for p in prompts[rnd * 4:rnd * 4 + 4]))
            st = await stats(session, b.url)
            assert st["engine"]["num_preemptions"] > 0 and st["engine"]["kv_evictions"] > 0
            last = st["kv_events"]["next_seq"] - 1
            index: set[int] = set()
            stored = removed = 0
            seq = -1
            while seq < last:
                seq, (_, events, _) = await sub.recv()
                for e in events:
                    if e["type"] == "BlockStored":
                        assert e["block_size"] == bs and len(e["token_ids"]) == bs * len(e["block_hashes"])
                        assert not index & set(e["block_hashes"]), "a hash stored twice without a removal"
                        index.update(e["block_hashes"])
                        stored += 1
                    elif e["type"] == "BlockRemoved":
                        h, = e["block_hashes"]
                        assert h in index, "removal of a block never stored"
                        index.discard(h)
                        removed += 1
                    else:
                        assert e["type"] == "AllBlocksCleared"
                        index.clear()
            assert stored and removed
            assert index == set(b.engine.kv.cached)
        finally:
            sub.close()


# ---- replay and faults -------------------------------------------------------------


async def test_replay_fills_the_gaps_of_dropped_batches():
    async with backend(faults={"kv_events_drop_rate": 0.5, "seed": 7}) as (session, b):
        pub = b.kv_publisher
        sub = Subscriber(pub.endpoint)
        try:
            await set_faults(session, b.url, seed=7)  # no drops while joining
            first = await sub.joined(session, b.url)
            await set_faults(session, b.url, kv_events_drop_rate=0.5, seed=7)
            for i in range(12):
                await complete(session, b.url, f"Question {i}: " + SYSTEM)
            assert (await stats(session, b.url))["kv_events"]["dropped"] > 0
            # one more batch, surely sent, marks the end of what the subscriber waits for
            await set_faults(session, b.url)
            async with session.post(b.url + "/reset_prefix_cache") as r:
                assert r.status == 200
            last = (await stats(session, b.url))["kv_events"]["next_seq"] - 1
            received: dict[int, bytes] = {}
            while last not in received:
                frames = await asyncio.wait_for(sub.sock.recv_multipart(), WAIT_S)
                received[int.from_bytes(frames[1], "big")] = frames[2]
            missing = [s for s in range(first, last + 1) if s not in received]
            assert missing, "a drop rate of 0.5 dropped nothing the subscriber could see"
            got = await replay(pub.replay_endpoint, missing[0])
            assert [s for s, _ in got] == list(range(missing[0], last + 1))
            for s, payload in got:
                if s in received:
                    assert payload == received[s]
                _ts, events, rank = msgpack.unpackb(payload)
                assert events and rank == 0
            # a start beyond the buffer's end gets only the end marker
            assert await replay(pub.replay_endpoint, last + 1) == []
        finally:
            sub.close()


async def test_stopped_publisher_queues_batches_and_replay_until_resumed():
    async with backend() as (session, b):
        pub = b.kv_publisher
        sub = Subscriber(pub.endpoint)
        try:
            first = await sub.joined(session, b.url)
            await set_faults(session, b.url, kv_events_stop=True)
            for i in range(3):
                await complete(session, b.url, f"Question {i}: " + SYSTEM)
            st = (await stats(session, b.url))["kv_events"]
            assert st["stopped"] and st["backlog"] >= 3 and st["next_seq"] == first
            pending = asyncio.ensure_future(replay(pub.replay_endpoint, first))
            await asyncio.sleep(0)
            assert not pending.done()
            await set_faults(session, b.url)  # resume
            got = await pending
            backlog = st["backlog"]
            assert [s for s, _ in got][:backlog] == list(range(first, first + backlog))
            seqs = [(await sub.recv())[0] for _ in range(backlog)]
            assert seqs == list(range(first, first + backlog))
        finally:
            sub.close()


async def test_restart_starts_the_sequence_again_with_a_cold_cache():
    async with backend() as (session, b):
        pub = b.kv_publisher
        endpoint, replay_endpoint = pub.endpoint, pub.replay_endpoint
        sub = Subscriber(endpoint)
        try:
            await sub.joined(session, b.url)
            await complete(session, b.url, SYSTEM)
            before = await events_until(sub, lambda s, e: e["type"] == "BlockStored")
            assert (await complete(session, b.url, SYSTEM))["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            await b.crash(0)
            async with session.get(b.url + "/kv_event_sources") as r:
                src = (await r.json())["0"]
            assert (src["endpoint"], src["replay_endpoint"], src["topic"]) == (endpoint, replay_endpoint, "kv-events")
            body = await complete(session, b.url, SYSTEM)
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            got = await replay(replay_endpoint, 0)
            assert got and got[0][0] == 0
            _ts, events, _rank = msgpack.unpackb(got[0][1])
            assert events[0]["type"] == "BlockStored" and events[0]["parent_block_hash"] is None
            assert events[0]["block_hashes"] == before[-1][1]["block_hashes"]
            # the subscriber reconnects on its own and sees the new sequence
            async with session.post(b.url + "/reset_prefix_cache") as r:
                assert r.status == 200
            seq = None
            for _ in range(200):
                if await sub.sock.poll(50):
                    seq, _ = await sub.recv()
                    break
                async with session.post(b.url + "/reset_prefix_cache") as r:
                    assert r.status == 200
            assert seq is not None and seq < 200
        finally:
            sub.close()


# ---- configuration -----------------------------------------------------------------


@pytest.mark.parametrize("fields, message", [
    ({"encoding": "json"}, "kv_events.encoding"),
    ({"block_hash": "hex"}, "kv_events.block_hash"),
    ({"endpoint": "ipc:///tmp/x"}, "kv_events.endpoint"),
    ({"replay_endpoint": 5558}, "kv_events.replay_endpoint"),
    ({"buffer_steps": 0}, "kv_events.buffer_steps"),
    ({"topics": "x"}, "unknown kv_events field"),
])
def test_bad_kv_events_config_is_a_clear_error(fields, message):
    with pytest.raises(ValueError, match=message):
        SimBackendConfig.from_dict({"name": "x", "kv_events": fields})
    assert KVEventsConfig.from_dict({}).encoding == "map"


def test_bad_kv_event_faults_and_tokenizer_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="kv_events_drop_rate"):
        FaultConfig.from_dict({"kv_events_drop_rate": 2})
    with pytest.raises(ValueError, match="kv_events_stop"):
        FaultConfig.from_dict({"kv_events_stop": "yes"})
    with pytest.raises(ValueError, match="does not exist"):
        SimBackendConfig.from_dict({"name": "x", "tokenizer": str(tmp_path / "none.json")})
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load"):
        HFTokenizer(tmp_path)


async def test_a_taken_kv_event_port_is_a_clear_error():
    async with backend() as (_session, b):
        taken = b.kv_publisher.endpoint
        cfg = SimBackendConfig.from_dict({"name": "second", "kv_events": {"endpoint": taken}})
        with pytest.raises(OSError, match="cannot bind the KV-event sockets"):
            await start_backends([cfg])


async def test_real_tokenizer_chat_and_generated_text_round_trip():
    tok = HFTokenizer(TOKENIZER)
    assert tok.eos_token_id == tok._tok.token_to_id("<|im_end|>")
    async with backend(tokenizer=TOKENIZER) as (session, b):
        msgs = [{"role": "user", "content": "Hello there"}]
        async with session.post(b.url + "/tokenize", json={"model": MODEL, "messages": msgs}) as r:
            ids = (await r.json())["tokens"]
        assert ids[0] == tok._tok.token_to_id("<|im_start|>")  # special tokens as single ids
        async with session.post(b.url + "/v1/chat/completions", json={
                "model": MODEL, "messages": msgs, "max_tokens": 12, "ignore_eos": True}) as r:
            text = (await r.json())["choices"][0]["message"]["content"]
        assert len(tok.tokenize(text, add_special_tokens=False)) == 12
