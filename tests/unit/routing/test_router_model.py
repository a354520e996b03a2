"""Estimation, prefix index, load model and the estimated_ttft policy, in virtual time."""

from __future__ import annotations

import gc
import random
import tracemalloc
from collections import Counter

import pytest

from routing import BackendSpec, Fleet, Router, RouteRequest, make_policy
from routing.estimate import TokenEstimator, _chain_seed_cached, block_hashes, canonical_prompt, chain_seed
from routing.load import BackendLoad, DecayedLinearFit
from routing.policies.estimated_ttft import EstimatedTTFT
from routing.prefix_index import PrefixIndex

# ---- estimation -----------------------------------------------------------------------

def test_canonical_prompt_is_stable_and_prefix_preserving():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}]
    turn1 = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
    turn2 = turn1 + [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More"}]
    a = canonical_prompt("chat", {"messages": turn1, "tools": tools})
    # same content with keys in another order renders the same bytes
    tools_reordered = [{"function": {"parameters": {"a": 2, "b": 1}, "name": "f"}, "type": "function"}]
    assert a == canonical_prompt("chat", {"tools": tools_reordered, "messages": list(turn1)})
    b = canonical_prompt("chat", {"messages": turn2, "tools": tools})
    assert b.startswith(a)  # the next turn extends the previous one
    assert canonical_prompt("chat", {"messages": turn1}) != a
    img = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:1"}}]}
    img2 = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:2"}}]}
    assert canonical_prompt("chat", {"messages": [img]}) != canonical_prompt("chat", {"messages": [img2]})
    assert canonical_prompt("completions", {"prompt": [1, 2, 3]}) == "1 2 3"


def test_block_hashes_chain_and_seed():
    text = b"a" * 100 + b"b" * 100 + b"c" * 50
    h = block_hashes(text, 100, seed=1)
    assert len(h) == 2  # only full blocks
    assert h[0] != h[1]  # "aaa" then "bbb"
    # chained: the same second block after a different first block hashes differently
    other = block_hashes(b"z" * 100 + b"b" * 100, 100, seed=1)
    assert other[1] != h[1]
    assert block_hashes(text, 100, seed=2) != h
    assert chain_seed("m") != chain_seed("m", "tenant-1") != chain_seed("n")


def test_bytes_per_token_and_output_are_learned():
    est = TokenEstimator(block_tokens=16)
    assert est.estimate("m", "x" * 400, None).prompt_tokens == 100  # default 4 bytes/token
    for _ in range(50):
        est.observe_usage("m", prompt_bytes=400, prompt_tokens=200, completion_tokens=30)
    e = est.estimate("m", "x" * 400, max_tokens=1000)
    assert e.prompt_tokens == pytest.approx(200, rel=0.05)
    assert 30 <= e.output_tokens < 256  # moving from the 256 seed toward 30
    assert est.estimate("m", "x" * 400, max_tokens=5).output_tokens == 5
    assert est.estimate("other", "x" * 400, None).prompt_tokens == 100  # per model


# ---- prefix index ---------------------------------------------------------------------

def test_prefix_index_match_and_lru_and_ttl():
    idx = PrefixIndex(ttl_s=10.0, default_capacity_blocks=4)
    idx.record("a", (1, 2, 3), now=0.0)
    idx.record("b", (1, 2, 9), now=0.0)
    assert idx.match((1, 2, 3, 4), now=1.0) == {"a": 3, "b": 2}
    assert idx.match((7, 2, 3), now=1.0) == {}
    # capacity 4 blocks: a new 3-block prompt evicts a's least recently used blocks,
    # which are the *tail* blocks of the older prefix (touched first-to-last reversed)
    idx.record("a", (5, 6, 7), now=2.0)
    assert idx.match((1, 2, 3), now=2.0) == {"a": 1, "b": 2}
    assert idx.match((5, 6, 7), now=2.0) == {"a": 3}
    # aged out after ttl
    assert idx.match((1, 2), now=10.5) == {}
    assert idx.expire(now=10.5) == 4  # b: 3 blocks from t=0; a: block 1 from t=0 (5, 6, 7 are from t=2)
    assert idx.size == sum(len(b.lru) for b in idx.backends.values())


def test_prefix_index_memory_bound():
    idx = PrefixIndex(max_blocks=1000, default_capacity_blocks=10_000)
    for i in range(50):
        idx.record(f"b{i % 3}", tuple(range(i * 100, i * 100 + 100)), now=float(i))
    assert idx.size <= 1000
    assert idx.size == sum(len(b.lru) for b in idx.backends.values())
    assert sum(len(o) for o in idx.owners.values()) == idx.size


# ---- load model -----------------------------------------------------------------------

def test_linear_fit_learns_rate_and_overhead():
    fit = DecayedLinearFit(0.02, 1 / 8000, prior_x=4096)
    rng = random.Random(1)
    for _ in range(200):
        x = rng.uniform(100, 20000)
        fit.add(x, 0.05 + x / 20000)
    assert 1 / fit.slope == pytest.approx(20000, rel=0.02)
    assert fit.intercept == pytest.approx(0.05, abs=0.005)


def test_request_load_lifecycle_is_exact():
    load = BackendLoad(prefill_tokens_per_s=1000)
    a = load.admit(uncached_tokens=500, prompt_tokens=800, output_tokens=100, now=0.0)
    b = load.admit(uncached_tokens=300, prompt_tokens=300, output_tokens=50, now=0.0)
    assert (load.queued, load.queued_prefill_tokens, load.kv_tokens) == (2, 800, 1100)
    assert b.queued_ahead_tokens == 500
    a.first_token(0.6)
    assert (load.queued, load.running, load.queued_prefill_tokens, load.decode_tokens_remaining) == (1, 1, 300, 100)
    assert a.finish(2.0, completion_tokens=100) is True
    assert a.finish(2.0, completion_tokens=100) is False  # exactly once
    b.finish(2.1)  # cancelled before its first token
    assert (load.queued, load.running, load.queued_prefill_tokens, load.kv_tokens, load.decode_tokens_remaining) \
        == (0, 0, 0.0, 0.0, 0.0)


# ---- estimated_ttft in a small virtual-time fleet -------------------------------------

class VirtualFleet:
    """Backends that prefill FIFO at a fixed rate (tokens/s) and decode for a fixed
    time; the router sees only what a gateway would see (first token, completion)."""

    def __init__(self, rates: dict[str, float], policy: str = "estimated_ttft", seed: int = 0,
                 decode_s: float = 0.5) -> None:
        specs = [BackendSpec(n, frozenset({"m"}), prefill_tokens_per_s=r) for n, r in rates.items()]
        self.fleet = Fleet(specs)
        pol = make_policy(policy)
        if isinstance(pol, EstimatedTTFT):
            pol = EstimatedTTFT(random.Random(seed))
        self.router = Router(self.fleet, pol, block_tokens=64)
        self.est = TokenEstimator(block_tokens=64)
        self.rates = rates
        self.busy_until = dict.fromkeys(rates, 0.0)
        self.cache: dict[str, set[int]] = {n: set() for n in rates}
        self.events: list[tuple[float, int, str, object]] = []
        self.decode_s = decode_s
        self.prefill_tokens = Counter()
        self.assigned: list[str] = []
        self.reasons: list[str] = []  # each decision's reason, in order
        self._seq = 0

    def submit(self, text: str, now: float) -> str:
        self.advance(now)
        e = self.est.estimate("m", text, 10)
        tpb = self.est.block_bytes / self.est.stats("m").bytes_per_token
        d, res = self.router.route(RouteRequest("m", prompt_text=text, prompt_bytes=e.size_bytes,
                                                block_hashes=e.hashes, prompt_tokens=e.prompt_tokens,
                                                output_tokens=e.output_tokens, tokens_per_block=tpb), now)
        name = d.backend.name
        held = 0
        for h in e.hashes:
            if h not in self.cache[name]:
                break
            held += 1
        self.cache[name].update(e.hashes)
        uncached = e.prompt_tokens - min(held * tpb, e.prompt_tokens)
        self.prefill_tokens[name] += uncached
        start = max(now, self.busy_until[name])
        first = self.busy_until[name] = start + uncached / self.rates[name] + 0.005
        self._push(first, "first", res)
        self._push(first + self.decode_s, "done", res)
        self.assigned.append(name)
        self.reasons.append(d.reason)
        return name

    def _push(self, t: float, kind: str, res) -> None:
        import heapq
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, res))

    def advance(self, now: float) -> None:
        import heapq
        while self.events and self.events[0][0] <= now:
            t, _, kind, res = heapq.heappop(self.events)
            if kind == "first":
                res.first_token(t)
            else:
                res.release(t, 10)


SYSTEM = "You are a helpful assistant. " * 300  # ~9 KB shared by every request


def test_shared_first_block_trap_spreads_load():
    vf = VirtualFleet({"a": 20000.0, "b": 20000.0, "c": 20000.0, "d": 20000.0})
    rng = random.Random(3)
    t = 0.0
    for i in range(1000):
        t += rng.expovariate(40.0)  # 40 req/s, ~3,000 uncached tokens each: busy fleet
        vf.submit(SYSTEM + f"user {i}: " + rng.randbytes(6000).hex(), t)
    counts = Counter(vf.assigned)
    mean = 1000 / 4
    assert len(counts) == 4
    assert max(counts.values()) <= 1.5 * mean, counts


def test_longer_shared_prefixes_still_colocate():
    vf = VirtualFleet({"a": 20000.0, "b": 20000.0, "c": 20000.0, "d": 20000.0})
    rng = random.Random(5)
    docs = [rng.randbytes(10000).hex() for _ in range(8)]
    t = 0.0
    groups: dict[int, list[str]] = {g: [] for g in range(8)}
    for i in range(400):
        t += rng.expovariate(10.0)
        g = rng.randrange(8)
        groups[g].append(vf.submit(SYSTEM + docs[g] + f" question {i}", t))
    colocated = sum(Counter(v).most_common(1)[0][1] for v in groups.values())
    assert colocated / 400 >= 0.8
    # and the fleet is still used as a whole
    assert len(Counter(vf.assigned)) == 4


def test_heterogeneous_fleet_gets_prefill_in_proportion_to_learned_speed():
    # both start from the same seed rate; the gateway learns b is twice as fast
    vf = VirtualFleet({"a": 10000.0, "b": 10000.0}, decode_s=0.0)
    for name, rate in (("a", 10000.0), ("b", 20000.0)):
        load = vf.fleet.backends[name].load
        for work in range(500, 20000, 500):
            load.observe_ttft(work, 0.005 + work / rate)
    vf.rates = {"a": 10000.0, "b": 20000.0}
    rng = random.Random(9)
    for i in range(2000):  # arrivals far above capacity: saturation
        vf.submit(rng.randbytes(2000).hex() + str(i), now=i * 0.01)
    ratio = vf.prefill_tokens["b"] / vf.prefill_tokens["a"]
    assert 1.7 <= ratio <= 2.3, ratio


def test_decision_explains_itself():
    vf = VirtualFleet({"a": 20000.0, "b": 20000.0})
    text = SYSTEM + "question"
    vf.submit(text, 0.0)
    vf.advance(10.0)
    e = vf.est.estimate("m", text, 10)
    d, res = vf.router.route(RouteRequest("m", prompt_text=text, block_hashes=e.hashes,
                                          prompt_tokens=e.prompt_tokens, output_tokens=10,
                                          tokens_per_block=vf.est.block_bytes / 4.0), 10.0)
    assert d.reason == "prefix_hit" and d.backend.name == vf.assigned[0]
    assert d.detail["matched_tokens"] > 0 and d.detail["ttft_est_s"] > 0
    res.release(10.0)


@pytest.mark.fixed_bug(reason="chain_seed's lru_cache kept every client-sent cache_salt alive")
def test_chain_seed_cache_does_not_pin_client_supplied_salts():
    """``cache_salt`` is a client's request field of any length (bodies up to 32 MiB):
    lru_cache(4096) keeps each distinct salt alive, so 4096 requests with a 1 MiB salt
    pin 4 GiB. 16 requests with a 1 MiB salt must not retain 16 MiB."""
    est = TokenEstimator()
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(16):
            salt = f"{i}-" + "s" * (1 << 20)
            est.estimate("m", "hello", 4, salt)
            del salt
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
        _chain_seed_cached.cache_clear()
    assert retained < 4 << 20, f"{retained / 2**20:.1f} MiB of salts retained by chain_seed's cache"
