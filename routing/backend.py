"""One backend: its static description from the config and its live state.

:class:`BackendSpec` is what the config says of a backend; :class:`BackendState` is
what this gateway process knows of it now (in-flight requests, token-level load and
learned speeds, health, circuit breaker, the models and LoRA adapters its own
``/v1/models`` lists). :class:`ServedModel` and :class:`LoraActivity` are what the
backend reports of itself. The fleet (:mod:`routing.fleet`) holds one state per
configured backend; policies and LoRA placement (:mod:`routing.lora`) read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from routing.breaker import CircuitBreaker
from routing.load import BackendLoad


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """The static description of one backend, taken from the config.

    ``weight`` is a relative capacity (unitless, > 0) used by load-aware policies to
    normalise load; ``pool`` names the pool the backend belongs to. A backend that
    publishes KV-cache events has ``kv_block_size`` (its engine's block size in tokens)
    and ``kv_base_model`` (the model name its blocks without a LoRA adapter are keyed
    under, see :mod:`routing.kv_event_decoding`).
    """

    name: str
    models: frozenset[str]
    pool: str = "mixed"
    weight: float = 1.0
    role: str = "mixed"  # the pool's role: mixed | prefill | decode
    prefill_tokens_per_s: float | None = None  # speed hints (seeds of the load model)
    decode_tokens_per_s: float | None = None
    kv_capacity_tokens: int | None = None
    kv_block_size: int | None = None
    kv_base_model: str = ""
    discover: bool = False  # also serve what the backend's own ``/v1/models`` lists
    lora_load_s: float | None = None  # seconds to make a LoRA adapter ready here (a hint)
    loadable: tuple[tuple[str, str], ...] = ()  # (adapter, base model): LoRA adapters it may load on demand

    @property
    def reads_models(self) -> bool:
        """Whether the backend's ``/v1/models`` is read: it adds models (``discover``)
        or says which on-demand adapters are loaded."""
        return self.discover or bool(self.loadable)


# The most LoRA adapters a backend is remembered to have been sent (its host-memory cache
# is assumed this large when its ``max_lora`` is not known: vLLM's ``--max-cpu-loras``
# defaults to ``--max-loras``, whose own default is 1, so this errs large).
RECENT_ADAPTERS_MAX = 8


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One entry of a backend's own ``/v1/models``: the model (or LoRA adapter) name,
    the base model an adapter applies to (``parent``, vLLM's and SGLang's field;
    ``None`` for a base model) and the longest prompt plus output it takes in tokens
    (``max_model_len``; ``None`` when the engine does not say; an adapter inherits its
    parent's)."""

    name: str
    parent: str | None = None
    max_model_len: int | None = None


@dataclass(frozen=True, slots=True)
class LoraActivity:
    """A backend's LoRA adapters at work, from vLLM's ``vllm:lora_requests_info``:
    adapters of its running and waiting requests, and ``max_lora``, the most adapters
    one batch may hold (a request whose adapter is not in the batch waits for a slot
    when the batch already holds ``max_lora``). ``at``: monotonic time of the scrape (s)."""

    running: frozenset[str] = frozenset()
    waiting: frozenset[str] = frozenset()
    max_lora: int | None = None
    at: float = 0.0


@dataclass(slots=True)
class BackendState:
    """Live state of one backend as this gateway process sees it.

    - ``in_flight``: requests dispatched and not yet settled (count).
    - ``cooldown_until``: monotonic time in seconds before which the backend should not
      be chosen (set after a 429 with ``Retry-After`` or a connect failure).
    - ``healthy``: result of the last active health check (``True`` until one fails).
    - ``remote_in_flight``: the same count from the other replicas (shared store).
    - ``draining``: set by an operator; the backend takes no new requests and finishes
      its own.
    - ``breaker``: passive outlier detection (:mod:`routing.breaker`).
    - ``discovered``: what the backend's ``/v1/models`` listed last, by name (served
      besides ``spec.models`` when ``spec.discover``; ``None`` until first read).
    - ``lora``: its LoRA adapters at work, from its metrics (``None``: not known).
    - ``adapter_streams``: this process's in-flight requests here, per LoRA adapter.
    - ``recent_adapters``: the LoRA adapters this process sent here, least recently
      sent first (bounded by :data:`RECENT_ADAPTERS_MAX`).
    """

    spec: BackendSpec
    in_flight: int = 0
    dispatched_total: int = 0
    cooldown_until: float = 0.0
    healthy: bool = True
    remote_in_flight: int = 0  # other gateway replicas' in-flight requests (shared store)
    load: BackendLoad = field(default=None)  # type: ignore[assignment]  # set in __post_init__
    draining: bool = False
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    name: str = field(init=False, default="")  # spec.name, read on every routing decision
    discovered: dict[str, ServedModel] | None = None
    lora: LoraActivity | None = None
    adapter_streams: dict[str, int] = field(default_factory=dict)
    recent_adapters: dict[str, None] = field(default_factory=dict)

    def ready_at(self, now: float) -> float:
        """Monotonic time from which the backend may take a new request (``<= now``:
        it may now): the later of its cooldown and its circuit breaker."""
        b = self.breaker.ready_at(now) if self.breaker.state != "closed" else 0.0
        return b if b > self.cooldown_until else self.cooldown_until

    def __post_init__(self) -> None:
        self.name = self.spec.name
        if self.load is None:
            self.load = BackendLoad(prefill_tokens_per_s=self.spec.prefill_tokens_per_s,
                                    decode_tokens_per_s=self.spec.decode_tokens_per_s,
                                    kv_capacity_tokens=self.spec.kv_capacity_tokens,
                                    lora_load_s=self.spec.lora_load_s)

    def models(self) -> frozenset[str]:
        """The model names this backend serves: its configured ones, what its
        ``/v1/models`` listed when ``spec.discover`` is set, and the adapters it may
        load on demand (``spec.loadable``) whose base model it serves."""
        spec = self.spec
        served = spec.models | self.discovered.keys() if spec.discover and self.discovered else spec.models
        if spec.loadable:
            served = served | {a for a, base in spec.loadable if base in served}
        return served

    def served(self, model: str) -> ServedModel | None:
        """What this backend's ``/v1/models`` said of ``model`` (``None``: not listed)."""
        return self.discovered.get(model) if self.discovered else None

    def adapter_base(self, model: str) -> str | None:
        """The base model of ``model`` on this backend when it is a LoRA adapter
        (listed with a ``parent``, or one it may load on demand)."""
        m = self.served(model)
        if m is not None and m.parent is not None:
            return m.parent
        for a, base in self.spec.loadable:
            if a == model:
                return base
        return None

    def needs_load(self, model: str) -> bool:
        """``model`` is an adapter this backend may load on demand and does not list."""
        loadable = self.spec.loadable
        return bool(loadable) and self.served(model) is None and any(a == model for a, _ in loadable)

    def max_model_len(self, model: str) -> int | None:
        """The context length in tokens of ``model`` here (an adapter's is its
        base model's), or ``None`` when the backend did not report one."""
        m = self.served(model)
        if m is not None and m.max_model_len is not None:
            return m.max_model_len
        base = self.adapter_base(model)
        p = self.served(base) if base is not None else None
        return p.max_model_len if p is not None else None

    def active_adapters(self, now: float) -> tuple[set[str], int | None]:
        """(the LoRA adapters at work here: this process's in-flight ones and, while
        the engine's metrics are fresh, those of its running and waiting requests;
        its ``max_lora`` when known) at monotonic time ``now`` (s)."""
        active = {a for a, n in self.adapter_streams.items() if n > 0}
        lora = self.lora
        if lora is None or now - lora.at > self.load.metrics_max_age_s:
            return active, None
        return active | lora.running | lora.waiting, lora.max_lora

    def adapter_resident(self, adapter: str, active: set[str], max_lora: int | None) -> bool:
        """Whether ``adapter``'s weights are probably still in this backend's memory:
        it is at work (``active``), or among the last ``max_lora`` distinct adapters
        this process sent here (vLLM keeps ``max_cpu_loras`` adapters, by default
        ``max_loras``, in an LRU cache; :data:`RECENT_ADAPTERS_MAX` when unknown)."""
        if adapter in active:
            return True
        recent = self.recent_adapters
        if adapter not in recent:
            return False
        keep = max_lora or RECENT_ADAPTERS_MAX
        return len(recent) <= keep or adapter in list(recent)[-keep:]

    def sent_adapter(self, adapter: str) -> None:
        """This process sent a request for ``adapter`` here (most recent last)."""
        recent = self.recent_adapters
        recent.pop(adapter, None)
        recent[adapter] = None
        if len(recent) > RECENT_ADAPTERS_MAX:
            del recent[next(iter(recent))]

    @property
    def requests(self) -> int:
        """In-flight requests on this backend from every gateway replica that shares
        state with this one (just this process's with the in-process store)."""
        return self.in_flight + self.remote_in_flight
