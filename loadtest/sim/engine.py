"""Virtual-time model of one vLLM-like inference engine, plus an asyncio driver.

No HTTP here: the simulator server drives :class:`AsyncEngineRunner` (or
:class:`Engine` directly) and maps its counters to ``vllm:*`` metric names.

Interface
---------
::

    engine = Engine(profile, speed=1.0)             # profile: loadtest.sim.profiles.Profile
    engine.add_request(req_id, prompt_token_ids, max_tokens, *,
                       arrival_time,                # caller's clock, seconds
                       prefill_only=False,          # do_remote_decode: stop after prefill
                       remote_prefill_tokens=0,     # do_remote_prefill: KV arrives by transfer
                       output_tokens=None,          # emit EOS after this many tokens ("stop")
                       seed=None,                   # output-token seed (default: none)
                       context=None,                # CRC-32 of the prompt text (default: of its ids)
                       session=None)                # the session it is a turn of (a tag, see below)
    engine.abort(req_id)                            # frees its KV blocks at once
    dt, outputs = engine.step(now)                  # one engine step starting at `now`
    engine.has_work() -> bool

``step`` returns ``dt`` in seconds of the caller's clock (emulated GPU seconds divided
by ``speed``) and a list of :class:`RequestOutput` (a NamedTuple: ``req_id,
new_token_ids, finished, finish_reason, num_cached_tokens, num_prompt_tokens,
kv_transfer_params``), one per request that produced a token this step. The outputs
are "as of" ``now + dt`` (when the step's forward pass ends). When nothing can be
scheduled but a KV transfer is in flight, ``step`` returns ``(seconds until the first
transfer lands, [])``; with no work at all it returns ``(0.0, [])``.

All timestamps (``arrival_time``, ``now``) and latency samples (TTFT, ITL, e2e) are in
the caller's clock. Multiply by ``engine.speed`` to get emulated-GPU seconds.

Scheduler (one step, after vLLM V1's ``Scheduler.schedule``)
-------------------------------------------------------------
1. Running requests, in order: each gets ``min(tokens still to compute, budget)``
   tokens from the step's token budget (``max_num_batched_tokens``): one for a decode,
   a chunk for a prompt still in prefill (chunked prefill). Blocks are allocated for
   exactly the tokens scheduled. If the KV cache has no free block, the *last* running
   request is preempted (recompute mode, like vLLM V1: its blocks are freed, it goes to
   the front of the waiting queue and later recomputes prompt + generated tokens,
   helped by whatever of its blocks are still in the prefix cache).
2. If nothing was preempted this step, waiting requests are admitted in FCFS order
   while ``len(running) < max_num_seqs``, budget remains and the KV cache has the
   blocks for their first chunk; the first one that does not fit blocks the rest
   (head-of-line, as vLLM). On admission the prefix cache is queried.
3. A request that has computed all its tokens samples one new token.

Step duration (emulated GPU seconds; coefficients from the profile)::

    step_s = step_overhead_s                                    # weights read once
           + prefill_s_per_token           * P                  # P: prefill tokens scheduled
           + prefill_attn_s_per_token_pair * A                  # A: sum over prefill chunks of
                                                                #    n * c + n * (n + 1) / 2
                                                                #    (n new tokens after c computed)
           + decode_s_per_seq              * D                  # D: decode sequences (1 token each)
           + kv_read_s_per_token           * C                  # C: sum of decode context lengths
    dt = step_s / speed

So a decode batch of ``B`` sequences of context ``L`` costs ``step_overhead_s + B *
(decode_s_per_seq + L * kv_read_s_per_token)``: the slope in batch size is
``decode_s_per_seq + L * kv_read_s_per_token``.

Paged KV cache and automatic prefix caching (after vLLM's design doc,
https://docs.vllm.ai/en/latest/design/prefix_caching/)
------------------------------------------------------------------------------------
* ``num_gpu_blocks`` blocks of ``block_size`` tokens; a request holds
  ``ceil(computed tokens / block_size)`` blocks.
* Every *full* block of a request's tokens (prompt and generated) gets a chained hash:
  ``h_i = blake2b-64(h_{i-1} || token ids of block i as little-endian uint32 || extra)``,
  with ``h_{-1} = 0``, so ``h_i`` covers blocks ``0..i``; ``extra`` names the request's
  LoRA adapter (empty for the base model), as vLLM's block hashes carry the adapter
  name in their extra keys, so an adapter's blocks are its own. Once computed, a full
  block is registered in the cache under its hash (the first block with a hash wins).
* A new request looks up its leading block hashes; the longest run of cached blocks
  is reused and skips prefill compute. As in vLLM, the last prompt token is always
  recomputed (the hit is capped at ``num_tokens - 1`` tokens, whole blocks only).
  ``num_cached_tokens`` (-> ``usage.prompt_tokens_details.cached_tokens``) is the number
  of tokens computed when the request is first scheduled: local hits plus, for a
  remote-prefill request, the transferred tokens (vLLM V1 semantics).
* Freed blocks keep their hash and join the tail of an LRU free queue (a request's
  blocks are freed last-block-first, so a shared prefix outlives its tail). Allocation
  takes from the head and evicts the hash of a reused block. Blocks without a hash
  (partial blocks) go to the head, so they are reused before any cached block
  (a small deviation from vLLM, which appends them to the tail too).
* Counters follow vLLM: ``prefix_cache_queries`` += tokens of the request at each
  lookup, ``prefix_cache_hits`` += tokens found; ``kv_cache_usage`` = fraction of
  blocks referenced by requests (cached-but-free blocks count as free).
* Sessions (the emulator's own, no vLLM counterpart): a request may carry a
  ``session`` tag. When it finishes (or is preempted or aborted) its blocks are
  tagged with its session; a cached block evicted while its session has no request
  in this engine (the session is between turns here, e.g. in a tool call) counts in
  ``kv_evictions_idle_session``, and ``on_idle_eviction(session)`` is called when set
  (a caller that knows whether the session will come back counts the evictions of
  sessions that do).

Disaggregated prefill/decode (emulates vLLM's NixlConnector flow)
-----------------------------------------------------------------
* ``prefill_only=True`` (``kv_transfer_params.do_remote_decode``): the request generates
  one token and finishes; its output carries ``kv_transfer_params`` shaped like vLLM
  NixlConnector's (``do_remote_prefill=True``, ``do_remote_decode=False``,
  ``remote_engine_id``, ``remote_request_id``, ``remote_block_ids``, ``tp_size``,
  ``remote_num_tokens``) plus ``remote_block_hashes`` (hex) and ``num_tokens``; the
  server fills in ``remote_host`` and ``remote_port``. Its
  blocks are freed at once but stay in the prefix cache until evicted.
* ``remote_prefill_tokens=N`` (``do_remote_prefill``): on admission, local prefix hits
  are used first; the other ``min(N, prompt_len - 1) - hits`` tokens arrive over the
  link in ``tokens * kv_bytes_per_token / link_bandwidth_bytes_per_s`` seconds, during
  which the request holds its blocks but no running slot, and other requests keep
  running. Then it computes the last prompt token locally and decodes.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import itertools
import time
import zlib
from array import array
from collections.abc import AsyncIterator, Callable
from typing import NamedTuple

from loadtest.sim import tokenizer
from loadtest.sim.profiles import Profile

WAITING, TRANSFERRING, RUNNING, FINISHED = "waiting", "transferring", "running", "finished"

_engine_ids = itertools.count()


class RequestOutput(NamedTuple):
    """Per-request result of one step.

    ``new_token_ids``: tokens generated this step (one, or none when the request was
    finished by EOS). ``finish_reason``: ``"length"`` | ``"stop"`` | None.
    ``num_cached_tokens``: prompt tokens served from cache/transfer (vLLM
    ``num_cached_tokens``). ``kv_transfer_params``: set on the final output of a
    ``prefill_only`` request, else None.
    """

    req_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    num_prompt_tokens: int
    kv_transfer_params: dict | None = None


def lora_extra_key(lora: str | None) -> bytes:
    """The extra key a block of a request running with LoRA adapter ``lora`` is hashed
    with (empty for the base model): vLLM puts the adapter's name in every block's
    hash (``_gen_lora_extra_hash_keys`` in ``vllm/v1/core/kv_cache_utils.py``), so an
    adapter's blocks never hit for the base model or another adapter."""
    return b"" if lora is None else b"lora\x00" + lora.encode("utf-8")


def block_hash(parent: int, token_ids, extra: bytes = b"") -> int:
    """Chained hash of one full block: blake2b-64 of parent hash, uint32 LE token ids
    and the block's ``extra`` key (:func:`lora_extra_key`)."""
    h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(array("I", token_ids).tobytes())
    if extra:
        h.update(extra)
    return int.from_bytes(h.digest(), "little")


def prompt_block_hashes(token_ids: list[int], block_size: int, lora: str | None = None) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` (the engine's own scheme),
    for a request with LoRA adapter ``lora`` (None: the base model)."""
    out, parent, extra = [], 0, lora_extra_key(lora)
    for i in range(len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        out.append(parent)
    return out


class KVStored(NamedTuple):
    """Full blocks that became findable in the prefix cache, in chain order.

    ``block_hashes[i]`` covers ``token_ids[i * block_size:(i + 1) * block_size]``;
    ``parent_block_hash`` is the hash of the block before the first one (None for a
    prompt's first block); ``lora_name`` and ``lora_id`` name the LoRA adapter the
    blocks were computed with (None: the base model). vLLM's ``BlockStored``."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    lora_name: str | None = None
    lora_id: int | None = None


class KVRemoved(NamedTuple):
    """A cached block whose hash was dropped (its block reused). vLLM's ``BlockRemoved``."""

    block_hash: int


class KVCleared(NamedTuple):
    """Every cached hash was dropped (prefix-cache reset). vLLM's ``AllBlocksCleared``."""


class KVCache:
    """Paged KV cache: ``num_blocks`` blocks, ref counts, hash -> block map, LRU free queue.

    With ``record_events`` the cache logs what a KV-event consumer must learn, in
    order, into ``events`` (drained by :meth:`Engine.take_kv_events`), as vLLM's block
    pool does for its event publisher: :class:`KVStored` when full blocks become
    findable, :class:`KVRemoved` when a cached block's hash is dropped (eviction on
    reuse), :class:`KVCleared` on a prefix-cache reset.
    """

    def __init__(self, num_blocks: int, block_size: int, record_events: bool = False):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # Free blocks in eviction order: head (first) is reused first.
        self.free: collections.OrderedDict[int, None] = collections.OrderedDict(
            (b, None) for b in range(num_blocks)
        )
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.num_evictions = 0  # cached blocks whose hash was dropped on reuse
        self.owner: list[str | None] = [None] * num_blocks  # the session that last released the block
        self.on_evict: Callable[[str], None] | None = None  # called with the owner of an evicted block
        self.events: list[KVStored | KVRemoved | KVCleared] | None = [] if record_events else None

    @property
    def num_free(self) -> int:
        """Blocks not referenced by any request (includes cached-but-free blocks)."""
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (vLLM ``kv_cache_usage_perc``, 0..1)."""
        return 1.0 - len(self.free) / self.num_blocks

    def lookup(self, hashes: list[int]) -> list[int]:
        """Blocks of the longest cached prefix of ``hashes`` (no state change)."""
        out = []
        cached = self.cached
        for h in hashes:
            b = cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks (removing free ones from the LRU queue)."""
        ref, free = self.ref_cnt, self.free
        for b in blocks:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks from the head of the free queue, or None if not enough."""
        free = self.free
        if n > len(free):
            return None
        out = []
        ref, bh, cached, owner = self.ref_cnt, self.block_hash, self.cached, self.owner
        for _ in range(n):
            b, _ = free.popitem(last=False)
            h = bh[b]
            o = owner[b]
            if h is not None:
                if cached.get(h) == b:
                    del cached[h]
                    if self.events is not None:
                        self.events.append(KVRemoved(h))
                bh[b] = None
                self.num_evictions += 1
                if o is not None and self.on_evict is not None:
                    self.on_evict(o)
            if o is not None:
                owner[b] = None
            ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int], owner: str | None = None) -> None:
        """Drop one reference on each block; unreferenced ones become free. ``owner``:
        the session of the request releasing them (tags the blocks, see the module
        docstring).

        Blocks are released last-first, so a request's tail is evicted before its
        prefix; blocks with no hash go to the head (reused first).
        """
        ref, free, bh, tags = self.ref_cnt, self.free, self.block_hash, self.owner
        for b in reversed(blocks):
            tags[b] = owner
            ref[b] -= 1
            if ref[b] == 0:
                free[b] = None
                if bh[b] is None:
                    free.move_to_end(b, last=False)

    def register(self, block: int, h: int) -> bool:
        """Make a computed full block findable under hash ``h`` (first one wins).
        Returns whether it was registered (False: the hash or the block already was)."""
        if h not in self.cached and self.block_hash[block] is None:
            self.cached[h] = block
            self.block_hash[block] = h
            return True
        return False

    def reset_prefix_cache(self) -> None:
        """Forget all hashes (vLLM ``/reset_prefix_cache``); referenced blocks stay."""
        for b in range(self.num_blocks):
            self.block_hash[b] = None
        self.cached.clear()
        if self.events is not None:
            self.events.append(KVCleared())


class Request:
    """Engine-side state of one request (internal)."""

    __slots__ = (
        "req_id", "token_ids", "prompt_len", "max_tokens", "output_tokens", "seed", "context",
        "num_output", "num_computed", "blocks", "hashes", "num_registered", "status",
        "num_cached_tokens", "prefill_only", "remote_prefill_tokens", "kv_ready_at",
        "arrival_time", "first_scheduled_time", "first_token_time", "last_token_time", "lora",
        "lora_id", "session",
    )

    def __init__(self, req_id, prompt, max_tokens, arrival_time, prefill_only,
                 remote_prefill_tokens, output_tokens, seed, lora=None, lora_id=None, context=0, session=None):
        self.req_id = req_id
        self.session = session
        self.lora = lora
        self.lora_id = lora_id
        self.token_ids = list(prompt)  # prompt + generated, grows
        self.prompt_len = len(prompt)
        self.max_tokens = max_tokens
        self.output_tokens = output_tokens
        self.seed = seed
        self.context = context  # CRC-32 of the text so far: the prompt's, then each generated token's
        self.num_output = 0
        self.num_computed = 0
        self.blocks: list[int] = []
        self.hashes: list[int] = []
        self.num_registered = 0
        self.status = WAITING
        self.num_cached_tokens = -1
        self.prefill_only = prefill_only
        self.remote_prefill_tokens = remote_prefill_tokens
        self.kv_ready_at = 0.0
        self.arrival_time = arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time = 0.0  # read only once first_token_time is set


def _evict(lru: collections.OrderedDict[str, None], size: int, keep: set[str]) -> None:
    """Drop the least recently used entries of ``lru`` not in ``keep`` down to ``size``."""
    for k in list(lru):
        if len(lru) <= size:
            return
        if k not in keep:
            del lru[k]


class Engine:
    """One simulated engine (see module docstring for the model and the interface).

    Raises ValueError from ``add_request`` for an empty prompt, ``max_tokens < 1``,
    ``prompt + max_tokens > max_model_len``, a duplicate id, or a request that cannot
    fit in the whole KV cache.
    """

    def __init__(self, profile: Profile, speed: float = 1.0, engine_id: str | None = None, *,
                 kv_events: bool = False, tok: tokenizer.Tokenizer | None = None):
        if speed <= 0:
            raise ValueError("speed must be > 0")
        self.profile = profile
        self.speed = float(speed)
        self.engine_id = engine_id or f"sim-{profile.name}-{next(_engine_ids)}"
        self.block_size = profile.block_size
        # Whose ids the generated tokens are (the emulator's by default).
        self.tok = tok or tokenizer.EMULATOR
        self._token_text: dict[int, bytes] = {}  # generated token id -> its text (UTF-8)
        self.kv = KVCache(profile.num_gpu_blocks, profile.block_size, record_events=kv_events)
        self.requests: dict[str, Request] = {}
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.transferring: list[Request] = []
        # Monotonic counters (vLLM names in comments).
        self.prefix_cache_queries = 0  # vllm:prefix_cache_queries (tokens)
        self.prefix_cache_hits = 0  # vllm:prefix_cache_hits (tokens)
        self.num_preemptions = 0  # vllm:num_preemptions
        self.prompt_tokens_total = 0  # vllm:prompt_tokens
        self.prompt_tokens_cached_total = 0  # vllm:prompt_tokens_cached (hits and KV-transferred tokens)
        self.prefill_s_total = 0.0  # vllm:request_prefill_time_seconds's sum (counted at first token)
        self.generation_tokens_total = 0  # vllm:generation_tokens
        self.request_success: collections.Counter[str] = collections.Counter()  # by finish reason
        self.num_aborted = 0
        self.kv_transfer_tokens_total = 0  # tokens received over the link
        self.num_steps = 0  # non-idle steps
        self.busy_s_total = 0.0  # sum of step dt (caller's clock)
        self.prefill_tokens_computed_total = 0  # prefill compute actually spent (tokens)
        # Sessions (module docstring): requests in the engine per session, and cached
        # blocks evicted while their session had none.
        self.live_sessions: collections.Counter[str] = collections.Counter()
        self.kv_evictions_idle_session = 0
        self.on_idle_eviction: Callable[[str], None] | None = None
        self.kv.on_evict = self._evicted
        # Latency samples in the caller's clock; drained by pop_samples().
        self._samples: dict[str, list[float]] = {
            "ttft_s": [], "itl_s": [], "e2e_s": [], "queue_s": [], "prefill_s": [],
            "decode_s": [], "prompt_tokens": [], "generation_tokens": [],
        }
        # Last step, for tests and debugging.
        self.last_step: dict = {}
        # LoRA (vLLM's LoRAConfig): at most ``max_loras`` distinct adapters in one batch;
        # ``max_cpu_loras`` adapters' weights kept in host memory (LRU); a scheduled
        # request whose adapter is not there blocks its step for ``lora_load_s``
        # (reading the weights), one not in a GPU slot for ``lora_swap_s`` (copying
        # them in), both emulated seconds. None: LoRA off.
        self.max_loras: int | None = None
        self.max_cpu_loras = 0
        self.lora_load_s = 0.0
        self.lora_swap_s = 0.0
        self.cpu_loras: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.gpu_loras: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.lora_loads = 0  # adapter weights read into host memory (sim:lora_loads)

    # --- public API -----------------------------------------------------------------

    @property
    def num_running(self) -> int:
        """vllm:num_requests_running."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """vllm:num_requests_waiting (includes requests waiting for remote KV)."""
        return len(self.waiting) + len(self.transferring)

    @property
    def kv_cache_usage(self) -> float:
        """vllm:kv_cache_usage_perc, a fraction in [0, 1]."""
        return self.kv.usage

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.transferring)

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        *,
        arrival_time: float,
        prefill_only: bool = False,
        remote_prefill_tokens: int = 0,
        output_tokens: int | None = None,
        seed: int | None = None,
        lora: str | None = None,
        lora_id: int | None = None,
        context: int | None = None,
        session: str | None = None,
    ) -> None:
        """Queue a request (see module docstring for the flags; ``lora``: the adapter
        it runs with, LoRA must be on; ``lora_id``: that adapter's id on the server,
        vLLM's ``lora_int_id``, reported in KV events; ``session``: the session it is a
        turn of, module docstring). Its KV blocks are its adapter's own
        (:func:`lora_extra_key`). Units: tokens, seconds.

        The output is greedy and a function of the text before each token: token ``k``
        is ``tok.output_token_id(seed, c_k)`` where ``c_k`` is the CRC-32 of the prompt's
        text (``context``; default: the CRC-32 of its token ids) followed by the text
        of the tokens generated before it (``seed``: the request's, default 0). A request
        whose prompt is another's prompt text followed by the first ``k`` tokens that one
        generated (a generation continued elsewhere) therefore goes on with that one's
        token ``k``, as a greedy model would."""
        p = self.profile
        n = len(prompt_token_ids)
        if req_id in self.requests:
            raise ValueError(f"duplicate request id {req_id!r}")
        if n == 0:
            raise ValueError("prompt must contain at least one token")
        if prefill_only:
            max_tokens = 1
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if n + max_tokens > p.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {p.max_model_len} tokens. However, "
                f"you requested {n + max_tokens} tokens ({n} in the messages, {max_tokens} "
                f"in the completion)."
            )
        if -(-(n + max_tokens) // p.block_size) > p.num_gpu_blocks:
            raise ValueError(f"request needs more KV blocks than the cache has ({p.num_gpu_blocks})")
        if seed is None:
            seed = 0
        if context is None:
            context = zlib.crc32(array("I", prompt_token_ids).tobytes())
        if lora is not None and self.max_loras is None:
            raise ValueError("LoRA is not enabled on this engine")
        req = Request(req_id, prompt_token_ids, max_tokens, arrival_time, prefill_only,
                      max(0, int(remote_prefill_tokens)), output_tokens, seed, lora, lora_id, context, session)
        self.requests[req_id] = req
        if session is not None:
            self.live_sessions[session] += 1
        self.waiting.append(req)

    def abort(self, req_id: str) -> None:
        """Drop a request wherever it is and free its KV blocks now (no-op if unknown)."""
        req = self.requests.pop(req_id, None)
        if req is None:
            return
        if req.status == RUNNING:
            self.running.remove(req)
        elif req.status == WAITING:
            self.waiting.remove(req)
        elif req.status == TRANSFERRING:
            self.transferring.remove(req)
        self.kv.release(req.blocks, req.session)
        req.blocks = []
        req.status = FINISHED
        self._left(req)
        self.num_aborted += 1
        self.request_success["abort"] += 1

    def pop_samples(self) -> dict[str, list[float]]:
        """Return and clear the latency samples collected since the last call.

        Keys: ``ttft_s``, ``itl_s``, ``e2e_s``, ``queue_s`` (arrival -> first scheduled),
        ``prefill_s`` (first scheduled -> first token), ``decode_s`` (first -> last
        token), ``prompt_tokens`` and ``generation_tokens`` (per finished request).
        Seconds are in the caller's clock.
        """
        out = self._samples
        self._samples = {k: [] for k in out}
        return out

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()

    def take_kv_events(self) -> list[KVStored | KVRemoved | KVCleared]:
        """The KV-cache events since the last call, in order (empty unless the engine
        was built with ``kv_events=True``)."""
        ev = self.kv.events
        if not ev:
            return []
        self.kv.events = []
        return ev

    # --- read-only queries of the prefix cache (the offline replay's oracle) ------------

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable in the prefix cache now (referenced or free but not evicted)."""
        return len(self.kv.cached)

    def cached_prefix_blocks(self, hashes: list[int], start: int = 0) -> int:
        """The end of the run of cached blocks of ``hashes`` (chained block hashes as
        :func:`prompt_block_hashes` gives them) beginning at index ``start``: the
        cached prefix has ``cached_prefix_blocks(hashes)`` blocks. No state changes."""
        cached = self.kv.cached
        i, n = start, len(hashes)
        while i < n and hashes[i] in cached:
            i += 1
        return i

    def cached_prefix_tokens(self, token_ids: list[int], lora: str | None = None) -> int:
        """Leading tokens of a prompt ``token_ids`` (run with LoRA adapter ``lora``, None:
        the base model) that this engine would serve from its prefix cache if the prompt
        were admitted now: whole blocks, at most ``len(token_ids) - 1`` tokens (the last
        prompt token is always recomputed), as the scheduler's own lookup counts a hit.
        No state changes."""
        n = max(len(token_ids) - 1, 0) // self.block_size
        hashes = prompt_block_hashes(token_ids[: n * self.block_size], self.block_size, lora)
        return self.cached_prefix_blocks(hashes) * self.block_size

    def stats(self) -> dict:
        """Snapshot of gauges and counters as plain numbers (for /metrics)."""
        return {
            "num_requests_running": self.num_running,
            "num_requests_waiting": self.num_waiting,
            "kv_cache_usage_perc": self.kv.usage,
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "num_preemptions": self.num_preemptions,
            "prompt_tokens": self.prompt_tokens_total,
            "prompt_tokens_cached": self.prompt_tokens_cached_total,
            "prefill_s": self.prefill_s_total,
            "generation_tokens": self.generation_tokens_total,
            "request_success": dict(self.request_success),
            "kv_evictions": self.kv.num_evictions,
            "kv_evictions_idle_session": self.kv_evictions_idle_session,
            "kv_transfer_tokens": self.kv_transfer_tokens_total,
            "num_steps": self.num_steps,
            "busy_s": self.busy_s_total,
            "block_size": self.block_size,
            "num_gpu_blocks": self.kv.num_blocks,
        }

    # --- the step ---------------------------------------------------------------------

    def step(self, now: float) -> tuple[float, list[RequestOutput]]:
        """Run one scheduling step + forward pass starting at ``now``.

        Returns ``(dt, outputs)``; see module docstring. Pure and synchronous.
        """
        p = self.profile
        kv = self.kv
        bs = self.block_size
        speed = self.speed

        # KV transfers that have landed: back to the front of the waiting queue.
        if self.transferring:
            landed = [r for r in self.transferring if r.kv_ready_at <= now]
            if landed:
                self.transferring = [r for r in self.transferring if r.kv_ready_at > now]
                for r in reversed(landed):
                    self._register_full_blocks(r)
                    r.status = WAITING
                    self.waiting.appendleft(r)

        budget = p.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        running = self.running
        preempted = False

        # 1. Running requests.
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = len(req.token_ids) - req.num_computed
            if n > budget:
                n = budget
            need = -(-(req.num_computed + n) // bs) - len(req.blocks)
            ok = True
            while need > 0:
                new = kv.allocate(need)
                if new is not None:
                    req.blocks.extend(new)
                    break
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    ok = False
                    break
            if not ok:
                break
            scheduled.append((req, n))
            budget -= n
            i += 1

        # 2. Waiting requests (not in a step that preempted).
        lora_s = 0.0
        if not preempted:
            waiting = self.waiting
            max_seqs = p.max_num_seqs
            batch_loras = {r.lora for r, _ in scheduled if r.lora is not None}
            skipped: list[Request] = []
            while waiting and budget > 0 and len(running) < max_seqs:
                req = waiting[0]
                if req.lora is not None and req.lora not in batch_loras:
                    if len(batch_loras) >= self.max_loras:  # type: ignore[operator]  # set: add_request checked
                        skipped.append(waiting.popleft())  # no adapter slot: waits (vLLM skips it)
                        continue
                    batch_loras.add(req.lora)
                    lora_s += self._activate_lora(req.lora, batch_loras)
                num_tokens = len(req.token_ids)
                hit: list[int] = []
                fresh = not req.blocks
                if fresh:
                    n_lookup = (num_tokens - 1) // bs
                    hashes = self._hashes(req, n_lookup)
                    hit = kv.lookup(hashes[:n_lookup])
                    computed = len(hit) * bs
                else:  # KV already in place (landed transfer)
                    computed = req.num_computed
                remote = 0
                if fresh and req.remote_prefill_tokens:
                    remote = max(0, min(req.remote_prefill_tokens, num_tokens - 1) - computed)
                if remote:
                    n = 0
                    need = -(-(computed + remote) // bs) - len(hit)
                else:
                    n = min(num_tokens - computed, budget)
                    need = -(-(computed + n) // bs) - len(req.blocks) - len(hit)
                n_hit_free = sum(1 for b in hit if kv.ref_cnt[b] == 0)
                if need > kv.num_free - n_hit_free:
                    break  # head-of-line: wait for blocks
                waiting.popleft()
                if fresh:
                    self.prefix_cache_queries += num_tokens
                    self.prefix_cache_hits += computed
                    kv.touch(hit)
                    req.blocks = hit
                    req.num_registered = len(hit)
                    req.num_computed = computed
                if need > 0:
                    fresh_blocks = kv.allocate(need)
                    assert fresh_blocks is not None  # checked against num_free above
                    req.blocks.extend(fresh_blocks)
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = computed + remote
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = now
                    self._samples["queue_s"].append(max(0.0, now - req.arrival_time))
                if remote:
                    req.num_computed = computed + remote
                    req.remote_prefill_tokens = 0
                    req.status = TRANSFERRING
                    req.kv_ready_at = now + p.kv_transfer_s(remote) / speed
                    self.kv_transfer_tokens_total += remote
                    self.transferring.append(req)
                    continue
                req.status = RUNNING
                running.append(req)
                scheduled.append((req, n))
                budget -= n
            waiting.extendleft(reversed(skipped))

        if not scheduled:
            self.last_step = {"idle": True}
            if self.transferring:
                return max(0.0, min(r.kv_ready_at for r in self.transferring) - now), []
            return 0.0, []

        # 3. Cost of the step.
        prefill_tokens = 0
        attn_pairs = 0
        decode_seqs = 0
        decode_ctx = 0
        for req, n in scheduled:
            c = req.num_computed
            if n == 1 and c == len(req.token_ids) - 1 and c >= req.prompt_len:
                decode_seqs += 1
                decode_ctx += c + 1
            else:
                prefill_tokens += n
                attn_pairs += n * c + n * (n + 1) // 2
        step_s = (
            p.step_overhead_s
            + p.prefill_s_per_token * prefill_tokens
            + p.prefill_attn_s_per_token_pair * attn_pairs
            + p.decode_s_per_seq * decode_seqs
            + p.kv_read_s_per_token * decode_ctx
            + lora_s
        )
        dt = step_s / speed
        t_end = now + dt
        self.num_steps += 1
        self.busy_s_total += dt
        self.prefill_tokens_computed_total += prefill_tokens
        self.last_step = {
            "idle": False, "prefill_tokens": prefill_tokens, "attn_pairs": attn_pairs,
            "decode_seqs": decode_seqs, "decode_ctx_tokens": decode_ctx,
            "num_scheduled": len(scheduled), "step_s": step_s, "dt": dt,
        }

        # 4. Advance requests, sample tokens, finish.
        outputs: list[RequestOutput] = []
        finished: list[Request] = []
        samples = self._samples
        for req, n in scheduled:
            req.num_computed += n
            if req.num_computed // bs > req.num_registered:
                self._register_full_blocks(req)
            if req.num_computed < len(req.token_ids):
                continue  # partial prefill chunk
            # Sample one token.
            k = req.num_output
            if req.output_tokens is not None and k >= req.output_tokens:
                tok = self.tok.eos_token_id
                new_ids: list[int] = []
                reason = "stop"
            else:
                tok = self.tok.output_token_id(req.seed, req.context)
                text = self._token_text.get(tok)
                if text is None:
                    text = self._token_text[tok] = self.tok.detokenize([tok]).encode()
                req.context = zlib.crc32(text, req.context)
                new_ids = [tok]
                req.token_ids.append(tok)
                req.num_output = k + 1
                self.generation_tokens_total += 1
                reason = None
                if req.num_output >= req.max_tokens:
                    reason = "length"
                elif req.output_tokens is not None and req.num_output >= req.output_tokens:
                    reason = "stop"
            if req.first_token_time is None:
                req.first_token_time = t_end
                samples["ttft_s"].append(t_end - req.arrival_time)
                assert req.first_scheduled_time is not None  # set when it was scheduled
                prefill_s = t_end - req.first_scheduled_time
                samples["prefill_s"].append(prefill_s)
                self.prefill_s_total += prefill_s
                self.prompt_tokens_total += req.prompt_len
                self.prompt_tokens_cached_total += max(req.num_cached_tokens, 0)
            elif new_ids:
                samples["itl_s"].append(t_end - req.last_token_time)
            if new_ids:
                req.last_token_time = t_end
            kvp = None
            if reason is not None:
                finished.append(req)
                if req.prefill_only:
                    kvp = self._kv_transfer_params(req)
            outputs.append(RequestOutput(
                req.req_id, new_ids, reason is not None, reason,
                max(req.num_cached_tokens, 0), req.prompt_len, kvp,
            ))
            if reason is not None:
                self._finish(req, reason, t_end)
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
        return dt, outputs

    # --- LoRA -------------------------------------------------------------------------

    def enable_lora(self, max_loras: int, max_cpu_loras: int, load_s: float, swap_s: float) -> None:
        """Turn LoRA on (see ``__init__``). Raises ValueError on bad bounds."""
        if max_loras < 1 or max_cpu_loras < max_loras or load_s < 0 or swap_s < 0:
            raise ValueError("need max_loras >= 1, max_cpu_loras >= max_loras, load_s >= 0, swap_s >= 0")
        self.max_loras, self.max_cpu_loras = max_loras, max_cpu_loras
        self.lora_load_s, self.lora_swap_s = load_s, swap_s

    def lora_in_use(self) -> tuple[set[str], set[str]]:
        """(adapters of running requests, adapters of waiting ones): the labels of
        vLLM's ``vllm:lora_requests_info``."""
        run = {r.lora for r in self.running if r.lora is not None}
        wait = {r.lora for r in self.waiting if r.lora is not None}
        wait |= {r.lora for r in self.transferring if r.lora is not None}
        return run, wait

    def _activate_lora(self, name: str, batch: set[str]) -> float:
        """Put adapter ``name`` in a GPU slot for this step's ``batch``; returns the
        emulated seconds it costs (a read into host memory when it is not there, a
        copy when it is not in a GPU slot). Least recently used adapters not in
        ``batch`` are evicted."""
        cost = 0.0
        if name in self.cpu_loras:
            self.cpu_loras.move_to_end(name)
        else:
            cost += self.lora_load_s
            self.lora_loads += 1
            self.cpu_loras[name] = None
            _evict(self.cpu_loras, self.max_cpu_loras, batch)
        if name in self.gpu_loras:
            self.gpu_loras.move_to_end(name)
        else:
            cost += self.lora_swap_s
            self.gpu_loras[name] = None
            _evict(self.gpu_loras, self.max_loras or 1, batch)
        return cost

    def preload_lora(self, name: str) -> None:
        """Adapter ``name``'s weights are now in host memory (read by
        ``/v1/load_lora_adapter``, which paid for it)."""
        self.lora_loads += 1
        self.cpu_loras[name] = None
        self.cpu_loras.move_to_end(name)
        _evict(self.cpu_loras, self.max_cpu_loras, {r.lora for r in self.running if r.lora is not None})

    def unload_lora(self, name: str) -> None:
        """Drop adapter ``name``'s weights (``/v1/unload_lora_adapter``)."""
        self.cpu_loras.pop(name, None)
        self.gpu_loras.pop(name, None)

    # --- internals --------------------------------------------------------------------

    def _hashes(self, req: Request, n_blocks: int) -> list[int]:
        """Chained hashes of the first ``n_blocks`` full blocks of ``req`` (memoized)."""
        hs = req.hashes
        if len(hs) < n_blocks:
            bs = self.block_size
            toks = req.token_ids
            parent = hs[-1] if hs else 0
            extra = lora_extra_key(req.lora)
            for i in range(len(hs), n_blocks):
                parent = block_hash(parent, toks[i * bs : (i + 1) * bs], extra)
                hs.append(parent)
        return hs

    def _register_full_blocks(self, req: Request) -> None:
        n_full = min(req.num_computed // self.block_size, len(req.blocks))
        if n_full <= req.num_registered:
            return
        hs = self._hashes(req, n_full)
        kv = self.kv
        reg = kv.register
        if kv.events is None:
            for i in range(req.num_registered, n_full):
                reg(req.blocks[i], hs[i])
        else:
            # One stored event per run of newly registered blocks (a block whose hash
            # another block already holds is not registered, so it breaks the run).
            bs, toks = self.block_size, req.token_ids
            start = None
            for i in range(req.num_registered, n_full + 1):
                if i < n_full and reg(req.blocks[i], hs[i]):
                    if start is None:
                        start = i
                    continue
                if start is not None:
                    kv.events.append(KVStored(hs[start:i], hs[start - 1] if start else None,
                                              toks[start * bs:i * bs], req.lora, req.lora_id))
                    start = None
        req.num_registered = n_full

    def _evicted(self, session: str) -> None:
        """A cached block last released by ``session`` was evicted."""
        if not self.live_sessions.get(session):
            self.kv_evictions_idle_session += 1
            if self.on_idle_eviction is not None:
                self.on_idle_eviction(session)

    def _left(self, req: Request) -> None:
        """``req`` is no longer in the engine (finished or aborted)."""
        s = req.session
        if s is not None:
            n = self.live_sessions[s] - 1
            if n > 0:
                self.live_sessions[s] = n
            else:
                del self.live_sessions[s]

    def _preempt(self, req: Request) -> None:
        self.kv.release(req.blocks, req.session)
        req.blocks = []
        req.num_computed = 0
        req.num_registered = 0
        req.status = WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _finish(self, req: Request, reason: str, t_end: float) -> None:
        self.kv.release(req.blocks, req.session)
        req.blocks = []
        req.status = FINISHED
        self.requests.pop(req.req_id, None)
        self._left(req)
        self.request_success[reason] += 1
        s = self._samples
        s["e2e_s"].append(t_end - req.arrival_time)
        s["decode_s"].append(t_end - (req.first_token_time or t_end))
        s["prompt_tokens"].append(req.prompt_len)
        s["generation_tokens"].append(req.num_output)

    def _kv_transfer_params(self, req: Request) -> dict:
        n_full = req.prompt_len // self.block_size
        # Keys as vLLM's NixlConnector.request_finished returns them (do_remote_prefill,
        # do_remote_decode, remote_block_ids, remote_engine_id, remote_request_id,
        # remote_host, remote_port, tp_size, remote_num_tokens), plus the emulator's
        # remote_block_hashes and num_tokens.
        return {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_engine_id": self.engine_id,
            "remote_request_id": req.req_id,
            "remote_block_ids": list(req.blocks),
            "remote_block_hashes": [f"{h:016x}" for h in self._hashes(req, n_full)],
            "remote_host": None,
            "remote_port": None,
            "tp_size": 1,
            "remote_num_tokens": req.prompt_len,
            "num_tokens": req.prompt_len,
        }


class _Stat:
    """Count / sum / max plus a bounded window of recent samples (seconds)."""

    __slots__ = ("count", "total", "max", "recent")

    def __init__(self, window: int = 4096):
        self.count = 0
        self.total = 0.0
        self.max = 0.0
        self.recent: collections.deque[float] = collections.deque(maxlen=window)

    def add(self, x: float) -> None:
        self.count += 1
        self.total += x
        if x > self.max:
            self.max = x
        self.recent.append(x)

    def summary(self) -> dict:
        r = sorted(self.recent)
        pct = (lambda q: r[min(len(r) - 1, int(q * len(r)))]) if r else (lambda q: 0.0)
        return {
            "count": self.count,
            "mean": self.total / self.count if self.count else 0.0,
            "max": self.max,
            "p50": pct(0.50),
            "p99": pct(0.99),
        }


_DONE = object()


class AsyncEngineRunner:
    """Drives an :class:`Engine` in real time on the running asyncio loop.

    One background task runs ``engine.step(now)`` with ``now = loop.time()``, sleeps
    until ``now + dt`` (so the Python cost of the step is absorbed, not added), then
    delivers the step's outputs. The next step starts at ``now + dt`` on the emulated
    timeline even if the wake-up was a little late (up to ``max_catchup_s``), so
    event-loop jitter does not accumulate into a slower emulated GPU. It waits on an
    event, not a busy loop, when there is no work. Health of the emulator itself (is Python keeping up?):

    * ``compute`` - wall seconds spent inside ``engine.step``.
    * ``overrun`` - how late each step's outputs were delivered versus ``now + dt``
      (positive part). It is the sum of event-loop lag and any step whose Python cost
      exceeded its emulated duration. ``stats()`` summarizes both (count, mean, max,
      p50, p99 over the last 4096 steps), plus ``late_steps`` (overrun > 1 ms).

    Use ``async with runner:`` (or ``start()`` / ``stop()``), then either
    ``submit()`` (eager validation, returns a :class:`RequestStream`) or::

        async with contextlib.aclosing(runner.generate(rid, ids, 64)) as stream:
            async for out in stream:        # RequestOutput per step with a token
                ...

    Cancelling the consumer, or closing the iterator early, aborts the request in the
    engine (its KV blocks are freed at once).
    """

    def __init__(self, engine: Engine, *, max_catchup_s: float = 0.05, on_step=None):
        self.engine = engine
        self.max_catchup_s = max_catchup_s
        # Called with no arguments once a step's outputs are delivered (the KV-event
        # publisher sends the step's events then, as vLLM does after each step).
        self.on_step = on_step
        self._queues: dict[str, asyncio.Queue] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.compute = _Stat()
        self.overrun = _Stat()
        self.late_steps = 0

    async def __aenter__(self) -> AsyncEngineRunner:
        self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def start(self) -> None:
        """Start the step loop on the running event loop (idempotent)."""
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        """Stop the step loop; pending streams end with ``RuntimeError``."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        for q in self._queues.values():
            q.put_nowait(RuntimeError("engine stopped"))

    def stats(self) -> dict:
        """Emulator health: step compute and overrun summaries (seconds), late steps."""
        return {
            "steps": self.compute.count,
            "compute_s": self.compute.summary(),
            "overrun_s": self.overrun.summary(),
            "late_steps": self.late_steps,
        }

    def submit(
        self, req_id: str, prompt_token_ids: list[int], max_tokens: int, **kw
    ) -> RequestStream:
        """Add a request now and return its :class:`RequestStream`.

        Unlike :meth:`generate`, validation errors (``ValueError`` from
        :meth:`Engine.add_request`) are raised here, before the caller has sent anything,
        and the request is in the engine as soon as this returns. The caller must close
        the stream (``async with`` or ``close()``) or consume it to the end; closing it
        early aborts the request (its KV blocks are freed at once).
        """
        if self._task is None or self._wake is None:
            raise RuntimeError("runner not started")
        loop = asyncio.get_running_loop()
        self.engine.add_request(req_id, prompt_token_ids, max_tokens,
                                arrival_time=loop.time(), **kw)
        q: asyncio.Queue = asyncio.Queue()
        self._queues[req_id] = q
        self._wake.set()
        return RequestStream(self, req_id, q)

    async def generate(
        self, req_id: str, prompt_token_ids: list[int], max_tokens: int, **kw
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its :class:`RequestOutput` per step until finished.

        ``kw`` goes to :meth:`Engine.add_request` (``prefill_only``,
        ``remote_prefill_tokens``, ``output_tokens``, ``seed``, ``context``). Raises ValueError
        from ``add_request`` before yielding anything.
        """
        stream = self.submit(req_id, prompt_token_ids, max_tokens, **kw)
        with stream:
            async for out in stream:
                yield out

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self.engine
        wake = self._wake
        assert wake is not None  # made by start() before this task
        queues = self._queues
        perf = time.perf_counter
        catchup = self.max_catchup_s
        now = None  # start of the next step on the emulated timeline
        while True:
            if not engine.has_work():
                wake.clear()
                await wake.wait()
                now = None
            if now is None:
                now = loop.time()
            c0 = perf()
            dt, outputs = engine.step(now)
            self.compute.add(perf() - c0)
            if not outputs and engine.last_step.get("idle"):
                if self.on_step is not None:
                    self.on_step()
                # Only KV transfers in flight (or nothing): wait for them or new work.
                wake.clear()
                if engine.has_work():
                    dt = max(dt, 1e-3)  # never spin, even if nothing could be scheduled
                    try:
                        async with asyncio.timeout(now + dt - loop.time()):
                            await wake.wait()
                    except TimeoutError:
                        pass
                now = None
                continue
            target = now + dt
            delay = target - loop.time()
            await asyncio.sleep(delay if delay > 0 else 0)
            t = loop.time()
            late = t - target
            if late < 0:
                late = 0.0
            self.overrun.add(late)
            if late > 1e-3:
                self.late_steps += 1
            for out in outputs:
                q = queues.get(out.req_id)
                if q is not None:
                    q.put_nowait(out)
            if self.on_step is not None:
                self.on_step()
            # Correct for overrun: the next step starts at the planned time, so small
            # wake-up delays do not accumulate into a slower emulated GPU; a large one
            # (> max_catchup_s) is accepted as lost time instead of bursting to catch up.
            now = target if late <= catchup else t


class RequestStream:
    """The outputs of one submitted request (see :meth:`AsyncEngineRunner.submit`).

    Async-iterate it for one :class:`RequestOutput` per step that produced a token;
    :meth:`ready` returns the outputs already delivered without waiting (lets a server
    coalesce several tokens into one write when it falls behind). Use it as a context
    manager (sync or async): leaving the block before the request finished aborts it.
    Cancelling a consumer blocked in ``__anext__`` aborts it too.
    """

    __slots__ = ("_runner", "req_id", "_q", "_done")

    def __init__(self, runner: AsyncEngineRunner, req_id: str, q: asyncio.Queue):
        self._runner = runner
        self.req_id = req_id
        self._q = q
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            out = await self._q.get()
        except BaseException:
            self.close()
            raise
        return self._take(out)

    def _take(self, out) -> RequestOutput:
        if isinstance(out, BaseException):
            self.close()
            raise out
        if out.finished:
            self._done = True
            self._runner._queues.pop(self.req_id, None)
        return out

    def ready(self) -> list[RequestOutput]:
        """Outputs already delivered (possibly none), without waiting."""
        out = []
        q = self._q
        while not self._done and not q.empty():
            out.append(self._take(q.get_nowait()))
        return out

    @property
    def finished(self) -> bool:
        return self._done

    def close(self) -> None:
        """Abort the request if it has not finished (idempotent)."""
        if not self._done:
            self._done = True
            self._runner._queues.pop(self.req_id, None)
            self._runner.engine.abort(self.req_id)

    async def aclose(self) -> None:
        self.close()

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()
