"""The aiohttp application: routes, middleware and lifecycle.

:func:`create_app` builds the app from a :class:`~gateway.config.GatewayConfig`;
handlers are thin and hand completion requests to :class:`~gateway.proxy.Proxy`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from gateway.admin import CALLER, HardeningCollector, auth_middleware, setup_admin
from gateway.batch import setup_batch
from gateway.config import GatewayConfig
from gateway.demo import DemoFleet
from gateway.errors import ClientError, error_response
from gateway.health import HealthChecker
from gateway.scraper import MetricsScraper
from gateway.metrics import GatewayMetrics
from gateway.openai_api import models_list, parse_completion_request, read_json_body
from gateway.downstream import AiohttpDownstream, ClientGone
from gateway.proxy import REQUEST_ID_HEADER, BackendClient, Exchange, Proxy
from gateway.reload import init_hardening, make_session, watch_config
from routing import BackendSpec, Fleet, Router, UnknownModel, make_policy
from routing.estimate import TokenEstimator
from routing.prefix_index import PrefixIndex
from routing.state import InProcessStore, RedisStore

log = logging.getLogger("gateway")

CONFIG = web.AppKey("config", GatewayConfig)
STATE = web.AppKey("state", "GatewayState")
REQUEST_ID = web.RequestKey("request_id", str)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("turbo-gateway")
    except PackageNotFoundError:
        return "unknown"


def canary_splits(cfg: GatewayConfig) -> dict[str, tuple[str, str, float]]:
    """``routing.canaries`` as the router takes them."""
    return {c.model: (c.stable_pool, c.canary_pool, c.canary_weight) for c in cfg.routing.canaries}


class GatewayState:
    """Everything one running gateway holds; created at startup."""

    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        roles = {p.name: p.role for p in cfg.pools}
        self.fleet = Fleet([BackendSpec(b.name, frozenset(b.models), b.pool, b.weight, roles[b.pool],
                                        b.hints.prefill_tokens_per_s, b.hints.decode_tokens_per_s,
                                        b.hints.kv_capacity_tokens) for b in cfg.backends])
        r = cfg.routing
        self.estimator = TokenEstimator(block_tokens=r.block_tokens)
        index = PrefixIndex(ttl_s=r.prefix_ttl_s, max_blocks=r.prefix_index_max_blocks)
        st = cfg.state
        if st.url:
            self.store: InProcessStore | RedisStore = RedisStore(
                self.fleet, index, st.url, namespace=st.namespace, staleness_s=st.staleness_s, lease_s=st.lease_s,
                timeout_s=st.timeout_s, prefix_stream_maxlen=st.prefix_stream_maxlen, cluster=st.cluster)
        else:
            self.store = InProcessStore()
        self.router = Router(self.fleet, make_policy(r.policy), index, block_tokens=r.block_tokens,
                             store=self.store if st.url else None)
        self.router.set_canaries(canary_splits(cfg))
        self.metrics = GatewayMetrics(self.fleet, self.store, index)
        self.metrics.build_info.labels(_version(), r.policy).set(1)
        self.clients: dict[str, BackendClient] = {}
        self.proxy: Proxy | None = None
        self.health: HealthChecker | None = None
        self.scraper: MetricsScraper | None = None
        self.created = int(time.time())
        init_hardening(self, cfg)  # keys, limits, admission, breakers, reload (gateway/reload.py)
        self.metrics.registry.register(HardeningCollector(self))


def create_app(cfg: GatewayConfig, backend_urls: dict[str, str] | None = None,
               config_path: str | None = None) -> web.Application:
    """Build the gateway application.

    ``backend_urls`` overrides backends' base URLs by name (used when simulated demo
    backends were started elsewhere). Simulated backends without a URL are started as
    a child process at startup. ``config_path`` (the file ``cfg`` came from) enables
    reloading it (SIGHUP, file watch, ``POST /admin/reload``).
    """
    app = web.Application(client_max_size=cfg.limits.max_body_bytes, middlewares=[_middleware, auth_middleware])
    app[CONFIG] = cfg
    state = GatewayState(cfg)
    state.config_path = config_path
    app[STATE] = state
    app.cleanup_ctx.append(_lifecycle(backend_urls or {}))
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model:.+}", _model)
    app.router.add_get("/health", _health)
    app.router.add_get("/ready", _ready)
    app.router.add_get("/metrics", _metrics)
    setup_admin(app)
    setup_batch(app, cfg)
    return app


def _lifecycle(backend_urls: dict[str, str]):
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        state = app[STATE]
        cfg = state.cfg
        urls = dict(backend_urls)
        demo = None
        to_simulate = [b for b in cfg.backends if b.simulate and b.name not in urls]
        if to_simulate:
            demo = await DemoFleet.start(to_simulate)
            urls.update(demo.urls)
            log.info("started simulated demo fleet: %s", ", ".join(f"{k}={v}" for k, v in demo.urls.items()))
        sessions: list[aiohttp.ClientSession] = []
        state.urls, state.sessions_list = urls, sessions
        for b in cfg.backends:
            t = cfg.timeouts_for(b)
            session = make_session(cfg, b)
            sessions.append(session)
            auth = f"Bearer {os.environ[b.api_key_env]}" if b.api_key_env else None
            state.clients[b.name] = BackendClient(state.fleet.backends[b.name], urls.get(b.name) or b.url or "",
                                                  session, t, auth)
        state.proxy = Proxy(cfg, state.router, state.clients, state.metrics, state.estimator)
        paths = {b.name: b.health_path or cfg.health.path for b in cfg.backends}
        state.health = HealthChecker(cfg.health, state.clients.values(), paths)
        await state.health.check_all()
        await state.store.start()  # loads the shared view before serving (bounded wait)
        tasks = [asyncio.create_task(state.health.run())]
        state.tasks_list = tasks
        if state.config_path is not None:
            import hashlib
            try:
                with open(state.config_path, "rb") as f:
                    state.config_digest = hashlib.sha256(f.read()).digest()
            except OSError:
                pass
            tasks.append(asyncio.create_task(watch_config(app)))
        if cfg.state.url:
            from gateway.limits import LimiterSync
            st = cfg.state
            state.limiter_sync = LimiterSync(state.limiter, st.url, namespace=st.namespace,
                                             interval_s=st.staleness_s / 2, lease_s=st.lease_s,
                                             timeout_s=st.timeout_s, cluster=st.cluster)
            await state.limiter_sync.start()
        if cfg.routing.scrape_interval_s > 0:
            state.scraper = MetricsScraper(state.router, state.clients, cfg.routing.scrape_interval_s)
            tasks.append(asyncio.create_task(state.scraper.run()))
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            if tasks:  # bounded: a task that missed its cancel must not hang the shutdown
                _, pending = await asyncio.wait(tasks, timeout=5.0)
                for t in pending:
                    log.warning("background task %s did not stop within 5 s of its cancel", t.get_name())
            await state.store.stop()
            if state.limiter_sync is not None:
                await state.limiter_sync.stop()
            for s in sessions:
                await s.close()
            for c in state.clients.values():
                c.pool.close()
            if demo is not None:
                await demo.stop()

    return ctx


@web.middleware
async def _middleware(request: web.Request, handler) -> web.StreamResponse:
    rid = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
    request[REQUEST_ID] = rid
    try:
        resp = await handler(request)
    except ClientError as e:
        resp = e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        messages = {404: f"Unknown route {request.method} {request.path}.",
                    405: f"Method {request.method} is not allowed on {request.path}.",
                    413: "Request body too large."}
        headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        resp = error_response(messages.get(e.status, e.reason), e.status, headers=headers)
    except (asyncio.CancelledError, ClientGone):
        raise
    except Exception:
        log.exception("unhandled error on %s %s (request %s)", request.method, request.path, rid)
        resp = error_response("The gateway hit an internal error.", 500, code="internal_error")
    if not resp.prepared:
        resp.headers[REQUEST_ID_HEADER] = rid
    return resp


async def _completion(request: web.Request, endpoint: str) -> web.StreamResponse:
    arrival = asyncio.get_running_loop().time()
    state = request.app[STATE]
    body, data = await read_json_body(request, state.cfg.limits.max_body_bytes)
    down = AiohttpDownstream(request)
    await complete(state, endpoint, body, data, request.get(CALLER) or state.keyring.anonymous, request[REQUEST_ID],
                   down, arrival)
    return down.response or web.Response(status=499)


async def complete(state: GatewayState, endpoint: str, body: bytes, data: dict, caller: Any, request_id: str,
                   down: Any, arrival: float) -> None:
    """Serve one completion whose JSON body was read: validate it, apply the caller's
    limits and admission, and forward it; the answer goes to ``down`` (see
    :mod:`gateway.downstream`). Raises :class:`ClientError` (4xx) before any byte was
    sent, and :class:`ClientGone` / ``CancelledError`` when the client left."""
    parsed = parse_completion_request(endpoint, body, data)
    try:
        state.fleet.candidates(parsed.model)
    except UnknownModel as e:
        raise ClientError(404, str(e), param="model", code="model_not_found") from None
    key = caller.key
    est = 0.0
    if key is not None and key.tokens_per_minute is not None:
        est = len(parsed.prompt_text) / state.estimator.stats(parsed.model).bytes_per_token + (parsed.max_tokens or 0)
    permit = state.limiter.acquire(key, est)  # 429 when over a per-key limit (gateway/limits.py)
    ex = Exchange(down, parsed, request_id, arrival)
    try:
        await state.admission.admit(parsed.model, caller.name, caller.priority)
        assert state.proxy is not None
        try:
            await state.proxy.forward(ex)
        except ClientGone:
            pass
    finally:
        permit.release(ex.tokens, dispatched=bool(ex.attempts))
        state.admission.pump()


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _completion(request, "chat")


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, "completions")


async def _models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.Response(body=orjson.dumps(models_list(state.fleet.models(), state.created)),
                        content_type="application/json")


async def _model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = request.match_info["model"]
    if name not in state.fleet.by_model:
        raise ClientError(404, f"The model `{name}` does not exist or is not served by this gateway.",
                          param="model", code="model_not_found")
    return web.Response(body=orjson.dumps(models_list([name], state.created)["data"][0]),
                        content_type="application/json")


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _ready(request: web.Request) -> web.Response:
    state = request.app[STATE]
    up = sorted(b.name for b in state.fleet.backends.values() if b.healthy)
    if state.health is not None and state.health.ready():
        return web.json_response({"status": "ready", "healthy_backends": up})
    return web.json_response({"status": "not ready", "healthy_backends": up}, status=503)


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[STATE].metrics.render(),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
