"""The simulated backend's spec: :class:`SimBackendConfig` (one ``--spec`` entry, one
fleet-file backend, one gateway ``simulate:`` section) and its :class:`FaultConfig`.

Pure data and validation (no sockets, no event loop, nothing beyond the standard
library and :mod:`loadtest.sim.profiles`), so that the gateway's config loader can
check a ``simulate:`` section with :func:`check_simulate` without starting anything.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from loadtest.sim.profiles import Profile, get_profile

ROLES = ("mixed", "prefill", "decode")


# --- configuration --------------------------------------------------------------------


@dataclass(slots=True)
class FaultConfig:
    """Faults injected into ``/v1/*completions`` requests (never into admin, metrics or
    health). Rates are probabilities per request, drawn independently in this order:
    ``stall_s`` (always, when > 0), then ``hang_rate``, ``error_rate``,
    ``rate_limit_rate``. Times in seconds.

    - ``stall_s``: wait this long before the first byte (before the status line).
    - ``hang_rate``: accept the request and never answer (until the client goes away).
    - ``error_rate`` / ``error_status``: answer with this HTTP status and an
      OpenAI-shaped error body.
    - ``rate_limit_rate`` / ``retry_after_s``: answer 429 with ``Retry-After``.
    - ``close_after_chunks``: close the connection after this many SSE chunks of a
      stream (no ``[DONE]``, truncated chunked body); a non-streamed request gets its
      connection closed with no answer once that many tokens were generated.
    - ``stall_after_chunks``: a stream goes silent after this many SSE chunks (the
      connection stays open, nothing more is sent until the client goes away; an engine
      hung mid-generation); ``close_after_chunks`` wins when both are set.
    - ``drip_s``: extra delay before every SSE chunk (a slow link); a non-streamed
      answer is delayed by ``drip_s`` per token.
    - ``crash_after_s`` / ``crash_down_s`` / ``crash_every_s``: crash (drop every
      connection, stop listening, lose the engine's state) ``crash_after_s`` after the
      faults are set, come back on the same port ``crash_down_s`` later with a cold
      engine, and repeat every ``crash_every_s`` if set.
    - ``kv_events_drop_rate``: probability that a KV-event batch is not sent on the PUB
      socket (it keeps its sequence number and stays in the replay buffer, as a
      batch lost on the way).
    - ``kv_events_stop``: the KV-event publisher hangs: batches queue up unsent and
      replay requests wait unanswered; clearing it sends the backlog in order and
      answers them (vLLM publishes and serves replay from one thread).
    - ``seed``: seed of the fault draws (reproducible runs).
    """

    stall_s: float = 0.0
    hang_rate: float = 0.0
    error_rate: float = 0.0
    error_status: int = 500
    rate_limit_rate: float = 0.0
    retry_after_s: float = 1.0
    close_after_chunks: int | None = None
    stall_after_chunks: int | None = None
    drip_s: float = 0.0
    crash_after_s: float | None = None
    crash_down_s: float = 1.0
    crash_every_s: float | None = None
    kv_events_drop_rate: float = 0.0
    kv_events_stop: bool = False
    seed: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> FaultConfig:
        """Validate ``d``; raises ValueError naming the bad field."""
        d = dict(d or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown fault field(s) {unknown}; known: {sorted(names)}")
        fc = cls(**d)
        for k in ("hang_rate", "error_rate", "rate_limit_rate", "kv_events_drop_rate"):
            v = getattr(fc, k)
            if not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise ValueError(f"faults.{k} must be a number in [0, 1], got {v!r}")
        for k in ("stall_s", "drip_s", "retry_after_s", "crash_down_s"):
            v = getattr(fc, k)
            if not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"faults.{k} must be a number >= 0, got {v!r}")
        for k in ("crash_after_s", "crash_every_s"):
            v = getattr(fc, k)
            if v is not None and (not isinstance(v, (int, float)) or v < 0):
                raise ValueError(f"faults.{k} must be null or a number >= 0, got {v!r}")
        if not isinstance(fc.kv_events_stop, bool):
            raise ValueError(f"faults.kv_events_stop must be true or false, got {fc.kv_events_stop!r}")
        if not isinstance(fc.error_status, int) or not 400 <= fc.error_status <= 599:
            raise ValueError(f"faults.error_status must be an HTTP error status, got {fc.error_status!r}")
        for k in ("close_after_chunks", "stall_after_chunks"):
            v = getattr(fc, k)
            if v is not None and (not isinstance(v, int) or v < 0):
                raise ValueError(f"faults.{k} must be null or an integer >= 0")
        return fc

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


KV_EVENT_ENCODINGS = ("map", "array")
BLOCK_HASH_FORMATS = ("int", "bytes")


@dataclass(slots=True)
class KVEventsConfig:
    """The backend's KV-cache event publisher (vLLM's ``--kv-events-config``; wire
    format in :mod:`loadtest.sim.kv_event_publisher`).

    - ``endpoint``: ZMQ address the PUB socket binds, ``tcp://host:port``; port ``*``
      (the default) picks a free one. vLLM's default is ``tcp://*:5557``.
    - ``replay_endpoint``: ZMQ address of the ROUTER replay socket (``*`` port: a free
      one); ``null`` for none (vLLM's default).
    - ``topic``: first frame of every message (vLLM's default ``""``).
    - ``buffer_steps``: batches kept for replay (vLLM's default 10000).
    - ``data_parallel_rank``: sent in every batch; a fixed port is offset by it, as
      vLLM's data-parallel ranks publish on port + rank.
    - ``encoding``: ``map`` (events as maps with a ``"type"`` tag: what vLLM 0.32
      sends) or ``array`` (tagged arrays ``["BlockStored", ...]`` of older engines).
    - ``block_hash``: ``int`` (unsigned 64-bit ints, vLLM's default) or ``bytes`` (8
      bytes, big-endian; vLLM sends its whole hash digest as bytes when
      ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``).
    - ``replay_topic_frame``: replay replies carry the topic frame before the seq, as
      vLLM 0.32 sends them (``true``), or not, as older engines (``false``).
    """

    endpoint: str = "tcp://127.0.0.1:*"
    replay_endpoint: str | None = "tcp://127.0.0.1:*"
    topic: str = ""
    buffer_steps: int = 10_000
    data_parallel_rank: int = 0
    encoding: str = "map"
    block_hash: str = "int"
    replay_topic_frame: bool = True

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVEventsConfig:
        """Validate ``d``; raises ValueError naming the bad field."""
        if not isinstance(d, dict):
            raise ValueError(f"`kv_events` must be a mapping of publisher fields, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown kv_events field(s) {unknown}; known: {sorted(names)}")
        kc = cls(**d)
        for k in ("endpoint", "replay_endpoint"):
            v = getattr(kc, k)
            if v is None and k == "replay_endpoint":
                continue
            if not isinstance(v, str) or not v.startswith("tcp://") or ":" not in v[len("tcp://"):]:
                raise ValueError(f"kv_events.{k} must be a ZMQ address tcp://host:port, got {v!r}")
        if not isinstance(kc.topic, str):
            raise ValueError(f"kv_events.topic must be a string, got {kc.topic!r}")
        for k, lo in (("buffer_steps", 1), ("data_parallel_rank", 0)):
            v = getattr(kc, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"kv_events.{k} must be an integer >= {lo}, got {v!r}")
        if not isinstance(kc.replay_topic_frame, bool):
            raise ValueError(f"kv_events.replay_topic_frame must be true or false, got {kc.replay_topic_frame!r}")
        if kc.encoding not in KV_EVENT_ENCODINGS:
            raise ValueError(f"kv_events.encoding must be one of {KV_EVENT_ENCODINGS}, got {kc.encoding!r}")
        if kc.block_hash not in BLOCK_HASH_FORMATS:
            raise ValueError(f"kv_events.block_hash must be one of {BLOCK_HASH_FORMATS}, got {kc.block_hash!r}")
        return kc

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(slots=True)
class LoraConfig:
    """LoRA adapters on a simulated backend (vLLM's ``--enable-lora`` options).

    - ``adapters``: adapter names registered at start (vLLM's ``--lora-modules``), all
      on the backend's first model; listed in ``/v1/models`` with ``parent``.
    - ``max_lora``: most distinct adapters in one batch (``--max-loras``); a request
      whose adapter finds no slot waits.
    - ``max_cpu_loras``: adapters whose weights stay in host memory (``--max-cpu-loras``,
      default ``max_lora``); a request for a registered adapter not there pays ``load_s``.
    - ``load_s``: emulated seconds to read one adapter's weights (the first request
      after registering or eviction, and ``POST /v1/load_lora_adapter``, pay it).
    - ``swap_s``: emulated seconds to copy an adapter into a GPU slot.
    - ``dynamic``: a request naming an unregistered adapter registers it and pays
      ``load_s`` (vLLM with a LoRA resolver plugin); ``false`` (vLLM's default): 404.
    """

    adapters: list[str] = field(default_factory=list)
    max_lora: int = 4
    max_cpu_loras: int | None = None
    load_s: float = 0.2
    swap_s: float = 0.002
    dynamic: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoraConfig:
        """Validate ``d``; raises ValueError naming the bad field."""
        if not isinstance(d, dict):
            raise ValueError(f"`lora` must be a mapping of LoRA fields, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown lora field(s) {unknown}; known: {sorted(names)}")
        lc = cls(**d)
        if not isinstance(lc.adapters, list) or not all(isinstance(a, str) and a for a in lc.adapters):
            raise ValueError("lora.adapters must be a list of adapter names")
        if not isinstance(lc.max_lora, int) or lc.max_lora < 1:
            raise ValueError("lora.max_lora must be an integer >= 1")
        if lc.max_cpu_loras is None:
            lc.max_cpu_loras = lc.max_lora
        if not isinstance(lc.max_cpu_loras, int) or lc.max_cpu_loras < lc.max_lora:
            raise ValueError("lora.max_cpu_loras must be an integer >= max_lora")
        for k in ("load_s", "swap_s"):
            v = getattr(lc, k)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise ValueError(f"lora.{k} must be a number >= 0")
        return lc


@dataclass(slots=True)
class SimBackendConfig:
    """One simulated backend (the ``--spec`` / fleet-file fields).

    - ``name``, ``models``: served model ids (the first is the ``model_name`` label).
    - ``profile``: a name from :data:`loadtest.sim.profiles.PROFILES`;
      ``profile_overrides``: Profile fields to change (e.g. ``{"num_gpu_blocks": 256}``).
    - ``speed``: run the emulated GPU this many times faster than real time.
    - ``role``: ``mixed`` | ``prefill`` | ``decode`` (default: the profile's role).
      ``prefill``/``mixed`` honour ``kv_transfer_params.do_remote_decode``,
      ``decode``/``mixed`` honour ``do_remote_prefill``; other flags are ignored.
    - ``eos_after``: natural output length in tokens when the request does not set
      ``ignore_eos``: an int, or ``[lo, hi]`` for a per-prompt deterministic length in
      that range; ``None`` (default) means generate up to ``max_tokens``.
    - ``max_tokens_default``: ``max_tokens`` when the request gives none (default: the
      rest of ``max_model_len``, as vLLM).
    - ``faults``: a :class:`FaultConfig` (or its dict).
    - ``kv_events``: a :class:`KVEventsConfig` (or its dict) to publish KV-cache
      events; ``None`` (default): none.
    - ``tokenizer``: a Hugging Face ``tokenizer.json`` (or a directory holding one):
      prompts are tokenized with it, so block boundaries and event token ids are a
      real model's; ``None`` (default): the emulator's tokenizer.
    - ``lora``: a :class:`LoraConfig` (or its dict) to serve LoRA adapters; ``None``
      (default): none.
    - ``host``, ``port``: where to listen (``port`` 0 picks a free port).
    """

    name: str
    models: list[str] = field(default_factory=lambda: ["demo-model"])
    profile: str = "demo"
    profile_overrides: dict[str, Any] = field(default_factory=dict)
    speed: float = 1.0
    role: str | None = None
    eos_after: int | list[int] | None = None
    max_tokens_default: int | None = None
    faults: FaultConfig | dict[str, Any] = field(default_factory=FaultConfig)
    kv_events: KVEventsConfig | dict[str, Any] | None = None
    tokenizer: str | None = None
    lora: LoraConfig | dict[str, Any] | None = None
    host: str = "127.0.0.1"
    port: int = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SimBackendConfig:
        """Validate one spec entry; raises ValueError naming the bad field."""
        if not isinstance(d, dict):
            raise ValueError(f"a backend spec must be an object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"backend {d.get('name')!r}: unknown field(s) {unknown}; known: {sorted(names)}")
        if "name" not in d:
            raise ValueError("a backend spec needs a `name`")
        cfg = cls(**d)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if isinstance(self.faults, dict):
            self.faults = FaultConfig.from_dict(self.faults)
        elif not isinstance(self.faults, FaultConfig):
            raise ValueError(f"backend {self.name!r}: `faults` must be a mapping of fault fields")
        if isinstance(self.kv_events, dict):
            try:
                self.kv_events = KVEventsConfig.from_dict(self.kv_events)
            except TypeError as e:
                raise ValueError(f"backend {self.name!r}: kv_events: {e}") from None
            except ValueError as e:
                raise ValueError(f"backend {self.name!r}: {e}") from None
        elif self.kv_events is not None and not isinstance(self.kv_events, KVEventsConfig):
            raise ValueError(f"backend {self.name!r}: `kv_events` must be a mapping of publisher fields or null")
        if isinstance(self.lora, dict):
            try:
                self.lora = LoraConfig.from_dict(self.lora)
            except (TypeError, ValueError) as e:
                raise ValueError(f"backend {self.name!r}: {e}") from None
        elif self.lora is not None and not isinstance(self.lora, LoraConfig):
            raise ValueError(f"backend {self.name!r}: `lora` must be a mapping of LoRA fields or null")
        if self.tokenizer is not None and not isinstance(self.tokenizer, str):
            raise ValueError(f"backend {self.name!r}: `tokenizer` must be a path to a tokenizer.json or null")
        if self.tokenizer is not None and not os.path.exists(self.tokenizer):
            raise ValueError(f"backend {self.name!r}: `tokenizer` {self.tokenizer!r} does not exist")
        if not isinstance(self.profile_overrides, dict):
            raise ValueError(f"backend {self.name!r}: `profile_overrides` must be a mapping of profile fields")
        if not self.models or not all(isinstance(m, str) for m in self.models):
            raise ValueError(f"backend {self.name!r}: `models` must be a non-empty list of strings")
        if not isinstance(self.speed, (int, float)) or self.speed <= 0:
            raise ValueError(f"backend {self.name!r}: `speed` must be > 0")
        if self.role is not None and self.role not in ROLES:
            raise ValueError(f"backend {self.name!r}: `role` must be one of {ROLES}")
        eos = self.eos_after
        if eos is not None and not (isinstance(eos, int) and eos >= 1) and not (
                isinstance(eos, list) and len(eos) == 2 and all(isinstance(x, int) and x >= 1 for x in eos)
                and eos[0] <= eos[1]):
            raise ValueError(f"backend {self.name!r}: `eos_after` must be null, an int >= 1 or [lo, hi]")
        self.build_profile()  # ValueError for an unknown profile or bad overrides

    def build_profile(self) -> Profile:
        try:
            return get_profile(self.profile, **self.profile_overrides)
        except KeyError as e:
            raise ValueError(f"backend {self.name!r}: {e.args[0]}") from None
        except TypeError as e:
            raise ValueError(f"backend {self.name!r}: bad profile_overrides: {e}") from None


# --- the gateway's `simulate:` sections -----------------------------------------------

# Set on the gateway's backend itself, which the simulated backend takes them from.
BACKEND_OWNED = ("name", "models")


def simulate_spec(name: str, models: list[str], fields: dict[str, Any]) -> dict[str, Any]:
    """The simulator's spec entry of the gateway backend ``name`` serving ``models``
    (its configured names; none: the simulator's default model, which a gateway
    backend with ``models: [auto]`` then discovers) with ``simulate:`` section ``fields``."""
    return {"name": name, **({"models": list(models)} if models else {}), **fields}


def check_simulate(name: str, models: list[str], fields: Any) -> SimBackendConfig:
    """Validate the ``simulate:`` section ``fields`` of the gateway backend ``name``
    serving ``models`` (see :func:`simulate_spec`), as the simulator will when it starts
    that backend; returns the backend's spec. Raises ValueError with the simulator's
    message naming the bad field."""
    if not isinstance(fields, dict):
        raise ValueError(f"must be a mapping of simulator fields, got {type(fields).__name__}")
    owned = [k for k in BACKEND_OWNED if k in fields]
    if owned:
        raise ValueError(f"{owned} belong to the backend itself, not to its `simulate:` section")
    try:
        return SimBackendConfig.from_dict(simulate_spec(name, models, fields))
    except TypeError as e:  # a value of the wrong shape, e.g. `faults: 3`
        raise ValueError(f"backend {name!r}: {e}") from None
