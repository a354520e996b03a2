"""The aiohttp application: routes, middleware and lifecycle.

:func:`create_app` builds the app from a :class:`~gateway.config.GatewayConfig` and its
state (:func:`gateway.runtime.build_state`); handlers are thin. Completion requests go
to the front door both server stacks share, :func:`gateway.pipeline.director.handle`;
the middleware gives every other route its request id and OpenAI error answers.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
from aiohttp import web

from gateway.apis.base import Api
from gateway.apis.registry import BY_PATH
from gateway.batch import setup_batch
from gateway.config import GatewayConfig
from gateway.errors import REQUEST_ID_HEADER, ClientError, error_response, unknown_route
from gateway.ops import access_log
from gateway.ops.admin import auth_middleware, setup_admin
from gateway.ops.config_reload import watch_config
from gateway.ops.demo_fleet import DemoFleet, DemoFleetError, simulated_kv_sources
from gateway.paths import CANONICAL_PATH, canonical_routing
from gateway.pipeline import background, director
from gateway.pipeline.downstream import AiohttpDownstream, ClientGone
from gateway.pipeline.openai_request import model_card, models_list, read_body
from gateway.request_ids import REQUEST_ID, request_id
from gateway.runtime import (
    OWN_MIDDLEWARES,
    STATE,
    build_state,
    configure,
    connect,
    limiter_sync,
    session_sync,
    usage_sync,
)
from gateway.server import stored_routes
from gateway.tenancy.keys import CALLER

log = logging.getLogger("gateway")



def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("turbo-gateway")
    except PackageNotFoundError:
        return "unknown"


def create_app(cfg: GatewayConfig, backend_urls: dict[str, str] | None = None,
               config_path: str | None = None) -> web.Application:
    """Build the gateway application.

    ``backend_urls`` overrides backends' base URLs by name (used when simulated demo
    backends were started elsewhere). Simulated backends without a URL are started as
    a child process at startup. ``config_path`` (the file ``cfg`` came from) enables
    reloading it (SIGHUP, file watch, ``POST /admin/reload``).
    """
    app = web.Application(client_max_size=cfg.limits.max_body_bytes, middlewares=[_middleware, auth_middleware])
    app[OWN_MIDDLEWARES] = tuple(app.middlewares)
    canonical_routing(app)  # routes match the normalised path, as every stack matches it (gateway/paths.py)
    app[STATE] = build_state(cfg, config_path, _version())
    app.cleanup_ctx.append(_lifecycle(backend_urls or {}))
    app.on_response_prepare.append(_server_header)
    for path, api in BY_PATH.items():  # every API the gateway serves (gateway/apis/registry.py)
        app.router.add_post(path, _served(api))
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model:.+}", _model)
    app.router.add_get("/health", _health)
    app.router.add_get("/ready", _ready)
    app.router.add_get("/metrics", _metrics)
    stored_routes.setup(app)
    setup_admin(app)
    setup_batch(app, cfg)
    return app


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    # the name the lean protocol's responses carry (gateway/server/fast_path.py), not aiohttp's
    response.headers["Server"] = "turbo-gateway"


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
        try:
            state.kv_sources = await simulated_kv_sources(cfg.backends, urls)
        except DemoFleetError:
            if demo is not None:
                await demo.stop()
            raise
        if state.kv_sources:
            configure(state, cfg)  # with the simulated backends' KV events wired in
        connect(state, urls)
        if cfg.tracing.enabled:
            from gateway.ops import tracing  # OpenTelemetry loads only when tracing is on

            state.tracer = tracing.start(cfg.tracing, state.loop, _version())
        assert state.health is not None
        await state.health.check_all()
        await state.store.start()  # loads the shared view before serving (bounded wait)
        state.session_sync = session_sync(state)
        if state.session_sync is not None:  # and the sessions' homes (bounded wait)
            await state.session_sync.start()
        tasks = state.tasks
        tasks.append(asyncio.create_task(state.health.run()))
        if state.config_path is not None:
            try:
                with open(state.config_path, "rb") as f:  # noqa: ASYNC230 - once at start, a small local file
                    state.config_digest = hashlib.sha256(f.read()).digest()
            except OSError:
                pass
            tasks.append(asyncio.create_task(watch_config(app)))
        state.limiter_sync = limiter_sync(state)
        if state.limiter_sync is not None:
            await state.limiter_sync.start()
        state.usage_sync = usage_sync(state)
        if state.usage_sync is not None:
            await state.usage_sync.start()
        if state.scraper is not None:
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
            if state.session_sync is not None:
                await state.session_sync.stop()
            if state.kv_events is not None:
                await state.kv_events.stop()
            if state.limiter_sync is not None:
                await state.limiter_sync.stop()
            if state.usage_sync is not None:
                await state.usage_sync.stop()
            for s in state.sessions:
                await s.close()
            for c in state.clients.values():
                c.pool.close()
            if demo is not None:
                await demo.stop()
            if state.tracer is not None:  # the spans still buffered are exported
                await state.tracer.shutdown()
                state.tracer = None
            await background.stop(state)  # its runs marked failed before the store closes
            await state.responses.close()

    return ctx


@web.middleware
async def _middleware(request: web.Request, handler) -> web.StreamResponse:
    rid = request[REQUEST_ID] = request_id(request.headers)
    try:
        resp = await handler(request)
    except ClientError as e:
        resp = e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        if e.status == 404:
            resp = unknown_route(request.method, request.path).response()
        else:
            messages = {405: f"Method {request.method} is not allowed on {request.path}.",
                        413: "Request body too large."}
            headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
            resp = error_response(messages.get(e.status, e.reason), e.status, headers=headers)
    except (asyncio.CancelledError, ClientGone):
        raise
    except Exception:
        log.exception("unhandled error on %s %s (request %s)", request.method, request.path, rid)
        resp = error_response("The gateway hit an internal error.", 500, code="internal_error")
    # a completion's line is written when it is settled, or refused on its head (the auth middleware)
    if request.method != "POST" or request.get(CANONICAL_PATH, request.path) not in BY_PATH:
        access_log.route(rid, request.method, request.path, resp.status)
    return _with_id(resp, rid)


def _with_id(resp: web.StreamResponse, rid: str) -> web.StreamResponse:
    if not resp.prepared:
        resp.headers[REQUEST_ID_HEADER] = rid
    return resp


def _served(api: Api) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The route handler of ``api``: :func:`_handle` for that API."""
    async def handler(request: web.Request) -> web.StreamResponse:
        return await _handle(request, api)
    return handler


async def _handle(request: web.Request, api: Api) -> web.StreamResponse:
    """A request of ``api``: to the director, its body read when the director asks."""
    arrival = asyncio.get_running_loop().time()
    state = request.app[STATE]
    max_bytes = state.cfg.limits.max_body_bytes

    def body() -> Awaitable[bytes]:
        return read_body(request, max_bytes)

    down = AiohttpDownstream(request)
    await director.handle(state, api, request.headers, body, down, arrival, request[REQUEST_ID],
                          caller=request.get(CALLER))
    return down.response or web.Response(status=499)


async def _models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    fleet = state.fleet
    return web.Response(body=orjson.dumps(models_list([fleet.describe(m) for m in fleet.models()], state.created)),
                        content_type="application/json")


async def _model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = request.match_info["model"]
    if name not in state.fleet.by_model:
        raise ClientError(404, f"The model `{name}` does not exist or is not served by this gateway.",
                          param="model", code="model_not_found")
    return web.Response(body=orjson.dumps(model_card(state.fleet.describe(name), state.created)),
                        content_type="application/json")


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def degraded(app: web.Application) -> dict[str, str]:
    """Features that cannot work now though completions can, each with the reason:
    ``batch`` (the Files and Batches API's Redis unreachable) and ``shared_state``
    (``state.url`` unreachable: this replica routes on its own view)."""
    from gateway.batch.batch_runtime import BATCH

    out: dict[str, str] = {}
    state = app[STATE]
    if state.cfg.state.url is not None and not state.store.stats.up:
        out["shared_state"] = "the shared state store (state.url) is unreachable; routing on this replica's view"
    rt = app.get(BATCH)
    if rt is not None and rt.manager.store_error is not None:
        out["batch"] = f"the batch store (Redis) is unreachable ({rt.manager.store_error})"
    return out


async def _ready(request: web.Request) -> web.Response:
    """200 when a backend passed its last health check: ``healthy_backends`` names those,
    ``backends`` says each one's health in words."""
    state = request.app[STATE]
    health = state.health
    names = sorted(state.fleet.backends)
    up = [n for n in names if health is not None and health.passing(n)]
    body: dict[str, object] = {"status": "ready", "healthy_backends": up,
                               "backends": {n: health.describe(n) if health is not None else "not checked yet"
                                            for n in names}}
    ready = health is not None and health.ready()
    if not ready:
        body["status"] = "not ready"
        body["reason"] = "no backend passed its last health check"
    lame = degraded(request.app)
    if lame:
        body["degraded"] = lame
    return web.json_response(body, status=200 if ready else 503)


async def _metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[STATE].metrics.exposition(request.headers.get("Accept", ""))
    return web.Response(body=body, headers={"Content-Type": content_type})
