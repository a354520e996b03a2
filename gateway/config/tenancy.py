"""Who may call and how much: client keys (``auth``), the admin key and admission when
the fleet is saturated."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    PrivateAttr,
    model_validator,
)

from gateway.config.base import Strict


class ClientKey(Strict):
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
        "`matched_tokens`, `evidence`, `ttft_est_ms`, `output_tokens_est`) although `auth.route_details` is "
        "`granted`: for an operator's own key. They tell whether a prompt's prefix is cached, i.e. whether "
        "someone sent it lately.")

    _digest: bytes = PrivateAttr(b"")

    @model_validator(mode="after")
    def _one_source(self) -> ClientKey:
        if (self.key_sha256 is None) == (self.key_env is None):
            raise ValueError("set exactly one of `key_sha256` or `key_env`")
        if self.key_sha256 is not None:
            self._digest = bytes.fromhex(self.key_sha256)
        return self

    def digest(self) -> bytes:
        """The SHA-256 digest of the key (32 bytes): from ``key_sha256``, or computed
        once at load from the variable ``key_env`` names
        (:func:`gateway.config.resolve.resolve`)."""
        return self._digest


class Auth(Strict):
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


class Admin(Strict):
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
        if self.key_sha256 is not None:
            self._digest = bytes.fromhex(self.key_sha256)
        return self

    def digest(self) -> bytes | None:
        """The admin key's SHA-256 digest (from ``key_sha256``, or computed once at load
        from ``key_env``: :func:`gateway.config.resolve.resolve`), or ``None``."""
        return self._digest


class Admission(Strict):
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
    session_fairness: Literal["off", "las"] = Field(
        "off", description="Which of a key's waiting requests goes next: `off`, arrival order; `las`, the one "
        "whose session (docs/sessions.md) has attained the least service, uncached prompt and output tokens "
        "weighted as below (least attained service per program, Autellix, Luo et al. 2025), a request without "
        "a session counting as a new one and one that has waited half of `queue_timeout_s` going first. Off by "
        "default: on the agentic benchmark it did not shorten sessions (docs/results/agentic.md).")
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
