"""Engine KV-cache events (vLLM's wire format): decoding and sequence tracking. No I/O.

An engine started with ``--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", ...}'`` publishes, on a ZMQ PUB socket, multipart messages
``[topic, seq (8-byte big-endian), payload]``. The payload is msgpack of an
``EventBatch`` (source of truth: ``vllm/distributed/kv_events.py`` in
vllm-project/vllm, msgspec structs with ``omit_defaults=True`` and, for events,
``tag=True``):

- ``EventBatch``: ``ts`` (float seconds), ``events`` (list), ``data_parallel_rank``
  (int or ``None``, default ``None``);
- ``BlockStored``: ``block_hashes``, ``parent_block_hash``, ``token_ids``,
  ``block_size``, ``lora_id``, ``medium``, ``lora_name``, ``extra_keys`` (default
  ``None``), ``group_idx`` (default ``None``), ``kv_cache_spec_kind`` (default
  ``None``), ``kv_cache_spec_sliding_window`` (default ``None``);
- ``BlockRemoved``: ``block_hashes``, ``medium``, ``group_idx`` (default ``None``);
- ``AllBlocksCleared``: no field.

Engines encode these either as arrays (``array_like=True``: a batch is ``[ts,
events, rank]``, an event ``["BlockStored", field, field, ...]`` in the order above)
or as maps (``{"ts": ..., "events": ...}``, an event ``{"type": "BlockStored",
...}``); the two mix (vLLM 0.32 sends an array batch of map events). With
``omit_defaults`` a field holding its default is absent: a map lacks the key, an
array is cut short. Older engines had fewer fields (``medium``, ``lora_name`` and
what follows them came later): a short array decodes with the missing fields at
their defaults. Block hashes are 64-bit ints by default, bytes with a non-default
hash function; both are kept as they come (they only name blocks).

:func:`decode_batch` turns a payload into :class:`EventBatch`; an event it cannot
read is counted in ``EventBatch.undecodable`` (with the first reason) and skipped,
never raised; a payload that is not a batch at all raises :class:`KVEventDecodeError`.
Decoding is msgspec's, into typed structs declared like vLLM's (msgspec checks every
field's type in C; an engine emits one ``BlockRemoved`` per evicted block, so the
per-event cost is what counts): the whole batch in one call when every event is a
valid map event (vLLM 0.32's shape), else the batch with its events left raw, then
each event on its own, so that one bad event costs only itself.
:class:`SequenceTracker` checks a publisher's sequence numbers (gaps, engine
restarts, replay duplicates).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Generic, TypeVar

import msgspec

from routing.estimate import chain_seed, token_block_keys
from routing.prefix_index import PrefixIndex

TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]
BlockHash = int | bytes


class KVEventDecodeError(ValueError):
    """A payload is not an ``EventBatch`` (not msgpack, or not an array/map with a
    list of events)."""


# The events are msgspec structs shaped like vLLM's own (map encoding: tagged by
# ``"type"``, the class name), so that msgspec decodes and checks them in C: a field
# of the wrong type, a missing field without a default or an unknown tag raises
# msgspec.ValidationError (a ValueError) naming the field. gc=False: they hold no
# reference cycles, so the collector need not track them.

class BlockStored(msgspec.Struct, tag=True, gc=False):
    """Blocks the engine stored in its prefix cache: ``block_hashes`` (int or bytes,
    one per block), their chain parent (``None``: the first block of a prompt), the
    ``token_ids`` of all the blocks (``len(block_hashes) * block_size`` of them, each
    in ``[0, 2**32)``). Raises ``ValueError`` when the token count does not fit."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[TokenId]
    block_size: Annotated[int, msgspec.Meta(ge=1)]
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.block_hashes) * self.block_size:
            raise ValueError(f"{len(self.token_ids)} token_ids for {len(self.block_hashes)} blocks of "
                             f"{self.block_size}")


class BlockRemoved(msgspec.Struct, tag=True, gc=False):
    """Blocks the engine evicted from its prefix cache (on ``medium``)."""

    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, gc=False):
    """The engine dropped its whole prefix cache (e.g. ``/reset_prefix_cache``)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

# field order of the array encoding (the msgspec struct's declaration order)
_FIELDS = {"BlockStored": BlockStored.__struct_fields__, "BlockRemoved": BlockRemoved.__struct_fields__,
           "AllBlocksCleared": ()}
_MAP_EVENT = msgspec.msgpack.Decoder(KVEvent)


E = TypeVar("E")


class _ArrayBatch(msgspec.Struct, Generic[E], array_like=True, gc=False):
    ts: float
    events: list[E]
    data_parallel_rank: int | None = None


class _MapBatch(msgspec.Struct, Generic[E], kw_only=True, gc=False):
    ts: float = 0.0
    events: list[E]
    data_parallel_rank: int | None = None


# (whole batch, batch with its events left raw) for each encoding of the batch
_ARRAY_BATCH = (msgspec.msgpack.Decoder(_ArrayBatch[KVEvent]), msgspec.msgpack.Decoder(_ArrayBatch[msgspec.Raw]))
_MAP_BATCH = (msgspec.msgpack.Decoder(_MapBatch[KVEvent]), msgspec.msgpack.Decoder(_MapBatch[msgspec.Raw]))


def _is_map(raw: bytes | msgspec.Raw) -> bool:
    """Whether msgpack ``raw`` starts with a map (fixmap 0x80-0x8f, map 16, map 32)."""
    b = memoryview(raw)[0] if len(raw) else 0
    return 0x80 <= b <= 0x8F or b in (0xDE, 0xDF)


@dataclass(slots=True)
class EventBatch:
    """One decoded payload: ``ts`` (engine wall clock, seconds), the ``events`` that
    decoded, ``data_parallel_rank`` (``None`` when absent), how many events were
    ``undecodable`` and why the first one was."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None
    undecodable: int = 0
    first_error: str = ""


def decode_event(raw: bytes | msgspec.Raw) -> KVEvent:
    """One msgpack-encoded event, from either encoding: a map with ``"type"`` (decoded
    straight into the struct) or a tagged array ``["BlockStored", field, ...]`` in
    the struct's field order, possibly cut short (trailing defaults omitted, or an
    older engine's fewer fields); fields past the known ones (a newer engine's) are
    ignored. Raises ``ValueError`` (with the reason) for anything else: an unknown tag,
    a missing field without a default, a field of the wrong type."""
    if _is_map(raw):
        return _MAP_EVENT.decode(raw)
    ev = msgspec.msgpack.decode(raw)
    if not isinstance(ev, list):
        raise ValueError(f"an event must be an array or a map, not {type(ev).__name__}")
    if not ev or not isinstance(ev[0], str):
        raise ValueError("an array event must start with its type tag")
    names = _FIELDS.get(ev[0])
    if names is None:
        raise ValueError(f"unknown event type {ev[0]!r}")
    fields = dict(zip(names, ev[1:]))
    fields["type"] = ev[0]
    # builtin_types: a str is no bytes hash (convert would read it as base64)
    event: KVEvent = msgspec.convert(fields, KVEvent, builtin_types=(bytes,))  # mypy reads a union's TypeForm as Any
    return event


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one message payload (an array ``[ts, events, rank]`` or a map with
    ``events``). Events that cannot be decoded are skipped and counted
    (``undecodable``, ``first_error``). Raises :class:`KVEventDecodeError` when the
    payload is not an ``EventBatch``."""
    whole, by_event = _MAP_BATCH if _is_map(payload) else _ARRAY_BATCH
    try:  # the whole batch at once, when every event is a valid map event
        b = whole.decode(payload)
        return EventBatch(b.ts, b.events, b.data_parallel_rank)
    except msgspec.DecodeError:
        pass  # an array event, a bad event or a bad payload: event by event, below
    try:
        raw = by_event.decode(payload)
    except msgspec.ValidationError as e:
        raise KVEventDecodeError(f"not an EventBatch (an array [ts, events, rank] or a map with events): {e}") \
            from None
    except msgspec.DecodeError as e:
        raise KVEventDecodeError(f"not msgpack: {e}") from None
    batch = EventBatch(raw.ts, [], raw.data_parallel_rank)
    events = batch.events
    for ev in raw.events:
        try:
            events.append(decode_event(ev))
        except (ValueError, KeyError, TypeError) as e:
            batch.undecodable += 1
            if not batch.first_error:
                batch.first_error = str(e)
    return batch


def cache_salt_of(stored: BlockStored) -> str | None:
    """The ``cache_salt`` of a prompt's first block, from its extra keys. vLLM builds a
    block's extra keys as LoRA name, then multimodal keys, then (first block only) the
    cache salt, then prompt-embedding hashes (``generate_block_hash_extra_keys`` in
    ``vllm/v1/core/kv_cache_utils.py``): the salt is the last string after the LoRA
    name. ``None`` when the event has no extra keys or no such string."""
    if stored.parent_block_hash is not None or not stored.extra_keys:
        return None
    first = stored.extra_keys[0]
    if not isinstance(first, list):
        return None
    keys = first[1:] if first and stored.lora_name is not None and first[0] == stored.lora_name else first
    strings = [k for k in keys if isinstance(k, str)]
    return strings[-1] if strings else None


def token_only(stored: BlockStored, i: int) -> bool:
    """Whether block ``i`` of ``stored`` is keyed by its tokens alone (plus LoRA name
    and cache salt): no multimodal input or prompt embedding in its extra keys, so
    that the gateway's token keys can name it."""
    if not stored.extra_keys or i >= len(stored.extra_keys):
        return True
    keys = stored.extra_keys[i]
    if keys is None:
        return True
    if not isinstance(keys, list):
        return False
    rest = keys[1:] if keys and stored.lora_name is not None and keys[0] == stored.lora_name else keys
    if i == 0 and stored.parent_block_hash is None:
        return all(isinstance(k, str) for k in rest) and len(rest) <= 1
    return not rest


def token_only_blocks(stored: BlockStored) -> int:
    """How many leading blocks of ``stored`` are :func:`token_only` (the blocks the
    gateway's token keys can name; the first that is not ends the run)."""
    extra = stored.extra_keys
    n = len(stored.block_hashes)
    if not extra or extra.count(None) == len(extra):
        return n  # no extra keys at all: every block is keyed by its tokens alone
    return next((i for i in range(n) if not token_only(stored, i)), n)


OK, GAP, RESTART, DUPLICATE = "ok", "gap", "restart", "duplicate"


@dataclass(slots=True)
class SequenceTracker:
    """A publisher's sequence numbers, one stream (one backend's data-parallel rank).

    :meth:`observe` classifies each live message's ``seq``:

    - ``ok``: the next one (or the first one seen);
    - ``gap``: later than expected: ``expected`` .. ``seq - 1`` were missed (fill them
      by replay, then :meth:`replayed`);
    - ``duplicate``: already applied through a replay (the live socket queued it
      meanwhile): skip it;
    - ``restart``: lower than anything of this engine's run: the engine restarted (its
      sequence starts at 0 again) with an empty cache.
    """

    expected: int | None = None
    dup_floor: int | None = None  # seqs in [dup_floor, expected) came by replay
    seen: int = field(default=0)

    def observe(self, seq: int) -> str:
        """Classify live ``seq`` and advance. Never raises."""
        self.seen += 1
        exp = self.expected
        if exp is None or seq == exp:
            self.expected = seq + 1
            self.dup_floor = None
            return OK
        if seq > exp:
            return GAP  # expected stays: the caller replays, then calls replayed() or reset_to()
        if self.dup_floor is not None and seq >= self.dup_floor:
            return DUPLICATE
        self.expected = seq + 1
        self.dup_floor = None
        return RESTART

    def replayed(self, start: int, through: int) -> None:
        """Batches ``start`` .. ``through`` were applied from a replay."""
        if self.dup_floor is None:
            self.dup_floor = start
        self.expected = max(self.expected or 0, through + 1)

    def reset_to(self, seq: int) -> None:
        """Continue from live ``seq`` (applied) after a gap that replay could not fill."""
        self.expected = seq + 1
        self.dup_floor = None


@dataclass(slots=True)
class KVEventStats:
    """What one backend's events did (counters since the gateway started)."""

    batches: int = 0  # payloads received
    events: int = 0  # events decoded
    decode_errors: int = 0  # undecodable payloads and events
    ignored: int = 0  # decoded, not indexed: another medium, group or block size, or an unknown parent
    gaps: int = 0  # sequence gaps seen
    replays: int = 0  # gaps filled by replay
    replay_failures: int = 0  # gaps replay could not fill (precise entries dropped)
    restarts: int = 0  # sequence numbers went back: the engine restarted
    clears: int = 0  # AllBlocksCleared
    first_error: str = ""  # why the first undecodable payload or event was
    groups: set[int] = field(default_factory=set)  # the full-attention KV-cache groups indexed
    warned: set[str] = field(default_factory=set)  # the kinds of trouble logged once already


_GPU = (None, "GPU")
_FULL = (None, "full_attention")


def apply_batch(index: PrefixIndex, backend: str, rank: int, batch: EventBatch, stats: KVEventStats) -> list[str]:
    """Apply a decoded batch of ``backend``'s data-parallel ``rank`` to ``index`` (a
    :class:`~routing.prefix_index.PrefixIndex`); returns the warnings worth logging
    once (the kinds not yet in ``stats.warned``).

    A ``BlockStored`` is indexed when it is on the GPU (``medium`` ``GPU`` or absent),
    of a full-attention KV-cache group, in the backend's block size, and its parent's
    key is known (or it has none): its keys are :func:`routing.estimate.token_block_keys`
    of its ``token_ids`` chained from the parent's key, or from ``chain_seed(lora_name
    or the backend's base model, cache_salt)`` for a prompt's first block; blocks with
    multimodal or prompt-embedding extra keys (and what follows them) are not indexed."""
    e = index.engine(backend)
    warnings: list[str] = []

    def warn(kind: str, msg: str) -> None:
        if kind not in stats.warned:
            stats.warned.add(kind)
            warnings.append(msg)

    stats.batches += 1
    stats.events += len(batch.events)
    if batch.undecodable:
        stats.decode_errors += batch.undecodable
        stats.first_error = stats.first_error or batch.first_error
        warn("decode", f"{batch.undecodable} undecodable KV event(s) from {backend}: {batch.first_error}")
    if e is None:
        return warnings
    removed: list[list[int | bytes]] = []  # a run of consecutive removals, applied in one call
    for ev in batch.events:
        if type(ev) is BlockRemoved:
            if ev.medium not in _GPU or (ev.group_idx or 0) not in (stats.groups or {0}):
                stats.ignored += 1
                continue
            removed.append(ev.block_hashes)
            continue
        if removed:
            index.remove_events(backend, rank, removed)
            removed = []
        if type(ev) is BlockStored:
            if ev.medium not in _GPU or ev.kv_cache_spec_kind not in _FULL:
                stats.ignored += 1
                continue
            group = ev.group_idx or 0
            if group not in stats.groups:
                if stats.groups and ev.kv_cache_spec_kind is None:
                    stats.ignored += 1  # a second group of unknown kind: not the one indexed
                    continue
                stats.groups.add(group)
            if ev.block_size != e.block_size:
                stats.ignored += 1
                warn("block_size", f"{backend} stores blocks of {ev.block_size} tokens, configured "
                     f"kv_events.block_size is {e.block_size}: its events are not indexed")
                continue
            if ev.parent_block_hash is None:
                seed = chain_seed(ev.lora_name or e.base_model, cache_salt_of(ev))
            else:
                parent = index.key_of(backend, rank, ev.parent_block_hash)
                if parent is None:
                    stats.ignored += 1
                    continue
                seed = parent
            n = len(ev.block_hashes)
            usable = token_only_blocks(ev)
            if usable < n:
                stats.ignored += 1
            if usable:
                tokens = ev.token_ids if usable == n else ev.token_ids[:usable * ev.block_size]
                hashes = ev.block_hashes if usable == n else ev.block_hashes[:usable]
                index.store(backend, rank, hashes, token_block_keys(tokens, ev.block_size, seed))
            e.live = True
        else:
            stats.clears += 1
            index.clear_precise(backend, rank)
            e.live = True
    if removed:
        index.remove_events(backend, rank, removed)
    return warnings
