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


class Pool(_Strict):
    """A named group of backends with a role (``mixed``, ``prefill`` or ``decode``)."""

    name: str
    role: Literal["mixed", "prefill", "decode"] = "mixed"


class Listen(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)


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

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        if v not in POLICIES:
            raise ValueError(f"unknown policy {v!r}; choose one of: {', '.join(sorted(POLICIES))}")
        return v


class StateStore(_Strict):
    """Where the routing state lives: in this process (default) or shared by every
    replica through Redis (see :mod:`routing.state`).

    - ``url``: ``redis://[:password@]host:port/db``, ``rediss://`` for TLS, or
      ``unix://``; unset = in-process.
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
        if v is not None and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must be a redis://, rediss:// or unix:// URL")
        return v


class Limits(_Strict):
    max_body_bytes: int = Field(32 * 1024 * 1024, gt=0)


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
