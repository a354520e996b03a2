"""routing/kv_event_decoding.py and the prefix index's token-exact entries, without sockets:
every encoding shape of vLLM's KV events, omitted defaults, bytes hashes, undecodable
events, sequence tracking, and precise / speculative / approximate evidence."""

from __future__ import annotations

import msgpack
import pytest

from routing.core import BackendSpec, DecisionCore
from routing.estimate import chain_seed, token_block_keys
from routing.kv_event_decoding import (
    DUPLICATE,
    GAP,
    OK,
    RESTART,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventDecodeError,
    SequenceTracker,
    cache_salt_of,
    decode_batch,
)
from tests.support.kv_payloads import batch, cleared, removed, stored

BS = 4  # engine block size in tokens
MODEL = "m"


def tokens(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


# ---- decoding --------------------------------------------------------------------------------

SHAPES = [("array", "array"), ("array", "map"), ("map", "map"), ("map", "array")]


@pytest.mark.parametrize("batch_shape,event_shape", SHAPES)
def test_every_encoding_shape_decodes_the_same(batch_shape, event_shape):
    evs = [stored([11, 12], None, tokens(8), BS, group_idx=0, kv_cache_spec_kind="full_attention",
                  extra_keys=[None, None]),
           stored([13], 12, tokens(4, 9), BS), removed([11]), removed([12], group_idx=0), cleared()]
    b = decode_batch(batch(evs, batch_shape=batch_shape, event_shape=event_shape, ts=2.5, rank=3))
    assert b.ts == 2.5 and b.data_parallel_rank == 3 and b.undecodable == 0
    assert b.events == [
        BlockStored([11, 12], None, tokens(8), BS, None, "GPU", None, [None, None], 0, "full_attention"),
        BlockStored([13], 12, tokens(4, 9), BS, None, "GPU", None),
        BlockRemoved([11], "GPU"), BlockRemoved([12], "GPU", 0), AllBlocksCleared()]


@pytest.mark.parametrize("batch_shape", ["array", "map"])
def test_omitted_defaults_and_an_older_engines_short_events(batch_shape):
    # an array batch without data_parallel_rank; events of an engine before medium/lora_name
    raw = [1.0, [["BlockStored", [5], None, tokens(4), BS, None], ["BlockRemoved", [5]]]] \
        if batch_shape == "array" else \
        {"ts": 1.0, "events": [{"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None,
                                "token_ids": tokens(4), "block_size": BS},
                               {"type": "BlockRemoved", "block_hashes": [5]}]}
    b = decode_batch(msgpack.packb(raw))
    assert b.data_parallel_rank is None and b.undecodable == 0
    assert b.events == [BlockStored([5], None, tokens(4), BS), BlockRemoved([5])]


def test_the_vllm_0_32_shape_from_the_issue():
    ev = {"type": "BlockStored", "block_hashes": [-4_000_000_000_000_000_000], "parent_block_hash": None,
          "token_ids": tokens(32), "block_size": 32, "lora_id": None, "medium": "GPU", "lora_name": None,
          "extra_keys": [None], "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    b = decode_batch(msgpack.packb([1.7e9, [ev], 0]))
    assert b.undecodable == 0 and b.events[0].block_hashes == [-4_000_000_000_000_000_000]


def test_bytes_hashes_decode_as_bytes():
    h1, h2 = b"\x01" * 32, b"\x02" * 32
    b = decode_batch(batch([stored([h1], None, tokens(4), BS), stored([h2], h1, tokens(4, 5), BS), removed([h1])],
                           event_shape="array"))
    assert b.events[0].block_hashes == [h1] and b.events[1].parent_block_hash == h1
    assert b.events[2].block_hashes == [h1]


def test_undecodable_events_are_counted_and_skipped():
    raw = [1.0, [{"type": "BlockStored", "block_hashes": [1]},  # missing fields
                 ["Bogus", 1],  # unknown tag
                 {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2],
                  "block_size": BS},  # token count does not fit the blocks
                 ["BlockRemoved", "not-a-list"],
                 17,
                 ["BlockRemoved", [9]]], 0]
    b = decode_batch(msgpack.packb(raw))
    assert b.undecodable == 5 and b.first_error and b.events == [BlockRemoved([9])]


@pytest.mark.parametrize("payload", [b"\xc1", msgpack.packb({"ts": 1}), msgpack.packb([1.0]),
                                     msgpack.packb(["x", []]), msgpack.packb(7)])
def test_a_payload_that_is_no_batch_raises_a_clear_error(payload):
    with pytest.raises(KVEventDecodeError):
        decode_batch(payload)


def test_cache_salt_is_read_from_the_first_blocks_extra_keys():
    ev = BlockStored([1], None, tokens(4), BS, lora_name="ad", extra_keys=[["ad", "tenant-7"]])
    assert cache_salt_of(ev) == "tenant-7"
    assert cache_salt_of(BlockStored([1], None, tokens(4), BS, lora_name="ad", extra_keys=[["ad"]])) is None
    assert cache_salt_of(BlockStored([1], 5, tokens(4), BS, extra_keys=[["s"]])) is None


# ---- sequence numbers ------------------------------------------------------------------------------------

def test_sequence_tracker_gap_replay_duplicates_and_restart():
    t = SequenceTracker()
    assert [t.observe(s) for s in (7, 8)] == [OK, OK]  # the first one seen starts the count
    assert t.observe(11) == GAP and t.expected == 9
    t.replayed(9, 12)  # the replay brought 9..12
    assert t.observe(11) == DUPLICATE and t.observe(12) == DUPLICATE
    assert t.observe(13) == OK
    assert t.observe(0) == RESTART and t.observe(1) == OK
    assert t.observe(5) == GAP
    t.reset_to(5)
    assert t.observe(6) == OK


# ---- the index -------------------------------------------------------------------------------------------

def core(*specs: tuple[str, int | None], speculative_s: float = 5.0) -> DecisionCore:
    return DecisionCore([BackendSpec(n, frozenset({MODEL}), kv_block_size=bs, kv_base_model=MODEL if bs else "")
                         for n, bs in specs], "estimated_ttft", speculative_s=speculative_s)


def keys_of(ids: list[int], salt: str | None = None) -> tuple[int, ...]:
    return token_block_keys(ids, BS, chain_seed(MODEL, salt))


def request(c: DecisionCore, ids: list[int], salt: str | None = None, text: str | None = None):
    return c.request(MODEL, text if text is not None else " ".join(map(str, ids)), 16, salt, token_ids=ids)[1]


def held(c: DecisionCore, ids: list[int], now: float = 0.0, salt: str | None = None, question: bool = True):
    """(matched tokens, evidence) per backend whose events decide its match, for a
    prompt of ``ids`` followed (``question``) by one more token: an engine computes at
    least the last prompt token, so ``ids`` alone would reuse one block less."""
    req = request(c, ids + [0] if question else ids, salt)
    m = c.router.match(req, now)
    return m.exact_tokens, {b: c.router.evidence(req, m, b) for b in m.exact_tokens}


def test_block_stored_makes_precise_entries_chained_from_the_parent():
    c = core(("a", BS), ("b", BS))
    ids = tokens(12)
    c.kv_event_batch("a", 0, batch([stored([101, 102], None, ids[:8], BS)]))
    c.kv_event_batch("a", 0, batch([stored([103], 102, ids[8:], BS)]))
    assert c.index.counts("a") == (3, 0)
    exact, evidence = held(c, ids + [99, 98])
    assert exact == {"a": 12} and evidence == {"a": "precise"}  # b sent no event yet: not live
    # a block whose parent is unknown cannot be keyed: counted, not indexed
    c.kv_event_batch("a", 0, batch([stored([200], 999, tokens(4, 50), BS)]))
    assert c.index.counts("a") == (3, 0) and c.kv_stats["a"].ignored == 1


def test_block_removed_and_all_blocks_cleared():
    c = core(("a", BS))
    ids = tokens(12)
    c.kv_event_batch("a", 0, batch([stored([1, 2, 3], None, ids, BS)]))
    c.kv_event_batch("a", 0, batch([removed([3])], event_shape="array"))
    assert held(c, ids)[0] == {"a": 8}
    c.kv_event_batch("a", 0, batch([removed([1])]))
    assert held(c, ids)[0] == {"a": 0}  # the first block is gone: nothing of the prefix is reusable
    c.kv_event_batch("a", 0, batch([stored([9], None, ids[:4], BS), cleared()]))
    assert c.index.counts("a") == (0, 0) and held(c, ids) == ({"a": 0}, {"a": "precise"})


def test_bytes_hashes_and_lora_and_salt_keys():
    c = DecisionCore([BackendSpec("a", frozenset({MODEL, "ad"}), kv_block_size=BS, kv_base_model=MODEL)],
                     "estimated_ttft")
    ids = tokens(8)
    h = [b"\xaa" * 32, b"\xbb" * 32]
    c.kv_event_batch("a", 0, batch([stored(h, None, ids, BS, extra_keys=[["ad", "s1"], ["ad"]], lora_name="ad")]))
    req = c.request("ad", "x", 16, "s1", token_ids=ids + [0])[1]
    m = c.router.match(req, 0.0)
    assert m.exact_tokens == {"a": 8}
    req = c.request("ad", "x", 16, None, token_ids=ids + [0])[1]  # another salt: another chain
    m = c.router.match(req, 0.0)
    assert m.exact_tokens == {"a": 0}
    c.kv_event_batch("a", 0, batch([removed([h[1]])]))
    assert c.index.counts("a") == (1, 0)


def test_multimodal_blocks_are_not_keyed_by_tokens_alone():
    c = core(("a", BS))
    ids = tokens(12)
    c.kv_event_batch("a", 0, batch([stored([1, 2, 3], None, ids, BS, extra_keys=[None, [["img", 0]], None])]))
    assert c.index.counts("a") == (1, 0)  # block 0 only: block 1 holds an image, block 2 follows it


def test_other_media_groups_and_block_sizes_are_not_indexed():
    c = core(("a", BS))
    ids = tokens(4)
    c.kv_event_batch("a", 0, batch([stored([1], None, ids, BS, medium="CPU"),
                                    stored([2], None, ids, BS, kv_cache_spec_kind="sliding_window", group_idx=1),
                                    stored([3], None, tokens(8), 8)]))
    assert c.index.counts("a") == (0, 0) and c.kv_stats["a"].ignored == 3


def test_speculative_entries_at_dispatch_are_confirmed_or_decay():
    c = core(("a", BS), speculative_s=5.0)
    ids = tokens(8)
    c.kv_event_batch("a", 0, batch([cleared()]))  # events flow: a is live
    d, _r = c.route(request(c, ids), 100.0)
    assert d.backend.name == "a" and d.evidence == "precise" and d.detail["matched_tokens"] == 0
    assert c.index.counts("a") == (0, 2)
    exact, evidence = held(c, ids, now=101.0)
    assert exact == {"a": 8} and evidence == {"a": "speculative"}
    # the engine confirms the first block: the match stays speculative until all are precise
    keys = keys_of(ids)
    c.kv_event_batch("a", 0, batch([stored([7], None, ids[:4], BS)]))
    assert c.index.counts("a") == (1, 1)
    assert held(c, ids, now=102.0) == ({"a": 8}, {"a": "speculative"})
    # unconfirmed past the bound: it decays, the precise block stays
    assert held(c, ids, now=105.5) == ({"a": 4}, {"a": "precise"})
    c.router.match(request(c, tokens(4, 500)), 106.5)  # the periodic sweep drops it from memory
    assert c.index.counts("a") == (1, 0) and keys[1] not in c.index.token_owners


def test_a_speculative_entry_decays_with_its_latest_dispatch():
    from routing.prefix_index import PrefixIndex

    idx = PrefixIndex(speculative_s=5.0)
    idx.set_engine("a", BS, MODEL)
    idx.record_speculative("a", (1, 2, 3), 0.0)
    idx.record_speculative("a", (2, 3, 4), 3.0)  # 2 and 3 again: they now wait until 8 s
    idx.store("a", 0, [70], [3])  # the engine confirms 3
    assert idx.counts("a") == (1, 3) and idx.match_tokens((1, 2, 3, 4), ["a"], 4.0) == {"a": 4}
    assert idx.expire_speculative(5.0) == 1 and idx.counts("a") == (1, 2)  # 1 only
    assert idx.match_tokens((2, 3, 4), ["a"], 7.9) == {"a": 3}
    assert idx.expire_speculative(8.0) == 2 and idx.counts("a") == (1, 0)
    assert idx.match_tokens((3,), ["a"], 9.0) == {"a": 1} and 2 not in idx.token_owners


def test_without_speculation_dispatch_records_no_token_entry():
    c = core(("a", BS), speculative_s=0)
    c.kv_event_batch("a", 0, batch([cleared()]))
    c.route(request(c, tokens(8)), 1.0)[1].release()
    assert c.index.counts("a") == (0, 0)


def test_gap_unfilled_falls_back_to_approximate_and_restart_clears():
    c = core(("a", BS), ("b", None))
    ids = tokens(64)
    text = "x" * 4096
    c.kv_event_batch("a", 0, batch([stored(range(1, 17), None, ids, BS)]))
    req = request(c, ids + [0], text=text)
    c.router.index.record("a", req.block_hashes, 0.0)  # a dispatch seen by the approximate entries
    m = c.router.match(req, 0.0)
    assert m.exact_tokens == {"a": 64} and c.router.evidence(req, m, "a") == "precise"
    c.kv_event_gap("a", 0, filled=False)
    req = request(c, ids, text=text)
    m = c.router.match(req, 0.0)
    assert m.exact_tokens == {} and m.matched_blocks["a"] > 0  # approximate decides again
    d, r = c.route(req, 0.0)
    assert d.evidence == "approximate"
    r.release()
    assert c.kv_stats["a"].replay_failures == 1 and c.index.counts("a")[0] == 0
    c.kv_event_batch("a", 0, batch([stored([50], None, ids[:4], BS)]))  # events flow again
    # the dispatch above left speculative entries; the engine has confirmed the first block
    assert held(c, ids) == ({"a": 64}, {"a": "speculative"}) and c.index.counts("a") == (1, 15)
    c.kv_event_restart("a", 0)
    assert c.index.counts("a")[0] == 0 and c.kv_stats["a"].restarts == 1


def test_data_parallel_ranks_hold_a_block_until_the_last_one_removes_it():
    c = core(("a", BS))
    ids = tokens(4)
    c.kv_event_batch("a", 0, batch([stored([1], None, ids, BS)], rank=0))
    c.kv_event_batch("a", 1, batch([stored([77], None, ids, BS)], rank=1))
    c.kv_event_batch("a", 0, batch([removed([1])]))
    assert held(c, ids)[0] == {"a": 4}
    c.kv_event_restart("a", 1)
    assert held(c, ids)[0] == {"a": 0}


def test_undecodable_payloads_are_counted_never_raised(caplog):
    c = core(("a", BS))
    for _ in range(3):
        c.kv_event_batch("a", 0, b"\xc1\xc1")
        c.kv_event_batch("a", 0, msgpack.packb([1.0, [["Nope"]], 0]))
    st = c.kv_stats["a"]
    assert st.decode_errors == 6 and st.batches == 6
    assert sum("undecodable" in r.getMessage() for r in caplog.records) == 2  # once per kind, per backend


def test_a_model_without_event_backends_gets_no_token_keys():
    c = core(("a", None), ("b", None))
    req = request(c, tokens(64))
    assert req.token_keys is None
    d, _r = c.route(req, 0.0)
    assert d.evidence == "approximate" and c.index.engines == {}


def test_a_repeated_prefix_goes_to_its_precise_holder():
    c = core(("a", BS), ("b", BS), ("c", BS))
    system = tokens(8192)  # long enough that recomputing it anywhere else costs more than any queue here
    for n in "abc":
        c.kv_event_batch(n, 0, batch([cleared()]))
    c.kv_event_batch("b", 0, batch([stored(range(1000, 1000 + 8192 // BS), None, system, BS)]))
    for i in range(20):
        req = request(c, system + tokens(16, 50_000 + 100 * i))
        d, r = c.route(req, float(i))
        assert (d.backend.name, d.evidence, d.detail["matched_tokens"]) == ("b", "precise", 8192)
        r.release(float(i))


def test_mixed_fleet_compares_exact_and_approximate_matches():
    c = core(("a", BS), ("b", None))
    ids = tokens(64)
    text = "y" * 4096
    c.kv_event_batch("a", 0, batch([cleared()]))
    req = request(c, ids, text=text)
    c.index.record("b", req.block_hashes, 0.0)
    m = c.router.match(req, 0.0)
    assert m.exact_tokens == {"a": 0} and m.cached_tokens("b") > 0 and m.cached_tokens("a") == 0
    d, _r = c.route(req, 0.0)
    assert d.backend.name == "b" and d.evidence == "approximate"


def test_the_approximate_path_is_unchanged_without_events():
    """Requests of a model whose backends publish no events match, cost and record
    exactly what a gateway without any KV-event backend does, even beside a model
    that has them."""
    plain = DecisionCore([BackendSpec(n, frozenset({"p"})) for n in "xyz"], "round_robin")
    mixed = DecisionCore([BackendSpec(n, frozenset({"p"})) for n in "xyz"] +
                         [BackendSpec("e", frozenset({MODEL}), kv_block_size=BS, kv_base_model=MODEL)], "round_robin")
    mixed.kv_event_batch("e", 0, batch([cleared()]))
    text = "shared system prompt " * 200
    for i in range(12):
        prompt = text + f"question {i % 3}" * 50
        seen = []
        for c in (plain, mixed):
            assert not c.wants_token_ids("p")
            _, req = c.request("p", prompt, 16)
            d, r = c.route(req, float(i))
            m = c.router.match(req, float(i))  # the match the route was made on
            seen.append((d.backend.name, dict(m.matched_blocks), m.exact_tokens, req.token_keys, d.evidence,
                         d.detail["matched_tokens"]))
            r.release(float(i))
        assert seen[0] == seen[1]
        assert seen[0][2:5] == ({}, None, "approximate")
    assert plain.index.owners == mixed.index.owners and mixed.index.token_owners == {}


def test_a_prompt_of_whole_blocks_reuses_all_but_its_last():
    """An engine computes at least the last prompt token (vLLM's max_cache_hit_length is
    num_tokens - 1), so a fully cached prompt of whole blocks hits one block less."""
    c = core(("a", BS))
    ids = tokens(12)
    c.kv_event_batch("a", 0, batch([stored([1, 2, 3], None, ids, BS)]))
    assert held(c, ids, question=False)[0] == {"a": 8}
    assert held(c, ids + [99], question=False)[0] == {"a": 12}
    assert held(c, ids[:4], question=False)[0] == {"a": 0}


def test_a_run_of_removals_applies_as_its_events_one_by_one():
    from routing.prefix_index import PrefixIndex

    def index() -> PrefixIndex:
        idx = PrefixIndex()
        for name in ("a", "b"):
            idx.set_engine(name, BS, MODEL)
            idx.set_live(name, True)
            idx.store(name, 0, list(range(100, 120)), list(range(1, 21)))
        idx.store("a", 1, [7], [3])  # a second rank holds block 3 too
        return idx

    events = [[100], [101, 102, 999], [], [103, 102], [104]]
    one_by_one, run = index(), index()
    assert sum(one_by_one.remove("a", 0, hs) for hs in events) == run.remove_events("a", 0, events) == 5
    for name in ("a", "b"):
        assert one_by_one.counts(name) == run.counts(name)
        assert one_by_one.turnover(name, BS, 1000.0) == run.turnover(name, BS, 1000.0)
    assert list(one_by_one.token_ghosts.items()) == list(run.token_ghosts.items())
    assert 3 not in run.token_ghosts and run.counts("a") == (16, 0)  # rank 1 still holds block 3
