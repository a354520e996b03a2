"""The upstream sections: the backends (``backends[]``), their timeouts, retries, speed
hints, KV events and LoRA, health checks and the circuit breaker."""

from __future__ import annotations

from typing import Any

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from gateway.config.base import AUTO_MODELS, PositiveSeconds, Strict
from routing.core import (
    DEFAULT_BASE_BACKOFF_S,
    DEFAULT_FAILED_BACKEND_COOLDOWN_S,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_MAX_BACKOFF_S,
)


class Timeouts(Strict):
    """Timeouts of one upstream attempt, in seconds (``None`` disables one). A timeout
    that fires fails that attempt; the retry policy (:class:`Retries`) decides what
    comes next."""

    connect_s: PositiveSeconds | None = Field(
        5.0, description="TCP connect (and TLS handshake) to a backend; `null`: no limit.")
    ttft_s: PositiveSeconds | None = Field(
        120.0, description="From the start of the attempt to the first response body byte (time to first "
        "token for a stream); `null`: no limit.")
    idle_s: PositiveSeconds | None = Field(
        60.0, description="Longest gap between two body chunks of a response (an inter-token stall); "
        "`null`: no limit.")
    total_s: PositiveSeconds | None = Field(
        900.0, description="The whole attempt, from its start to the last byte; `null`: no limit.")


class TimeoutOverrides(Strict):
    """Per-backend overrides of :class:`Timeouts`; unset fields keep the global value."""

    connect_s: PositiveSeconds | None = Field(
        None, description="This backend's `timeouts.connect_s`; unset: the global value.")
    ttft_s: PositiveSeconds | None = Field(
        None, description="This backend's `timeouts.ttft_s`; unset: the global value.")
    idle_s: PositiveSeconds | None = Field(
        None, description="This backend's `timeouts.idle_s`; unset: the global value.")
    total_s: PositiveSeconds | None = Field(
        None, description="This backend's `timeouts.total_s`; unset: the global value.")


class Retries(Strict):
    """Retry policy: exponential backoff with full jitter.

    Attempt ``n`` (1-based retry count) sleeps ``uniform(0, min(max_backoff_s,
    base_backoff_s * 2**(n-1)))`` ("full jitter", AWS Architecture Blog, *Exponential
    Backoff And Jitter*, 2015), or the backend's ``Retry-After`` when it is longer and the
    retry must return to the same backend. Retries happen only for connect errors,
    429, 502/503/504 and timeouts (:mod:`routing.retry`: one set for every retry loop),
    only while no byte has reached the client, and stop after ``max_attempts`` attempts
    in all or once ``budget_s`` seconds have passed since the first attempt.
    """

    max_attempts: int = Field(DEFAULT_MAX_ATTEMPTS, ge=1, le=20, description="Attempts in all, the first one included.")
    base_backoff_s: float = Field(
        DEFAULT_BASE_BACKOFF_S, ge=0,
        description="Backoff before retry *n*: `uniform(0, min(max_backoff_s, base_backoff_s * "
        "2^(n-1)))` (full jitter).")
    max_backoff_s: float = Field(DEFAULT_MAX_BACKOFF_S, ge=0, description="Cap of the backoff before one retry.")
    budget_s: float = Field(
        30.0, gt=0, description="No retry starts later than this after the first attempt started.")
    max_retry_after_s: float = Field(
        10.0, ge=0, description="Longest `Retry-After` a request waits for when it can only go back to the "
        "backend that sent it (the backend is kept out of routing for as long as it asked either way).")
    failed_backend_cooldown_s: float = Field(
        DEFAULT_FAILED_BACKEND_COOLDOWN_S, ge=0,
        description="A backend that refused a connection or did not accept it within `connect_s` is skipped by every "
        "request this long.")


class SpeedHints(Strict):
    """Optional seeds for the load model (learned online later)."""

    prefill_tokens_per_s: float | None = Field(
        None, gt=0, description="Expected prefill rate in tokens/s; the load model learns it from observed "
        "TTFTs anyway.")
    decode_tokens_per_s: float | None = Field(
        None, gt=0, description="Expected single-stream decode rate in tokens/s; learned from observed "
        "inter-token latency anyway.")
    kv_capacity_tokens: int | None = Field(
        None, gt=0, description="KV-cache capacity in tokens (bounds the prefix index's share of this "
        "backend); learned from the engine's `/metrics` when it exports it.")
    lora_load_s: float | None = Field(
        None, ge=0, description="Seconds to make a LoRA adapter that is not at work on this backend ready there "
        "(read its weights, copy them into a GPU slot): what routing charges a request for sending its adapter "
        "somewhere new; unset: 0.1.")


class KVEvents(Strict):
    """Where a backend's engine publishes its KV-cache events (vLLM's
    ``--kv-events-config``; SGLang, LMCache and TensorRT-LLM publish the same
    format). The gateway subscribes to them itself: its prefix index then knows what
    the engine holds (``evidence=precise`` in ``x-turbo-route``) for requests whose
    token ids are known; see docs/architecture.md, "The precise prefix index"."""

    endpoint: str = Field(
        description="The engine's ZMQ PUB address as the gateway reaches it, e.g. `tcp://10.0.0.11:5557` "
        "(the engine binds `tcp://*:5557`; give its host here).")
    replay_endpoint: str | None = Field(
        None, description="The engine's replay (ROUTER) address, e.g. `tcp://10.0.0.11:5558`: a gap in the "
        "sequence numbers (a dropped message, a late start) is filled from it. Unset: a gap drops this "
        "backend's precise entries.")
    topic: str = Field("", description="The engine's `topic` (a prefix of the first frame to subscribe to).")
    block_size: int = Field(
        16, ge=1, le=4096, description="The engine's KV block size in tokens (vLLM `--block-size`; 16 by "
        "default): the blocks its events describe.")
    data_parallel_size: int = Field(
        1, ge=1, le=256, description="Data-parallel ranks of the engine: rank `r` publishes on the endpoint's "
        "port + `r` (and replays on the replay port + `r`).")
    base_model: str | None = Field(
        None, description="The model name the engine's blocks without a LoRA adapter belong to; unset: the "
        "backend's first `models` entry. A LoRA adapter's blocks belong to the adapter's name.")
    replay_timeout_s: float = Field(
        1.0, gt=0, description="A replay that sends nothing for this long has failed.")

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _check_endpoint(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not v.startswith(("tcp://", "ipc://")):
            raise ValueError("must be a ZMQ address starting with tcp:// or ipc://")
        if "*" in v:
            raise ValueError("give the engine's host, not the `*` it binds to")
        if v.startswith("tcp://"):
            host, _, port = v[len("tcp://"):].rpartition(":")
            if not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError("a tcp:// address needs a port, e.g. tcp://10.0.0.11:5557")
            if not host or any(c.isspace() for c in host):
                raise ValueError("a tcp:// address needs a host without spaces, e.g. tcp://10.0.0.11:5557")
        elif len(v) == len("ipc://") or any(c.isspace() for c in v):
            raise ValueError("an ipc:// address needs a path without spaces, e.g. ipc:///run/vllm/kv-events")
        return v

    @model_validator(mode="after")
    def _ranks_need_ports(self) -> KVEvents:
        if self.data_parallel_size > 1:
            for v in (self.endpoint, self.replay_endpoint):
                if v is not None and not v.startswith("tcp://"):
                    raise ValueError("data_parallel_size > 1 needs tcp:// addresses (rank r publishes on port + r)")
                if v is not None and int(v.rpartition(":")[2]) + self.data_parallel_size > 65536:
                    raise ValueError("port + data_parallel_size passes 65535")
        return self


class BackendLora(Strict):
    """LoRA adapters on one backend."""

    dynamic: bool = Field(
        False, description="Load the adapters of `models.<name>.lora` on this backend on demand, through vLLM's "
        "`POST /v1/load_lora_adapter`, when routing chooses it for one it does not list.")
    load_timeout_s: PositiveSeconds = Field(60.0, description="Longest wait for one adapter load.")


class Backend(Strict):
    """One upstream OpenAI-compatible server.

    ``url`` is the server's base URL without ``/v1`` (e.g. ``http://10.0.0.5:8000``);
    request paths (``/v1/chat/completions``...) are appended. ``api_key_env`` names an
    environment variable holding the key sent to this backend as ``Authorization:
    Bearer``. Exactly one of ``url`` and ``simulate`` must be set: ``simulate`` holds
    the options of a demo backend that the gateway starts itself with
    ``python -m loadtest.sim``, which checks the section by its own rules when it starts
    (see ``loadtest/README.md``): the gateway imports nothing from ``loadtest``.
    """

    name: str = Field(
        min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$",
        description="Unique name of the backend (letters, digits, `_ . : -`): in metrics, logs, the "
        "`x-turbo-backend` header and the admin endpoints.")
    url: str | None = Field(
        None, description="The server's base URL without `/v1`, e.g. `http://10.0.0.5:8000` (`http://` or "
        "`https://`); request paths are appended. Set exactly one of `url` and `simulate`.")
    models: list[str] = Field(
        min_length=1, description="Model names the backend serves (the `model` field clients send). `auto` "
        "(alone, or as one entry of the list) also serves whatever the backend's own `GET /v1/models` lists, "
        "read on every health-check round: base models and LoRA adapters (vLLM and SGLang name an adapter's "
        "base model in `parent`), with each model's `max_model_len`. A model or adapter loaded on the backend "
        "later becomes routable there without a reload; one unloaded stops being routed there.")
    pool: str = Field("mixed", description="The name of a pool from `pools`.")
    apis: list[str] | None = Field(
        None, description="The APIs this backend serves, by name (`chat`, `completions`, `responses`, "
        "`input_tokens`, `messages`, `count_tokens`, `embeddings`, `rerank`, `score`, `tokenize`, `detokenize`); "
        "unset: every one, until it answers an API's path "
        "with a 404 that is not about the model, or with llama.cpp's 501 for an API it was not started for "
        "(it is then not sent that API again, its breaker untouched).")
    weight: float = Field(
        1.0, gt=0, description="Relative capacity, for the load-aware policies (a weight-2 backend takes "
        "about twice the work of a weight-1 one).")
    api_key_env: str | None = Field(
        None, description="Environment variable holding the key sent to this backend as `Authorization: "
        "Bearer`; it must be set when the config loads. The caller's own key is never forwarded.")
    hints: SpeedHints = Field(
        SpeedHints(), description="Seeds for the load model; every one is learned online anyway.")
    timeouts: TimeoutOverrides = Field(
        TimeoutOverrides(), description="Per-backend overrides of any `timeouts` field.")
    health_path: str | None = Field(None, description="This backend's health-check path; unset: `health.path`.")
    kv_events: KVEvents | None = Field(
        None, description="Subscribe to this backend's KV-cache events (ZMQ, vLLM format) for a precise prefix "
        "index. Unset: its prefix entries stay approximate.")
    lora: BackendLora = Field(BackendLora(), description="LoRA adapters loaded on demand.")
    return_token_ids: bool = Field(
        False, description="The engine streams the token ids it generates when a request asks `return_token_ids: "
        "true` (vLLM's OpenAI server does): a streamed request that may be continued by token ids (its model has a "
        "`tokenizer`; docs/failure-contract.md, \"When a stream is continued\") asks it of this backend, so a "
        "continuation after a failure here resends the ids generated instead of re-tokenizing the text. "
        "The client's chunks then carry the engine's `token_ids` (and its first one `prompt_token_ids`), which "
        "the gateway does not strip. Off: not asked; leave it off for an engine without the field (it may refuse "
        "such requests, or ignore the field).")
    simulate: dict[str, Any] | None = Field(
        None, description="Instead of `url`: a demo backend that the gateway starts itself on a free loopback "
        "port (`python -m loadtest.sim`). Takes the simulator's backend spec fields: `profile` (`demo`, "
        "`h100-llama3-8b`, `a100-llama3-8b`, ...), `speed` (emulated GPU time runs this many times faster "
        "than real time), `eos_after` (natural answer length in tokens, or `[lo, hi]`), `role`, "
        "`max_tokens_default`, `profile_overrides`, `faults`, `kv_events`, `tokenizer`, `lora` (see "
        "`loadtest/README.md`, \"Backend spec fields\"). Checked by the simulator's own rules when the "
        "gateway starts it: a bad field is a config error naming this section. It serves the backend's `models`; with "
        "`models: [auto]` alone, the simulator's default model `demo-model` (and its `lora.adapters`), which "
        "`auto` discovers. With `kv_events` the gateway subscribes to the "
        "backend's KV-cache events by itself (the addresses, block size and base model from its "
        "`GET /kv_event_sources`) unless this backend's own `kv_events` is set; with `tokenizer` its models get that "
        "tokenizer in `models` unless they name one. Adding or changing one needs a restart.")
    @field_validator("models", mode="before")
    @classmethod
    def _auto_alone(cls, v: Any) -> Any:
        return [AUTO_MODELS] if v == AUTO_MODELS else v

    @field_validator("models")
    @classmethod
    def _check_models(cls, v: list[str]) -> list[str]:
        if any(not m for m in v):
            raise ValueError("a model name must not be empty")
        dup = sorted({m for m in v if v.count(m) > 1})
        if dup:
            raise ValueError(f"model {dup[0]!r} is listed twice")
        return v

    @property
    def discover(self) -> bool:
        """Whether the backend's own ``/v1/models`` adds to its models (``auto``)."""
        return AUTO_MODELS in self.models

    @property
    def static_models(self) -> list[str]:
        """The configured model names, ``auto`` left out."""
        return [m for m in self.models if m != AUTO_MODELS]

    @field_validator("apis")
    @classmethod
    def _known_apis(cls, v: list[str] | None) -> list[str] | None:
        from gateway.apis.registry import BY_NAME

        unknown = [a for a in v or () if a not in BY_NAME]
        if unknown:
            raise ValueError(f"unknown API {unknown[0]!r}; the APIs are {', '.join(BY_NAME)}")
        return v

    @field_validator("url")
    @classmethod
    def _check_url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return v.rstrip("/")

    def simulate_entry(self) -> dict[str, Any]:
        """What the demo fleet's child (``python -m loadtest.sim --gateway-backends``)
        is told of this ``simulate:`` backend, and validates: ``{name, models, simulate}``
        (its configured models: none with ``models: [auto]`` alone, for the
        simulator's default model, discovered)."""
        assert self.simulate is not None
        return {"name": self.name, "models": self.static_models, "simulate": self.simulate}

    @property
    def simulated_kv_events(self) -> bool:
        """Whether the gateway wires this backend's KV events itself: a ``simulate:``
        section that publishes them, and no ``kv_events`` of the backend's own."""
        return self.simulate is not None and self.simulate.get("kv_events") is not None and self.kv_events is None

    def simulated_kv_source(self, endpoint: str, replay_endpoint: str | None, topic: str, block_size: int,
                            base_model: str) -> KVEvents:
        """The ``kv_events`` of this simulated backend, from what its ``GET
        /kv_event_sources`` gives: the addresses, the topic, its profile's block size
        (tokens) and the model its blocks without a LoRA adapter belong to."""
        return KVEvents(endpoint=endpoint, replay_endpoint=replay_endpoint, topic=topic, block_size=block_size,
                        base_model=base_model)

    @model_validator(mode="after")
    def _kv_events_base_model(self) -> Backend:
        if self.kv_events is not None and self.kv_events.base_model is None and not self.static_models:
            raise ValueError("kv_events.base_model must be set when `models` is only `auto` (the blocks without "
                             "a LoRA adapter are keyed under it)")
        return self

    @model_validator(mode="after")
    def _url_or_simulate(self) -> Backend:
        if (self.url is None) == (self.simulate is None):
            raise ValueError("set exactly one of `url` (a real server) or `simulate` (a demo backend)")
        return self


class HealthChecks(Strict):
    """Active health checks: ``GET {url}{path}`` of every backend, periodically; a
    probe fails on a non-2xx answer or none within ``timeout_s``."""

    interval_s: float = Field(5.0, gt=0, description="Time between two probes of a backend.")
    timeout_s: float = Field(2.0, gt=0, description="A probe with no answer within this long fails.")
    path: str = Field(
        "/health", description="Probe path (vLLM, SGLang, TGI and llama.cpp all serve `/health`); "
        "`backends[].health_path` overrides it per backend.")
    unhealthy_threshold: int = Field(
        2, ge=1, description="Consecutive failed probes before a backend is marked down (out of routing).")
    healthy_threshold: int = Field(
        1, ge=1, description="Consecutive passed probes before a down backend takes traffic again.")


class Breaker(Strict):
    """Passive outlier detection, one circuit breaker per backend: it opens after
    ``failure_threshold`` consecutive failed attempts (connect errors, timeouts, 5xx,
    streams cut; not 4xx or 429), keeps the backend out of routing for ``open_s``, then
    lets one probe request through (half-open) and closes after
    ``success_threshold`` successes. ``failure_threshold: 0`` disables it."""

    failure_threshold: int = Field(
        5, ge=0, description="Consecutive failed attempts (connect errors, timeouts, 5xx, cut streams; not "
        "4xx or 429) that open a backend's circuit breaker (0: no breaker).")
    open_s: float = Field(
        10.0, gt=0, description="An open breaker keeps the backend out of routing this long, then lets one "
        "probe request through (half-open).")
    success_threshold: int = Field(1, ge=1, description="Successful probe requests that close the breaker again.")
