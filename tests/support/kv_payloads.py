"""vLLM KV-event payloads crafted for tests, in every encoding an engine uses.

Field orders follow vLLM's msgspec structs (``vllm/distributed/kv_events.py``); see
:mod:`routing.kv_event_decoding`. ``omit_defaults`` drops fields that hold their default: a map
lacks the key, an array is cut after its last non-default field.
"""

from __future__ import annotations

from typing import Any

import msgpack

STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                 "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
STORED_REQUIRED = 7  # fields without a default in vLLM's BlockStored
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
REMOVED_REQUIRED = 2


def stored(block_hashes, parent, token_ids, block_size, **extra) -> dict[str, Any]:
    ev = {"type": "BlockStored", "block_hashes": list(block_hashes), "parent_block_hash": parent,
          "token_ids": list(token_ids), "block_size": block_size, "lora_id": None, "medium": "GPU",
          "lora_name": None}
    ev.update(extra)
    return ev


def removed(block_hashes, **extra) -> dict[str, Any]:
    ev = {"type": "BlockRemoved", "block_hashes": list(block_hashes), "medium": "GPU"}
    ev.update(extra)
    return ev


def cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def as_array(ev: dict[str, Any]) -> list[Any]:
    """The ``array_like=True, tag=True, omit_defaults=True`` encoding of ``ev``."""
    tag = ev["type"]
    if tag == "AllBlocksCleared":
        return [tag]
    names, required = (STORED_FIELDS, STORED_REQUIRED) if tag == "BlockStored" else (REMOVED_FIELDS, REMOVED_REQUIRED)
    values = [ev.get(n) for n in names]
    n = len(values)
    while n > required and values[n - 1] is None:
        n -= 1
    return [tag, *values[:n]]


def as_map(ev: dict[str, Any]) -> dict[str, Any]:
    """The map encoding (``tag=True``) with defaults omitted."""
    tag = ev["type"]
    required = STORED_FIELDS[:STORED_REQUIRED] if tag == "BlockStored" else REMOVED_FIELDS[:REMOVED_REQUIRED]
    return {k: v for k, v in ev.items() if k == "type" or k in required or v is not None}


def batch(events: list[dict[str, Any]], *, batch_shape: str = "array", event_shape: str = "map",
          ts: float = 1.0, rank: int | None = 0) -> bytes:
    """A msgpack ``EventBatch``: ``batch_shape`` and ``event_shape`` are ``array`` or
    ``map`` (vLLM 0.32 sends an array batch of map events)."""
    evs = [as_array(e) if event_shape == "array" else as_map(e) for e in events]
    if batch_shape == "array":
        raw: Any = [ts, evs] if rank is None else [ts, evs, rank]
    else:
        raw = {"ts": ts, "events": evs}
        if rank is not None:
            raw["data_parallel_rank"] = rank
    return msgpack.packb(raw, use_bin_type=True)
