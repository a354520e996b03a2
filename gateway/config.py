"""``backends.yaml``: the gateway's whole configuration, validated by pydantic.

:func:`load_config` is the only entry point; it raises :class:`ConfigError` with one
human-readable message naming the file and the offending field.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from routing.policies import POLICIES

PositiveSeconds = Annotated[float, Field(gt=0)]


class ConfigError(Exception):
    """The config file is missing, unreadable or invalid. The message names the file
    and the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Timeouts(_Strict):
    """Timeouts of one upstream attempt, in seconds (``None`` disables one).

    - ``connect_s``: TCP connect (and TLS) to the backend.
    - ``ttft_s``: from sending the request to the first response body byte
      (time to first token for a stream).
    - ``idle_s``: longest gap between two body chunks (inter-token stall).
    - ``total_s``: the whole attempt, first byte to last.
    """

    connect_s: PositiveSeconds | None = 5.0
    ttft_s: PositiveSeconds | None = 120.0
    idle_s: PositiveSeconds | None = 60.0
    total_s: PositiveSeconds | None = 900.0


class TimeoutOverrides(_Strict):
    """Per-backend overrides of :class:`Timeouts`; unset fields keep the global value."""

    connect_s: PositiveSeconds | None = None
    ttft_s: PositiveSeconds | None = None
    idle_s: PositiveSeconds | None = None
    total_s: PositiveSeconds | None = None


class Retries(_Strict):
    """Retry policy: exponential backoff with full jitter.

    Attempt ``n`` (1-based retry count) sleeps ``uniform(0, min(max_backoff_s,
    base_backoff_s * 2**(n-1)))`` ("full jitter", AWS Architecture Blog, *Exponential
    Backoff And Jitter*, 2015), or the backend's ``Retry-After`` when it is longer and the
    retry must return to the same backend. Retries happen only for connect errors,
    429, 502/503/504 and timeouts, only while no byte has reached the client, and stop
    after ``max_attempts`` attempts in all or once ``budget_s`` seconds have passed
    since the first attempt.
    """

    max_attempts: int = Field(3, ge=1, le=20)
    base_backoff_s: float = Field(0.05, ge=0)
    max_backoff_s: float = Field(2.0, ge=0)
    budget_s: float = Field(30.0, gt=0)
    max_retry_after_s: float = Field(10.0, ge=0)
    failed_backend_cooldown_s: float = Field(1.0, ge=0)


class SpeedHints(_Strict):
    """Optional seeds for the load model (learned online later)."""

    prefill_tokens_per_s: float | None = Field(None, gt=0)
    decode_tokens_per_s: float | None = Field(None, gt=0)
    kv_capacity_tokens: int | None = Field(None, gt=0)


class Backend(_Strict):
    """One upstream OpenAI-compatible server.

    ``url`` is the server's base URL without ``/v1`` (e.g. ``http://10.0.0.5:8000``);
    request paths (``/v1/chat/completions``...) are appended. ``api_key_env`` names an
    environment variable holding the key sent to this backend as ``Authorization:
    Bearer``. Exactly one of ``url`` and ``simulate`` must be set: ``simulate`` holds
    the options of a demo backend that the gateway starts itself with
    ``python -m loadtest.sim`` (validated there; see ``loadtest/README.md``).
    """

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")
    url: str | None = None
    models: list[str] = Field(min_length=1)
    pool: str = "mixed"
    weight: float = Field(1.0, gt=0)
    api_key_env: str | None = None
    hints: SpeedHints = SpeedHints()
    timeouts: TimeoutOverrides = TimeoutOverrides()
    health_path: str | None = None
    simulate: dict[str, Any] | None = None

    @field_validator("url")
    @classmethod
    def _check_url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not (v.startswith("http://") or v.startswith("https://")):
            raise ValueError("must start with http:// or https://")
        return v.rstrip("/")

    @model_validator(mode="after")
    def _url_or_simulate(self) -> "Backend":
        if (self.url is None) == (self.simulate is None):
            raise ValueError("set exactly one of `url` (a real server) or `simulate` (a demo backend)")
        if self.api_key_env is not None and self.api_key_env not in os.environ:
            raise ValueError(f"api_key_env names the environment variable {self.api_key_env!r}, which is not set")
        return self


class HealthChecks(_Strict):
    """Active health checks: ``GET {url}{path}`` every ``interval_s`` seconds; a
    backend is down after ``unhealthy_threshold`` consecutive failures (non-2xx or
    no answer within ``timeout_s``) and up again after one success."""

    interval_s: float = Field(5.0, gt=0)
    timeout_s: float = Field(2.0, gt=0)
    path: str = "/health"
    unhealthy_threshold: int = Field(2, ge=1)
    healthy_threshold: int = Field(1, ge=1)


class Pool(_Strict):
    """A named group of backends with a role (``mixed``, ``prefill`` or ``decode``)."""

    name: str
    role: Literal["mixed", "prefill", "decode"] = "mixed"


class Listen(_Strict):
    """Where the gateway listens. ``fast_path``: serve plain completion requests on the
    lean data-plane protocol (:mod:`gateway.fastpath`) instead of aiohttp's server."""

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    fast_path: bool = True


class CanarySplit(_Strict):
    """Serve ``model`` from ``stable_pool`` and, for a ``canary_weight`` fraction of its
    requests (0 to 1, e.g. 0.05), from ``canary_pool``; a canary request that fails
    before its first byte is retried on the stable pool."""

    model: str
    stable_pool: str
    canary_pool: str
    canary_weight: float = Field(0.05, ge=0, le=1)


class Routing(_Strict):
    """How a backend is chosen.

    - ``policy``: one of :data:`routing.POLICIES` (default ``estimated_ttft``).
    - ``block_tokens``: prefix-index block size in tokens (blocks are cut every
      ``4 * block_tokens`` bytes of canonical prompt text).
    - ``prefix_ttl_s``: an indexed block unused this long counts as evicted.
    - ``prefix_index_max_blocks``: memory bound of the index (about 100 bytes a block).
    - ``long_prompt_tokens``: a request with more uncached prompt tokens than this goes
      to a ``prefill`` pool when one exists (or, with a ``decode`` pool too, runs the
      disaggregated two-step flow).
    - ``scrape_interval_s``: how often backends' ``/metrics`` are read to correct the
      load estimate (0 disables); samples older than 3 intervals are ignored.
    """

    policy: str = "estimated_ttft"
    block_tokens: int = Field(64, ge=1, le=65536)
    prefix_ttl_s: float = Field(600.0, gt=0)
    prefix_index_max_blocks: int = Field(2_000_000, ge=1000)
    long_prompt_tokens: int = Field(8192, ge=1)
    scrape_interval_s: float = Field(2.0, ge=0)
    canaries: list[CanarySplit] = []

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        if v not in POLICIES:
            raise ValueError(f"unknown policy {v!r}; choose one of: {', '.join(sorted(POLICIES))}")
        return v


class StateStore(_Strict):
    """Where the routing state lives: in this process (default) or shared by every
    replica through Redis (see :mod:`routing.state`).

    - ``url``: ``redis://[:password@]host:port/db``, ``rediss://`` for TLS, ``unix://``,
      or ``redis+sentinel://[:password@]h1:26379,h2:26379/service[/db]`` (Sentinel);
      unset = in-process.
    - ``namespace``: keys are ``tg:{namespace}:...`` (a Cluster hash tag).
    - ``staleness_s``: bound on the age of the other replicas' view (default 50 ms).
    - ``lease_s``: a replica's load stops counting this long after its last sync.
    - ``timeout_s``: connect and read timeout of every Redis call.
    - ``prefix_stream_maxlen``: dispatches kept for late-starting replicas.
    - ``cluster``: use Redis Cluster (redis-py ``RedisCluster``).
    """

    url: str | None = None
    namespace: str = Field("turbo-gateway", pattern=r"^[A-Za-z0-9_.:-]+$")
    staleness_s: float = Field(0.05, gt=0, le=60)
    lease_s: float = Field(2.0, gt=0)
    timeout_s: float = Field(0.25, gt=0)
    prefix_stream_maxlen: int = Field(20000, ge=100)
    cluster: bool = False

    @field_validator("url")
    @classmethod
    def _redis_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("redis://", "rediss://", "unix://", "redis+sentinel://")):
            raise ValueError("must be a redis://, rediss://, unix:// or redis+sentinel:// URL")
        if v is not None and v.startswith("redis+sentinel://"):
            from routing.state import parse_sentinel_url
            parse_sentinel_url(v)
        return v


class Limits(_Strict):
    max_body_bytes: int = Field(32 * 1024 * 1024, gt=0)


class Batch(_Strict):
    """The Batch API and its queue consumers (:mod:`gateway.batch`).

    - ``enabled``: serve ``/v1/files`` and ``/v1/batches`` (needs Redis: ``redis_url``
      or ``state.url``).
    - ``files_dir``: where uploaded, output and error files live (shared by replicas).
    - ``redis_url``: the queue and job state; unset = ``state.url``.
    - ``gateway_url``: where ``python -m gateway.batch`` consumers send lines (default:
      the ``listen`` address).
    - ``workers``: lines this gateway process drains itself (0: external consumers only,
      ``python -m gateway.batch``).
    - ``ttft_slo_s``: batch lines are admitted only while the fleet's estimated TTFT of
      an interactive request (``interactive_prompt_tokens`` long) stays within this.
    - ``max_share``: batch lines hold at most this share of the fleet's KV-cache
      capacity (estimated prompt + output tokens of the lines in flight).
    - ``admission_wait_s``: a line waits this long for admission, then gets 429
      ``batch_deferred`` (the consumer retries it; not counted as an attempt).
    - ``request_timeout_s``, ``max_attempts``, ``base_backoff_s``, ``max_backoff_s``:
      per-attempt timeout and the retry policy of one line (full-jitter backoff).
    - ``visibility_timeout_s``: a line claimed by a consumer that stopped heartbeating
      (killed) is reclaimed by another consumer after this long.
    - ``max_file_bytes``: largest upload.
    """

    enabled: bool = False
    files_dir: str = "batch-files"
    redis_url: str | None = None
    gateway_url: str | None = None
    workers: int = Field(0, ge=0, le=4096)
    ttft_slo_s: float = Field(2.0, gt=0)
    interactive_prompt_tokens: int = Field(512, ge=1)
    max_share: float = Field(0.5, gt=0, le=1)
    admission_wait_s: float = Field(2.0, gt=0)
    request_timeout_s: float = Field(180.0, gt=0)
    max_attempts: int = Field(3, ge=1, le=20)
    base_backoff_s: float = Field(0.5, ge=0)
    max_backoff_s: float = Field(30.0, ge=0)
    visibility_timeout_s: float = Field(60.0, gt=0)
    max_file_bytes: int = Field(200 * 1024 * 1024, gt=0)

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("redis://", "rediss://", "unix://", "redis+sentinel://")):
            raise ValueError("must be a redis://, rediss://, unix:// or redis+sentinel:// URL")
        return v


class Lifecycle(_Strict):
    """Shutdown and reload.

    - ``drain_timeout_s``: after SIGTERM the gateway stops accepting connections and
      lets in-flight requests (streams included) finish for at most this long, then
      exits 0 (deploy/ assumes 30 s).
    - ``watch_config_s``: how often the config file is checked for changes (a changed
      file is reloaded like SIGHUP); 0 disables the watch.
    """

    drain_timeout_s: float = Field(30.0, ge=0)
    watch_config_s: float = Field(2.0, ge=0)


class ClientKey(_Strict):
    """One client API key and its limits. The key itself is never stored: give its
    SHA-256 (``key_sha256``, 64 hex digits) or the name of an environment variable
    holding it (``key_env``; hashed at load). ``name`` identifies the key in logs,
    metrics and the shared store. Limits are per key, across every replica sharing
    ``state.url``; unset = unlimited."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    key_sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$")
    key_env: str | None = None
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    max_concurrent: int | None = Field(None, ge=1)
    priority: int = Field(0, ge=0, le=9)

    @model_validator(mode="after")
    def _one_source(self) -> "ClientKey":
        if (self.key_sha256 is None) == (self.key_env is None):
            raise ValueError("set exactly one of `key_sha256` or `key_env`")
        if self.key_env is not None and not os.environ.get(self.key_env):
            raise ValueError(f"key_env names the environment variable {self.key_env!r}, which is not set")
        return self

    def digest(self) -> bytes:
        """The SHA-256 digest of the key (32 bytes)."""
        import hashlib

        if self.key_sha256 is not None:
            return bytes.fromhex(self.key_sha256)
        return hashlib.sha256(os.environ[self.key_env or ""].encode()).digest()


class Auth(_Strict):
    """Client API keys (``Authorization: Bearer``). With no keys configured every
    caller is anonymous and unlimited (a local demo); with keys, one is required on
    ``/v1/*``."""

    keys: list[ClientKey] = []

    @model_validator(mode="after")
    def _unique(self) -> "Auth":
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

    key_sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$")
    key_env: str | None = None

    @model_validator(mode="after")
    def _at_most_one(self) -> "Admin":
        if self.key_sha256 is not None and self.key_env is not None:
            raise ValueError("set at most one of `key_sha256` or `key_env`")
        if self.key_env is not None and not os.environ.get(self.key_env):
            raise ValueError(f"key_env names the environment variable {self.key_env!r}, which is not set")
        return self

    def digest(self) -> bytes | None:
        import hashlib

        if self.key_sha256 is not None:
            return bytes.fromhex(self.key_sha256)
        if self.key_env is not None:
            return hashlib.sha256(os.environ[self.key_env].encode()).digest()
        return None


class Breaker(_Strict):
    """Passive outlier detection, one circuit breaker per backend: it opens after
    ``failure_threshold`` consecutive failed attempts (connect errors, timeouts, 5xx,
    streams cut; not 4xx or 429), keeps the backend out of routing for ``open_s``, then
    lets one probe request through (half-open) and closes after
    ``success_threshold`` successes. ``failure_threshold: 0`` disables it."""

    failure_threshold: int = Field(5, ge=0)
    open_s: float = Field(10.0, gt=0)
    success_threshold: int = Field(1, ge=1)


class Admission(_Strict):
    """Admission control when the fleet is saturated: a backend is full at
    ``max_in_flight_per_backend`` requests (from every replica); when every routable
    backend of a model is full, requests wait in a queue per priority (bounded by
    ``queue_size``, served fairly across keys) for at most ``queue_timeout_s``, then
    get 503 with ``Retry-After``. Unset = off."""

    max_in_flight_per_backend: int | None = Field(None, ge=1)
    queue_size: int = Field(1000, ge=0)
    queue_timeout_s: float = Field(10.0, ge=0)


class GatewayConfig(_Strict):
    """The root of ``backends.yaml``."""

    listen: Listen = Listen()
    backends: list[Backend] = Field(min_length=1)
    pools: list[Pool] = [Pool(name="mixed")]
    routing: Routing = Routing()
    timeouts: Timeouts = Timeouts()
    retries: Retries = Retries()
    state: StateStore = StateStore()
    limits: Limits = Limits()
    health: HealthChecks = HealthChecks()
    lifecycle: Lifecycle = Lifecycle()
    auth: Auth = Auth()
    admin: Admin = Admin()
    breaker: Breaker = Breaker()
    admission: Admission = Admission()
    batch: Batch = Batch()

    @model_validator(mode="after")
    def _cross_checks(self) -> "GatewayConfig":
        names = [b.name for b in self.backends]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"duplicate backend names: {', '.join(sorted(dup))}")
        pools = {p.name for p in self.pools}
        for b in self.backends:
            if b.pool not in pools:
                raise ValueError(f"backend {b.name!r} names pool {b.pool!r}, which is not in `pools` ({', '.join(sorted(pools))})")
        for c in self.routing.canaries:
            for pool in (c.stable_pool, c.canary_pool):
                if not any(b.pool == pool and c.model in b.models for b in self.backends):
                    raise ValueError(f"canary split for model {c.model!r}: no backend in pool {pool!r} serves it")
        return self

    @model_validator(mode="after")
    def _batch_needs_redis(self) -> "GatewayConfig":
        if self.batch.enabled and not (self.batch.redis_url or self.state.url):
            raise ValueError("batch.enabled needs Redis: set batch.redis_url or state.url")
        return self

    def timeouts_for(self, backend: Backend) -> Timeouts:
        """The global timeouts with ``backend``'s overrides applied."""
        overrides = backend.timeouts.model_dump(exclude_none=True)
        return self.timeouts.model_copy(update=overrides) if overrides else self.timeouts


def _format_validation_error(path: Path, err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "(top level)"
    msg = first["msg"].removeprefix("Value error, ")
    more = f" (and {err.error_count() - 1} more error(s))" if err.error_count() > 1 else ""
    return f"{path}: invalid config at `{loc}`: {msg}{more}"


def parse_config(data: object, path: Path | str = "<config>") -> GatewayConfig:
    """Validate an already-parsed YAML document. Raises :class:`ConfigError`."""
    path = Path(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a YAML mapping at the top level")
    try:
        return GatewayConfig.model_validate(data)
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
