"""``backends.yaml``: the gateway's whole configuration, validated by pydantic.

:func:`load_config` is the only entry point; it raises :class:`ConfigError` with one
human-readable message naming the file and the offending field.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gateway.config_errors import describe, explain
from routing.core import (
    DEFAULT_BASE_BACKOFF_S,
    DEFAULT_FAILED_BACKEND_COOLDOWN_S,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_MAX_BACKOFF_S,
    DEFAULT_TOKENIZER_CACHE_TOKENS,
    POLICIES,
    TokenizerError,
    load_tokenizer,
)

AUTO_MODELS = "auto"  # `backends[].models` entry: also serve what the backend's `/v1/models` lists

PositiveSeconds = Annotated[float, Field(gt=0)]


class ConfigError(Exception):
    """The config file is missing, unreadable or invalid. The message names the file
    and the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Timeouts(_Strict):
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


class TimeoutOverrides(_Strict):
    """Per-backend overrides of :class:`Timeouts`; unset fields keep the global value."""

    connect_s: PositiveSeconds | None = Field(
        None, description="This backend's `timeouts.connect_s`; unset: the global value.")
    ttft_s: PositiveSeconds | None = Field(
        None, description="This backend's `timeouts.ttft_s`; unset: the global value.")
    idle_s: PositiveSeconds | None = Field(
        None, description="This backend's `timeouts.idle_s`; unset: the global value.")
    total_s: PositiveSeconds | None = Field(
        None, description="This backend's `timeouts.total_s`; unset: the global value.")


class Retries(_Strict):
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


class SpeedHints(_Strict):
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


class KVEvents(_Strict):
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


class BackendLora(_Strict):
    """LoRA adapters on one backend."""

    dynamic: bool = Field(
        False, description="Load the adapters of `models.<name>.lora` on this backend on demand, through vLLM's "
        "`POST /v1/load_lora_adapter`, when routing chooses it for one it does not list.")
    load_timeout_s: PositiveSeconds = Field(60.0, description="Longest wait for one adapter load.")


class Backend(_Strict):
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
        if self.api_key_env is not None and self.api_key_env not in os.environ:
            raise ValueError(f"api_key_env names the environment variable {self.api_key_env!r}, which is not set")
        return self


class HealthChecks(_Strict):
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


class Pool(_Strict):
    """A named group of backends with a role (``mixed``, ``prefill`` or ``decode``)."""

    name: str = Field(description="The pool's name, as `backends[].pool` and `routing.canaries[]` give it.")
    role: Literal["mixed", "prefill", "decode"] = Field(
        "mixed", description="`mixed` serves whole requests; `prefill` takes long uncached prompts (the "
        "prefill leg when a `decode` pool exists too); `decode` takes the decode leg of a disaggregated "
        "request.")


class EndpointPicker(_Strict):
    """The gateway as the endpoint picker (EPP) of the Kubernetes Gateway API Inference
    Extension: Envoy's ``ext_proc`` filter asks it, over gRPC, which backend takes each
    request (:mod:`gateway.epp.picker`; protocol: ``docs/proposals/004-endpoint-picker-protocol``
    in kubernetes-sigs/gateway-api-inference-extension)."""

    enabled: bool = Field(False, description="Serve the ext_proc gRPC API; `--epp` sets it.")
    host: str | None = Field(None, description="gRPC listen address (default: `listen.host`).")
    port: int = Field(9002, ge=0, le=65535, description="gRPC listen port; `--grpc-port` overrides it.")
    response_body: bool = Field(
        True, description="Read each response's body (Envoy sends every chunk over gRPC): the first "
        "token's time and the final `usage` teach the load model as behind the gateway's own data "
        "plane. `false`: one gRPC message per response instead of one per chunk, and the load model "
        "learns only from response status, stream end and the engines' scraped metrics (no TTFT, ITL "
        "or token counts from these requests; see docs/endpoint-picker.md).")
    fallback_endpoints: int = Field(
        2, ge=0, le=16, description="Endpoints listed after the chosen one, soonest estimated TTFT first, "
        "for Envoy to retry on when the chosen one fails before answering.")
    pass_through_paths: list[str] = Field(
        [], description="Paths besides the ones the picker serves (the completions, `GET /v1/models`, "
        "`/health`, `/ready`) that Envoy may pass on to a backend, e.g. `/tokenize`: each request is still "
        "authenticated, counted against its key's request rate and held to `limits.engine_fields`, and "
        "goes to the ready backend with the fewest requests in flight with the backend's own key. Every "
        "other path is refused with 404 `unknown_route`. Paths are matched after normalisation "
        "(percent-decoding, `//`, a trailing `/`), so give them in that form.")

    @field_validator("pass_through_paths")
    @classmethod
    def _canonical_paths(cls, v: list[str]) -> list[str]:
        from gateway.paths import canonical_path

        for p in v:
            if canonical_path(p) != p or p == "/":
                raise ValueError(f"{p!r} is not a normalised path (give it as {canonical_path(p)!r})"
                                 if p != "/" else "'/' would pass every path on")
        return v


class Listen(_Strict):
    """Where the gateway listens, and on which server protocol."""

    host: str = Field("127.0.0.1", description="Listen address; `--host` overrides it.")
    port: int = Field(8080, ge=0, le=65535, description="Listen port (0: any free port); `--port` overrides it.")
    fast_path: bool = Field(
        True, description="Serve plain `POST /v1/chat/completions` and `/v1/completions` on the lean "
        "HTTP/1.1 data-plane protocol; every other request (another path, a body coding, `Expect`, "
        "HTTP/1.0, an unusual head) is handed to aiohttp's server unchanged. `false`: aiohttp serves "
        "everything.")
    epp: EndpointPicker = Field(
        EndpointPicker(), description="Also serve as the endpoint picker behind Envoy (gRPC ext_proc); "
        "`/metrics` and the admin API stay on HTTP.")
    head_timeout_s: PositiveSeconds = Field(
        10.0, description="A request head (request line and headers) must arrive whole within this long of "
        "its first byte (of the connection's opening, for its first request); else the connection is "
        "closed. Both server stacks.")
    body_timeout_s: PositiveSeconds = Field(
        10.0, description="A request body gets this long, plus its length at `body_min_bytes_per_s`, to "
        "arrive whole once its head did; else the connection is closed. Both server stacks.")
    body_min_bytes_per_s: int = Field(
        16384, gt=0, description="The slowest body upload accepted on average (see `body_timeout_s`): at the "
        "default, a 1 MiB body gets 10 + 64 s.")
    keepalive_timeout_s: PositiveSeconds = Field(
        75.0, description="An idle keep-alive connection (no request in flight or arriving) is closed after "
        "this long. Both server stacks.")
    max_connections: int = Field(
        8192, ge=1, description="Client connections this process holds open at once (also bounded by 3/4 of "
        "its open-file limit). A connection accepted past it closes the one idle longest (no request in "
        "flight), or itself when every one is busy, so trickling clients cannot stop accepting.")
    max_connections_per_address: int = Field(
        1024, ge=1, description="Client connections one client IP address holds open at once in this process; "
        "past it the same rule as `max_connections`, among that address's connections. Behind a proxy or "
        "NAT that shares one address, raise it to `max_connections`.")


class CanarySplit(_Strict):
    """Serve ``model`` from ``stable_pool`` and, for a ``canary_weight`` fraction of its
    requests (0 to 1, e.g. 0.05), from ``canary_pool``; a canary request that fails
    before its first byte is retried on the stable pool."""

    model: str = Field(description="The model whose requests are split.")
    stable_pool: str = Field(
        description="Pool serving the model's other requests, and canary requests that failed before "
        "their first byte.")
    canary_pool: str = Field(description="Pool receiving the canary share.")
    canary_weight: float = Field(
        0.05, ge=0, le=1, description="Fraction of the model's requests sent to `canary_pool` (0 to 1). "
        "Compare the pools with `turbo_gateway_pool_requests_total{pool,status}` and "
        "`turbo_gateway_pool_ttft_seconds{pool}`.")


FallbackTrigger = Literal["unavailable", "timeout", "first_token_timeout", "context_length"]


class Fallback(_Strict):
    """One fallback of a model: the model to try next, and the failures that send a
    request there (only before its first byte reached the client)."""

    model: str = Field(description="The model to try next; a backend must serve it.")
    on: list[FallbackTrigger] = Field(
        ["unavailable", "timeout", "first_token_timeout"], min_length=1,
        description="The failures that trigger it: `unavailable` (no backend could take the request, or every "
        "attempt failed to connect, was cut or answered 429/5xx), `timeout` (connect or total timeout), "
        "`first_token_timeout` (no first byte within `timeouts.ttft_s`), `context_length` (the prompt is longer "
        "than the model's context: a backend answered `context_length_exceeded`).")


class Routing(_Strict):
    """How a backend is chosen: the policy, the prefix index, pools, canaries and
    model fallbacks."""

    policy: str = Field(
        "estimated_ttft", description="The routing policy, one of: " + ", ".join(f"`{p}`" for p in sorted(POLICIES))
        + ". `estimated_ttft` sends each request where its first token is estimated to come soonest; the "
        "others are baselines (see docs/architecture.md, \"The routing model\").")
    block_tokens: int = Field(
        64, ge=1, le=65536, description="Prefix-index block size in tokens (a block is cut every "
        "`4 * block_tokens` bytes of canonical prompt text). Changing it needs a restart.")
    prefix_ttl_s: float = Field(
        600.0, gt=0, description="An indexed prefix block unused this long counts as evicted. Changing it "
        "needs a restart.")
    prefix_index_max_blocks: int = Field(
        2_000_000, ge=1000, description="Memory bound of the prefix index (about 100 bytes a block). "
        "Changing it needs a restart.")
    speculative_s: float = Field(
        5.0, ge=0, le=600, description="For backends with `kv_events`: a prefix block recorded when a request is "
        "dispatched counts as held (`evidence=speculative`) for this long unless the engine's event confirms it "
        "(then `precise`); 0: only engine-confirmed blocks count.")
    long_prompt_tokens: int = Field(
        8192, ge=1, description="A request with more uncached prompt tokens than this goes to a `prefill` "
        "pool when one exists (with a `decode` pool too, it runs the disaggregated two-step flow).")
    scrape_interval_s: float = Field(
        2.0, ge=0, description="How often backends' `/metrics` are read to learn KV capacity and correct "
        "the load estimate's drift (0: never); samples older than 3 intervals are ignored.")
    canaries: list[CanarySplit] = Field(
        [], description="Canary (gray) releases: per model, a fraction of requests goes to a canary pool; a "
        "canary failure before the first byte is retried on the stable pool "
        "(`turbo_gateway_canary_fallbacks_total` counts them).")
    fallbacks: dict[str, list[Fallback]] = Field(
        {}, description="Model fallbacks: per model, an ordered list of other models to try when it cannot "
        "serve a request (after its own retries, within the same `retries.budget_s`, and only before the "
        "first byte reached the client); each fallback names the failures that trigger it. The request goes "
        "to the first fallback of the requested model's list, not yet tried, whose triggers include the "
        "failure (a fallback's own list is not followed). The answer is the "
        "fallback model's own (its `model` field is not rewritten); `x-turbo-route` says `fallback=MODEL`; "
        "`turbo_gateway_fallbacks_total{model,fallback,reason}` counts them.")

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        if v not in POLICIES:
            raise ValueError(f"unknown policy {v!r}; choose one of: {', '.join(sorted(POLICIES))}")
        return v


class StateStore(_Strict):
    """Where the routing state lives: in this process (default) or shared by every
    replica through Redis (see :mod:`gateway.store.routing_state`). Changing it needs a restart."""

    url: str | None = Field(
        None, description="`redis://[:password@]host:port/db`, `rediss://` (TLS), `unix://` or "
        "`redis+sentinel://[:password@]h1:26379,h2:26379/service[/db]` (Sentinel): share load, prefix "
        "placement and per-key limits with the other replicas. Unset: this process only.")
    namespace: str = Field(
        "turbo-gateway", pattern=r"^[A-Za-z0-9_.:-]+$",
        description="Keys are `tg:{namespace}:...` (the braces are a Redis Cluster hash tag).")
    staleness_s: float = Field(
        0.05, gt=0, le=60, description="Bound on the age of the other replicas' view; the background sync "
        "runs every half of it.")
    lease_s: float = Field(
        2.0, gt=0, description="A replica's load stops counting this long after its last sync (a killed "
        "replica leaks nothing).")
    timeout_s: float = Field(0.25, gt=0, description="Connect and read timeout of every Redis call.")
    prefix_stream_maxlen: int = Field(
        20000, ge=100, description="Recent dispatches (prefix blocks) kept in Redis for replicas that "
        "start late.")
    cluster: bool = Field(False, description="Connect with redis-py's `RedisCluster` (Redis Cluster).")

    @field_validator("url")
    @classmethod
    def _redis_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("redis://", "rediss://", "unix://", "redis+sentinel://")):
            raise ValueError("must be a redis://, rediss://, unix:// or redis+sentinel:// URL")
        if v is not None and v.startswith("redis+sentinel://"):
            from gateway.store.redis_client import parse_sentinel_url
            parse_sentinel_url(v)
        return v


ENGINE_FIELDS = ("kv_transfer_params", "priority", "bootstrap_host", "bootstrap_port", "bootstrap_room", "rid",
                 "request_id")


class Limits(_Strict):
    """Limits on what a request may carry."""

    max_body_bytes: int = Field(
        32 * 1024 * 1024, gt=0, description="Largest request body accepted; a larger one gets 413.")
    engine_fields: list[str] = Field(
        list(ENGINE_FIELDS),
        description="Body fields that steer an engine and only the gateway may set (a KV connector's peer, "
        "the engine's queue priority, SGLang's bootstrap server, the engine's own request id). A request "
        "carrying one is refused or stripped (`engine_fields_action`) on every path, unless its key was "
        "granted that field (`auth.keys[].engine_fields`). The gateway's own disaggregated serving still "
        "sets `kv_transfer_params` itself.")
    engine_fields_action: Literal["refuse", "strip"] = Field(
        "refuse", description="What a request carrying a field of `engine_fields` gets: `refuse`, a 400 "
        "`unsupported_parameter` naming the field; `strip`, the field is removed and the rest served (the "
        "body is then re-serialized).")


class Batch(_Strict):
    """The Batch API and its queue consumers (:mod:`gateway.batch`)."""

    enabled: bool = Field(
        False, description="Serve `/v1/files` and `/v1/batches` and run the batch life cycle (needs Redis: "
        "`batch.redis_url` or `state.url`).")
    files_dir: str = Field(
        "batch-files", description="Where uploaded, output and error files live (shared by every replica "
        "that serves the Batch API).")
    redis_url: str | None = Field(
        None, description="Redis holding the line queue and the batch records (`redis://`, `rediss://`, "
        "`unix://` or `redis+sentinel://`); unset: `state.url`.")
    gateway_url: str | None = Field(
        None, description="Where `python -m gateway.batch` consumers send lines; unset: the `listen` "
        "address.")
    workers: int = Field(
        16, ge=0, le=4096, description="Lines this gateway process drains itself, concurrently (0: none; "
        "batches then run only while `python -m gateway.batch` consumers drain the queue).")
    ttft_slo_s: float = Field(
        2.0, gt=0, description="Batch lines are admitted only while the fleet's estimated TTFT for an "
        "interactive request (`interactive_prompt_tokens` long) stays within this.")
    interactive_prompt_tokens: int = Field(
        512, ge=1, description="Prompt length of the interactive request whose estimated TTFT `ttft_slo_s` "
        "bounds.")
    max_share: float = Field(
        0.5, gt=0, le=1, description="Batch lines hold at most this share of the fleet's KV-cache capacity "
        "(estimated prompt and output tokens of the lines in flight).")
    admission_wait_s: float = Field(
        2.0, gt=0, description="A line waits this long for admission, then gets 429 `batch_deferred` (the "
        "consumer retries it; not counted as an attempt).")
    request_timeout_s: float = Field(180.0, gt=0, description="Timeout of one attempt of one line.")
    max_attempts: int = Field(3, ge=1, le=20, description="Attempts of one line in all; the final failure "
                              "goes to the error file with the backend's status and error body.")
    base_backoff_s: float = Field(0.5, ge=0, description="Base of a line's full-jitter backoff between "
                                  "attempts (as `retries.base_backoff_s`).")
    max_backoff_s: float = Field(30.0, ge=0, description="Cap of a line's backoff between attempts.")
    visibility_timeout_s: float = Field(
        60.0, gt=0, description="A line claimed by a consumer that stopped heartbeating (killed) is "
        "reclaimed by another consumer after this long.")
    drain_timeout_s: float = Field(
        20.0, ge=0, description="A consumer that stops (`python -m gateway.batch` on SIGTERM/SIGINT, "
        "`workers` at gateway shutdown, after the HTTP drain) takes no new line and gives the lines in "
        "flight this long to finish, then hands the rest back for other consumers to take at once. Keep it "
        "below the supervisor's kill timeout (Kubernetes 30 s, `docker stop` 10 s).")
    max_file_bytes: int = Field(200 * 1024 * 1024, gt=0, description="Largest file upload accepted.")
    max_files_per_key: int | None = Field(
        1000, ge=1, description="Files one key may hold at once (its uploads and its batches' output and error "
        "files); an upload past it gets 429 `quota_exceeded`. Unset: unlimited.")
    max_bytes_per_key: int | None = Field(
        10 * 1024 ** 3, ge=1, description="Bytes of files one key may hold at once (as `max_files_per_key`); "
        "an upload that would pass it gets 429 `quota_exceeded`. Unset: unlimited.")
    max_active_batches_per_key: int | None = Field(
        100, ge=1, description="Batches of one key not yet in a final state; another gets 429 "
        "`quota_exceeded`. Unset: unlimited.")
    batch_file_expires_s: int | None = Field(
        30 * 86400, ge=3600, description="An uploaded file of purpose `batch` without `expires_after` is deleted "
        "this long after its upload (OpenAI's default: 30 days). Files of other purposes are kept until deleted "
        "unless their upload gives `expires_after`. Unset: kept.")
    output_file_expires_s: int | None = Field(
        30 * 86400, ge=3600, description="A batch's output and error files are deleted this long after they "
        "were written, unless the batch gave `output_expires_after` (OpenAI's default: 30 days). Unset: kept.")

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("redis://", "rediss://", "unix://", "redis+sentinel://")):
            raise ValueError("must be a redis://, rediss://, unix:// or redis+sentinel:// URL")
        return v


class Price(_Strict):
    """What one model's tokens cost, per million tokens (any currency; the ledger's
    ``cost`` is in the same one)."""

    input: float = Field(ge=0, description="Per million prompt tokens not served from the prefix cache.")
    cached_input: float | None = Field(
        None, ge=0, description="Per million prompt tokens the backend served from its prefix cache "
        "(`usage.prompt_tokens_details.cached_tokens`); unset: `input`.")
    output: float = Field(ge=0, description="Per million completion tokens.")


class Usage(_Strict):
    """The usage ledger (:mod:`gateway.tenancy.usage_ledger`): requests, tokens, errors and cost per
    client key and model, in hourly buckets. With ``state.url`` every replica adds its
    counts to the same Redis buckets (flushed in the background, never on the request
    path); without it they stay in this process."""

    retention_days: int = Field(
        90, ge=1, le=3650, description="Hourly buckets are kept this long after their hour ended (Redis "
        "`EXPIREAT`; in-process buckets are pruned alike).")
    flush_interval_s: float = Field(
        1.0, gt=0, le=3600, description="How often this replica adds its counts to the shared buckets "
        "(`state.url`); a failed flush is retried with the same counts next time.")
    max_query_hours: int = Field(
        744, ge=1, le=87600, description="Most hours one `GET /v1/usage` or `/admin/usage` reads (one Redis "
        "hash per hour): a `since` further back than `until` minus this starts at that hour instead, and the "
        "answer's `since` says so (31 days by default; ask for earlier windows one at a time).")
    max_buffered_buckets: int = Field(
        100_000, ge=1, description="Bound on the (key, model, hour) entries waiting for a flush while "
        "Redis is unreachable; a request that would need a new entry past it is not recorded and counts in "
        "`turbo_gateway_usage_dropped_requests_total`.")
    prices: dict[str, Price] = Field(
        {}, description="Prices per model (the `model` a backend serves), per million tokens: `input`, "
        "`cached_input`, `output`. A request is charged at the prices in force when it settled; a model "
        "without a price costs 0.")


class Lifecycle(_Strict):
    """Shutdown and reload."""

    drain_timeout_s: float = Field(
        30.0, ge=0, description="After SIGTERM the gateway stops accepting connections and lets in-flight "
        "requests (streams included) finish for at most this long, then exits 0 (deploy/ assumes 30 s).")
    watch_config_s: float = Field(
        2.0, ge=0, description="How often the config file is checked for changes; a changed file is "
        "reloaded like SIGHUP (0: no watch).")


class Streaming(_Strict):
    """Streamed answers whose first token is long in coming.

    Proxies and load balancers in front of a gateway commonly cut a connection that
    carries no byte for 60 s, and a reasoning model can think longer than that before
    its first token. Once ``keepalive_after_s`` has passed since a streamed request
    arrived with no first byte from the backend, the gateway commits the answer: it
    sends the 200 head and an SSE comment (``: keep-alive``, which SSE clients and the
    openai SDKs skip), then another every ``keepalive_every_s`` until the first event.
    The trade-off: attempts go on behind the comments (retries, fallbacks), but the
    status and headers are committed: a final failure ends the stream with an error
    event instead of an error status, and the headers describe the attempt under way
    when the head went out."""

    keepalive_after_s: float | None = Field(
        30.0, gt=0, description="Seconds after a streamed request's arrival, with no first byte from the "
        "backend yet, at which the gateway sends the 200 head and a `: keep-alive` SSE comment. Retries and "
        "fallbacks go on behind the comments, but a final failure then ends the stream with an error event "
        "instead of an error status. Unset: never; the head waits for the first byte.")
    keepalive_every_s: float = Field(
        15.0, gt=0, description="Interval between `: keep-alive` comments until the first event.")


def _key_digest(key_sha256: str | None, key_env: str | None) -> bytes:
    """The SHA-256 digest of a key given as its hex digest or in an environment
    variable (read and hashed here, once). A key must be printable ASCII, as a bearer
    token is (RFC 6750): every server stack then reads it from a header alike."""
    import hashlib

    if key_sha256 is not None:
        return bytes.fromhex(key_sha256)
    value = os.environ.get(key_env or "")
    if not value:
        raise ValueError(f"key_env names the environment variable {key_env!r}, which is not set")
    if not (value.isascii() and value.isprintable()) or " " in value:
        raise ValueError(f"the key in {key_env!r} must be printable ASCII without spaces (a bearer token)")
    return hashlib.sha256(value.encode()).digest()


class ClientKey(_Strict):
    """One client API key and its limits. The key itself is never stored: give its
    SHA-256 (``key_sha256``, 64 hex digits) or the name of an environment variable
    holding it (``key_env``; hashed at load). ``name`` identifies the key in logs,
    metrics and the shared store. Limits are per key, across every replica sharing
    ``state.url``; unset = unlimited."""

    name: str = Field(
        min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$",
        description="The key's identity in logs, metrics (`key_name`), Redis and batch ownership; the key "
        "itself appears nowhere.")
    key_sha256: str | None = Field(
        None, pattern=r"^[0-9a-fA-F]{64}$",
        description="The key's SHA-256, 64 hex digits (`printf %s \"$KEY\" | sha256sum`). Set exactly one "
        "of `key_sha256` and `key_env`.")
    key_env: str | None = Field(
        None, description="Environment variable holding the key (hashed at load; must be set and non-empty).")
    requests_per_minute: int | None = Field(
        None, ge=1, description="Requests per minute (sliding window), across every replica sharing "
        "`state.url`; over it: 429 `rate_limit_exceeded` with `Retry-After`. Unset: unlimited.")
    tokens_per_minute: int | None = Field(
        None, ge=1, description="Tokens per minute: a request is charged its estimated prompt plus "
        "`max_tokens` up front, corrected to the reported `usage` when it completes (to its prompt and the "
        "completion tokens relayed when its client left or its stream broke, as the usage ledger counts it), "
        "refunded when it never reached a backend. Unset: unlimited.")
    max_concurrent: int | None = Field(
        None, ge=1, description="Requests in flight at once for this key. Unset: unlimited.")
    priority: int = Field(
        0, ge=0, le=9, description="Higher goes first in the admission queue (`admission`).")
    weight: float = Field(
        1.0, gt=0, le=1000, description="Fair share within its priority when the fleet is saturated "
        "(`admission.fairness: tokens`): the key's served tokens count divided by its weight, so a key of "
        "weight 2 gets twice the tokens of a key of weight 1 while both wait.")
    engine_fields: list[str] = Field(
        [], description="Fields of `limits.engine_fields` this key may set itself (an internal orchestrator "
        "that sets `priority`, say); the others stay refused or stripped.")
    batch_priority: bool = Field(
        False, description="Requests of this key may carry `x-turbo-priority: batch` (the key that "
        "`python -m gateway.batch` consumers send with): they pass the batch admission gate after the key's own "
        "limits. From any other key the header is ignored and the request is served as interactive.")
    route_details: bool = Field(
        False, description="This key's answers carry the cache details of `x-turbo-route` (`reason`, "
        "`matched_tokens`, `evidence`, `ttft_est_ms`) although `auth.route_details` is `granted`: for an "
        "operator's own key. They tell whether a prompt's prefix is cached, i.e. whether someone sent it lately.")

    _digest: bytes = PrivateAttr(b"")

    @model_validator(mode="after")
    def _one_source(self) -> ClientKey:
        if (self.key_sha256 is None) == (self.key_env is None):
            raise ValueError("set exactly one of `key_sha256` or `key_env`")
        self._digest = _key_digest(self.key_sha256, self.key_env)
        return self

    def digest(self) -> bytes:
        """The SHA-256 digest of the key (32 bytes), computed once at load."""
        return self._digest


class Auth(_Strict):
    """Client API keys (``Authorization: Bearer``). With no keys configured every
    caller is anonymous and unlimited (a local demo); with keys, one is required on
    ``/v1/*``."""

    keys: list[ClientKey] = Field(
        [], description="Client API keys and their limits. With any configured, `/v1/*` needs "
        "`Authorization: Bearer KEY` (401 otherwise); none: every caller is anonymous and unlimited. "
        "Names and key values must be unique.")
    metrics_key_labels: Literal["hashed", "name", "none"] = Field(
        "hashed", description="How `/metrics` (which has no auth) labels per-key series (`key_name` of "
        "`turbo_gateway_key_tokens_total`, `_rate_limited_total`, `_admission_key_service_tokens`): "
        "`hashed`, the first 12 hex digits of the SHA-256 of the key's name (a pseudonym: whoever knows a "
        "name can compute it, nobody reads the names off the page); `name`, the name itself; `none`, one "
        "series for all keys (`key_name=\"-\"`). The usage ledger and the logs keep the names.")
    route_details: Literal["granted", "everyone"] = Field(
        "granted", description="Who gets the cache details of `x-turbo-route` (`reason`, `matched_tokens`, "
        "`evidence`, `ttft_est_ms`), which tell whether a prompt's prefix is cached, so whether another tenant "
        "sent it lately: `granted`, keys with `route_details: true` only (every caller when no keys are "
        "configured: one tenant); `everyone`, every caller (a fleet whose keys are all one tenant's). The "
        "others get `policy` and `backend` only.")
    cache_isolation: Literal["shared", "per_key"] = Field(
        "shared", description="`per_key`: keep each client key's prompts apart from every other key's, in "
        "the gateway's prefix placement (the key folded into the block-hash seed) and in the engines' prefix "
        "caches (a per-key `cache_salt` sent to the engine, before any `cache_salt` the caller gave), so that "
        "no key can learn from a cache hit what another sent. Costs the hits keys would share (one system "
        "prompt used by many keys is cached once per key: docs/security.md). The engine must honour "
        "`cache_salt` (vLLM); for others only the placement is kept apart. `shared`: one cache for all.")

    @model_validator(mode="after")
    def _unique(self) -> Auth:
        names = [k.name for k in self.keys]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"duplicate key names: {', '.join(sorted(dup))}")
        digests = [k.digest() for k in self.keys]
        if len(set(digests)) != len(digests):
            raise ValueError("two keys have the same value")
        return self


class Admin(_Strict):
    """Admin endpoints (``/admin/*``): off (404) unless an admin key is set, as a
    SHA-256 (``key_sha256``) or an environment variable holding it (``key_env``)."""

    key_sha256: str | None = Field(
        None, pattern=r"^[0-9a-fA-F]{64}$",
        description="The admin key's SHA-256 (64 hex digits). Without an admin key `/admin/*` answers 404.")
    key_env: str | None = Field(
        None, description="Instead of `key_sha256`: an environment variable holding the admin key (hashed "
        "at load; must be set and non-empty).")

    _digest: bytes | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _at_most_one(self) -> Admin:
        if self.key_sha256 is not None and self.key_env is not None:
            raise ValueError("set at most one of `key_sha256` or `key_env`")
        if self.key_sha256 is not None or self.key_env is not None:
            self._digest = _key_digest(self.key_sha256, self.key_env)
        return self

    def digest(self) -> bytes | None:
        """The admin key's SHA-256 digest (computed once at load), or ``None``."""
        return self._digest


class Breaker(_Strict):
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


class Admission(_Strict):
    """Admission control when the fleet is saturated: a backend is full at
    ``max_in_flight_per_backend`` requests (from every replica); when every routable
    backend of a model is full, requests wait in a queue per priority (bounded by
    ``queue_size``, served fairly across keys: by tokens or round robin, ``fairness``)
    for at most ``queue_timeout_s``, then get 503 with ``Retry-After``. Unset = off."""

    max_in_flight_per_backend: int | None = Field(
        None, ge=1, description="A backend is full at this many in-flight requests (from every replica); "
        "when every routable backend of a model is full, requests queue. Unset: no admission control.")
    queue_size: int = Field(
        1000, ge=0, description="Waiting requests per priority; beyond, 503 `fleet_saturated` with "
        "`Retry-After` at once.")
    queue_timeout_s: float = Field(
        10.0, ge=0, description="Longest wait in the queue, then 503 `fleet_saturated` with `Retry-After`.")
    fairness: Literal["tokens", "round_robin"] = Field(
        "tokens", description="Which key goes next within a priority: `tokens`, the key that was served the "
        "fewest weighted tokens (the Virtual Token Counter of Sheng et al., OSDI 2024), so a key of long "
        "prompts cannot take the fleet from a key of short ones; `round_robin`, one request per key in turn.")
    prompt_token_weight: float = Field(
        1.0, ge=0, description="What one prompt token costs a key under `fairness: tokens` (the paper's "
        "w_p; 1 as in its evaluation).")
    output_token_weight: float = Field(
        2.0, ge=0, description="What one output token costs a key under `fairness: tokens` (the paper's "
        "w_q; 2 as in its evaluation: output tokens cost about twice input tokens in API prices).")

    @model_validator(mode="after")
    def _some_cost(self) -> Admission:
        if self.prompt_token_weight == 0 and self.output_token_weight == 0:
            raise ValueError("prompt_token_weight and output_token_weight are both 0: tokens would cost nothing; "
                             "set one above 0, or use fairness: round_robin")
        return self


class LoraAdapter(_Strict):
    """A LoRA adapter the gateway may load on a backend on demand (vLLM's
    ``POST /v1/load_lora_adapter``, which needs ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``
    on the engine)."""

    base: str = Field(min_length=1, description="The base model the adapter applies to (a `model` name a backend "
                      "serves).")
    path: str = Field(min_length=1, description="The adapter's `lora_path` as the engine sees it (a local "
                      "directory on the engine's host, or what its LoRA resolver accepts).")


class ModelSettings(_Strict):
    """What the gateway knows of one model beyond its name: its own tokenizer, so
    that prompts become the exact token ids the engine computes (token-exact prefix
    blocks, exact prompt token counts). Without one the model is served as before,
    on estimated tokens and byte-level prefix blocks.

    Relative paths are relative to the config file's directory. The files are read
    and checked when the config loads (and on reload); a bad file is a config error."""

    tokenizer: str | None = Field(
        None, description="The model's Hugging Face tokenizer: a `tokenizer.json` file, or a directory holding "
        "`tokenizer.json` and `tokenizer_config.json` (chat template, special tokens, `add_bos_token`), as a model "
        "repository has them (`special_tokens_map.json` and `chat_template.jinja` are read too when present). Chat "
        "requests are rendered with the chat template as vLLM renders them; with a lone `tokenizer.json` only "
        "completions (and chat with `chat_template`) are tokenized. Unset: no tokenizer.")
    chat_template: str | None = Field(
        None, description="A Jinja chat template file that replaces the model's own (as vLLM's `--chat-template`); "
        "needs `tokenizer`.")
    prefix_cache_tokens: int = Field(
        DEFAULT_TOKENIZER_CACHE_TOKENS, ge=0, description="Token ids of rendered prompt segments (cut at the "
        "tokenizer's special tokens, such as each message's start, and long messages about every 2,048 characters "
        "where the tokenizer allows it) kept so that a conversation's next turn, or a message that grew, tokenizes "
        "only its new text; 4 bytes each. 0: tokenize every prompt whole.")
    lora: LoraAdapter | None = Field(
        None, description="This model is a LoRA adapter that the backends with `lora.dynamic: true` serving its "
        "base model may load on demand: routing counts them as able to serve it (with the load in the estimated "
        "TTFT), and the gateway loads it on the one chosen before sending the request.")

    @field_validator("tokenizer", "chat_template")
    @classmethod
    def _resolve(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return v
        p = Path(v).expanduser()
        base = (info.context or {}).get("config_dir")
        if not p.is_absolute() and base is not None:
            p = Path(base) / p
        return str(p)

    @model_validator(mode="after")
    def _load(self) -> ModelSettings:
        if self.chat_template is not None and self.tokenizer is None:
            raise ValueError("`chat_template` needs `tokenizer`")
        if self.tokenizer is not None:
            try:
                load_tokenizer(self.tokenizer, self.chat_template, self.prefix_cache_tokens)
            except TokenizerError as e:
                raise ValueError(str(e)) from None
        return self


class GatewayConfig(_Strict):
    """The root of ``backends.yaml``."""

    listen: Listen = Field(Listen(), description="Where the gateway listens. Changing it needs a restart.")
    backends: list[Backend] = Field(
        min_length=1, description="The upstream OpenAI-compatible servers (vLLM, SGLang, TGI, llama.cpp, ...), "
        "or simulated demo backends. At least one; names unique.")
    models: dict[str, ModelSettings] = Field(
        {}, description="Per model (the `model` name clients send): its own tokenizer, for token-exact prefix "
        "blocks and exact prompt token counts. A model not listed is served on estimated tokens, unless a "
        "`simulate:` backend serving it names a `tokenizer` (then that one). Every model listed must be served "
        "by a backend.")
    pools: list[Pool] = Field(
        [Pool(name="mixed")], description="Named groups of backends with a role: `mixed`, `prefill` or "
        "`decode`. Every `backends[].pool` must name one.")
    routing: Routing = Field(
        Routing(), description="How a backend is chosen: the policy, the prefix index, pools, canaries and "
        "model fallbacks.")
    timeouts: Timeouts = Field(
        Timeouts(), description="Timeouts of one upstream attempt, in seconds; `backends[].timeouts` overrides "
        "them per backend. A timeout that fires fails the attempt (retried while no byte reached the "
        "client).")
    retries: Retries = Field(
        Retries(), description="Retries with exponential backoff and full jitter (AWS Architecture Blog, "
        "\"Exponential Backoff And Jitter\", 2015), for connect errors, 429, 502/503/504 and timeouts, only "
        "while no byte has reached the client; each retry goes to another backend when one can serve the "
        "model.")
    state: StateStore = Field(
        StateStore(), description="Where the routing state lives: this process, or shared by every replica "
        "through Redis (no Redis call on the request path). Changing it needs a restart.")
    limits: Limits = Field(Limits(), description="Limits on what a request may carry.")
    health: HealthChecks = Field(
        HealthChecks(), description="Active health checks: `GET {url}{path}` of every backend, periodically; "
        "a probe fails on a non-2xx answer or none within `timeout_s`.")
    lifecycle: Lifecycle = Field(Lifecycle(), description="Shutdown (SIGTERM drain) and config reload.")
    streaming: Streaming = Field(
        Streaming(), description="Streamed answers whose first token is long in coming: keep-alive comments "
        "for the proxies in front.")
    auth: Auth = Field(
        Auth(), description="Client API keys (`Authorization: Bearer`) and their per-key limits.")
    admin: Admin = Field(
        Admin(), description="The admin key of `/admin/*` (backends, drain, reload, batches). Set at most one "
        "of `key_sha256` and `key_env`; with neither the admin endpoints answer 404.")
    breaker: Breaker = Field(
        Breaker(), description="Passive outlier detection: one circuit breaker per backend.")
    admission: Admission = Field(
        Admission(), description="Admission control when the fleet is saturated: requests wait in a queue per "
        "priority, served round robin across keys, then get 503 with `Retry-After`.")
    batch: Batch = Field(
        Batch(), description="The OpenAI Files and Batches API and its queue consumers, at a lower priority "
        "than interactive traffic.")
    usage: Usage = Field(
        Usage(), description="The usage ledger per key and model (`GET /admin/usage`, `GET /v1/usage`): "
        "retention, flushing to Redis and prices.")

    @model_validator(mode="after")
    def _cross_checks(self) -> GatewayConfig:
        names = [b.name for b in self.backends]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"duplicate backend names: {', '.join(sorted(dup))}")
        pools = {p.name for p in self.pools}
        for b in self.backends:
            if b.pool not in pools:
                raise ValueError(f"backend {b.name!r} names pool {b.pool!r}, which is not in `pools` "
                                 f"({', '.join(sorted(pools))})")
        # A backend with `models: auto` may serve any model once it lists it, so the
        # checks below only hold names to the configured lists when none discovers.
        for c in self.routing.canaries:
            for pool in (c.stable_pool, c.canary_pool):
                if not any(b.pool == pool and (b.discover or c.model in b.models) for b in self.backends):
                    raise ValueError(f"canary split for model {c.model!r}: no backend in pool {pool!r} serves it")
        served: set[str] | _AnyModel = {m for b in self.backends for m in b.static_models}
        if any(b.discover for b in self.backends):
            served = _AnyModel()
        dynamic = any(b.lora.dynamic for b in self.backends)
        for model, settings in self.models.items():
            if settings.lora is not None:
                if settings.lora.base not in served:
                    raise ValueError(f"models: the base model {settings.lora.base!r} of adapter {model!r} is served "
                                     "by no backend")
                if not dynamic:
                    raise ValueError(f"models: adapter {model!r} has `lora`, but no backend has `lora.dynamic: true`")
            elif model not in served:
                raise ValueError(f"models: model {model!r} is served by no backend")
        if isinstance(served, set):  # adapters loaded on demand are served too
            served |= {m for m, settings in self.models.items() if settings.lora is not None}
        for model, chain in self.routing.fallbacks.items():
            for f in chain:
                if f.model == model:
                    raise ValueError(f"routing.fallbacks: model {model!r} names itself as a fallback")
                if f.model not in served:
                    raise ValueError(f"routing.fallbacks: fallback {f.model!r} of model {model!r} is served by "
                                     "no backend")
        unpriced = sorted(m for m in self.usage.prices if m not in served)
        if unpriced:
            raise ValueError(f"usage.prices: no backend serves {', '.join(map(repr, unpriced))}")
        return self

    @model_validator(mode="before")
    @classmethod
    def _simulated_tokenizers(cls, data: Any) -> Any:
        # A simulated backend's `tokenizer` is its models' own unless `models` names one.
        if not isinstance(data, dict) or not isinstance(data.get("backends"), list):
            return data
        found: dict[str, tuple[str, str]] = {}  # model -> (tokenizer path, backend)
        for b in data["backends"]:
            sim = b.get("simulate") if isinstance(b, dict) else None
            tok = sim.get("tokenizer") if isinstance(sim, dict) else None
            if not isinstance(tok, str) or not isinstance(b.get("models"), list):
                continue
            path = os.path.abspath(tok)  # the simulator reads it from the gateway's working directory
            for m in b["models"]:
                if not isinstance(m, str) or m == AUTO_MODELS:
                    continue
                prev = found.setdefault(m, (path, str(b.get("name"))))
                if prev[0] != path:
                    raise ValueError(f"simulated backends {prev[1]!r} and {b.get('name')!r} serve model {m!r} with "
                                     f"different tokenizers; name the model's own in `models.{m}.tokenizer`")
        models = data.get("models")
        if not found or not isinstance(models if models is not None else {}, dict):
            return data
        models = dict(models or {})
        for m, (path, _) in found.items():
            settings = models.get(m)
            if settings is None:
                models[m] = {"tokenizer": path}
            elif isinstance(settings, dict) and "tokenizer" not in settings and "lora" not in settings:
                models[m] = {**settings, "tokenizer": path}
        return {**data, "models": models}

    def with_kv_events(self, sources: dict[str, KVEvents]) -> GatewayConfig:
        """This config with the ``kv_events`` of the simulated backends the gateway
        wires itself (:attr:`Backend.simulated_kv_events`) taken from ``sources`` (by
        backend name; see :func:`gateway.ops.demo_fleet.simulated_kv_sources`)."""
        if not sources:
            return self
        backends = [b.model_copy(update={"kv_events": sources[b.name]})
                    if b.simulated_kv_events and b.name in sources else b for b in self.backends]
        return self.model_copy(update={"backends": backends})

    @model_validator(mode="after")
    def _admin_key_is_no_client_key(self) -> GatewayConfig:
        admin = self.admin.digest()
        if admin is not None and any(k.digest() == admin for k in self.auth.keys):
            raise ValueError("the admin key equals a client key (auth.keys); give the admin its own key")
        return self

    @model_validator(mode="after")
    def _batch_needs_redis(self) -> GatewayConfig:
        if self.batch.enabled and not (self.batch.redis_url or self.state.url):
            raise ValueError("batch.enabled needs Redis: set batch.redis_url or state.url")
        return self

    def timeouts_for(self, backend: Backend) -> Timeouts:
        """The global timeouts with ``backend``'s overrides applied."""
        overrides = backend.timeouts.model_dump(exclude_none=True)
        return self.timeouts.model_copy(update=overrides) if overrides else self.timeouts


class _AnyModel:
    """A set of model names that holds every name (some backend discovers its models)."""

    def __contains__(self, name: object) -> bool:
        return True


def _format_validation_error(path: Path, err: ValidationError) -> str:
    return describe(path, explain(err, GatewayConfig))


def parse_config(data: object, path: Path | str = "<config>") -> GatewayConfig:
    """Validate an already-parsed YAML document; relative file paths in it are
    relative to ``path``'s directory. Raises :class:`ConfigError`."""
    path = Path(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a YAML mapping at the top level")
    try:
        return GatewayConfig.model_validate(data, context={"config_dir": str(path.parent)})
    except ValidationError as e:
        raise ConfigError(_format_validation_error(path, e)) from None


def load_config(path: str | os.PathLike[str]) -> GatewayConfig:
    """Read and validate ``path``. Raises :class:`ConfigError` for a missing or
    unreadable file, YAML syntax errors and invalid fields."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config file: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{p}: YAML syntax error{where}: {getattr(e, 'problem', None) or e}") from None
    return parse_config(data, p)
