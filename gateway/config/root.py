"""The root of ``backends.yaml``: :class:`GatewayConfig`, its sections and the checks
across them."""

from __future__ import annotations

import os
from typing import Any

from pydantic import (
    Field,
    model_validator,
)

from gateway.config.base import AUTO_MODELS, Strict
from gateway.config.migration import Migration
from gateway.config.routing_rules import ModelSettings, Routing
from gateway.config.serving import Lifecycle, Limits, Listen, Pool, Streaming
from gateway.config.sessions import Sessions
from gateway.config.stores import Batch, StateStore, StoredResponses, Usage
from gateway.config.tenancy import Admin, Admission, Auth
from gateway.config.tracing import Tracing
from gateway.config.upstream import Backend, Breaker, HealthChecks, KVEvents, Retries, Timeouts


class GatewayConfig(Strict):
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
    sessions: Sessions = Field(
        Sessions(), description="Sessions (agent loops, conversations): which requests are turns of one session "
        "and how long the backend holding its KV cache stays its home (docs/sessions.md).")
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
    migration: Migration = Field(
        Migration(), description="Streams continued on another backend of the model when theirs fails after "
        "output reached the client (docs/failure-contract.md).")
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
    responses: StoredResponses = Field(
        StoredResponses(), description="The Responses API's stored responses (`previous_response_id`, "
        "`GET /v1/responses/{id}`), kept for the whole fleet. Changing it needs a restart.")
    batch: Batch = Field(
        Batch(), description="The OpenAI Files and Batches API and its queue consumers, at a lower priority "
        "than interactive traffic.")
    usage: Usage = Field(
        Usage(), description="The usage ledger per key and model (`GET /admin/usage`, `GET /v1/usage`): "
        "retention, flushing to Redis and prices.")
    tracing: Tracing = Field(
        Tracing(), description="OpenTelemetry traces of completion requests, exported over OTLP/HTTP "
        "(docs/tracing.md). Changing it needs a restart.")

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
        unknown = sorted(m for m in self.migration.models if m not in served)
        if unknown:
            raise ValueError(f"migration.models: no backend serves {', '.join(map(repr, unknown))}")
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
