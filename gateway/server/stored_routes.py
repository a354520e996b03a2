"""Every route on what the gateway keeps (stored responses:
:mod:`gateway.server.stored_responses`; conversations: :mod:`gateway.server.conversations`),
served alike behind the gateway's own data plane (:func:`setup`, aiohttp) and behind
Envoy, where the endpoint picker answers them itself (:func:`find`). The caller is
authenticated first (401) by either; its key name owns what it reads and writes.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl

import orjson
from aiohttp import web

from gateway.errors import ClientError
from gateway.pipeline.openai_request import read_body
from gateway.runtime import STATE
from gateway.server import conversations, stored_responses
from gateway.server.stored_responses import Call, Handler
from gateway.tenancy.keys import ANONYMOUS, CALLER

if TYPE_CHECKING:
    from gateway.runtime import GatewayState

ROUTES = [*stored_responses.ROUTES, *conversations.ROUTES]  # (method, path pattern, handler)
_COMPILED = [(method, re.compile("^" + re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", pattern) + "$"), handler)
             for method, pattern, handler in ROUTES]


def find(method: str, path: str) -> tuple[Handler, dict[str, str]] | None:
    """The handler of ``method`` on (canonical) ``path`` and the path's parameters, or
    ``None`` when no stored route has that path. Raises :class:`ClientError` 405 when
    one has it for other methods."""
    allowed = []
    for m, rx, handler in _COMPILED:
        found = rx.match(path)
        if found is not None:
            if m == method:
                return handler, found.groupdict()
            allowed.append(m)
    if allowed:
        raise ClientError(405, f"Method {method} is not allowed on {path}.", headers={"Allow": ", ".join(allowed)})
    return None


async def call(state: GatewayState, route: tuple[Handler, dict[str, str]], owner: str, target: str,
               body: bytes) -> bytes:
    """The JSON answer of ``route`` (of :func:`find`) for ``owner``, whose request
    target (path and query) was ``target`` and body ``body``: how the endpoint picker
    serves a stored route. Raises :class:`ClientError`."""
    handler, params = route
    query = dict(parse_qsl(target.partition("?")[2], keep_blank_values=True))
    return orjson.dumps(await handler(Call(state, owner, params, query, body)))


def setup(app: web.Application) -> None:
    """Serve every stored route on ``app`` (the caller authenticated by the auth middleware)."""
    for method, pattern, handler in ROUTES:
        app.router.add_route(method, pattern, _aiohttp(handler))


def _aiohttp(handler: Handler) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def serve(request: web.Request) -> web.Response:
        state = request.app[STATE]
        caller = request.get(CALLER)
        body = await read_body(request, state.cfg.limits.max_body_bytes) if request.can_read_body else b""
        call = Call(state, caller.name if caller is not None else ANONYMOUS, dict(request.match_info),
                    request.query, body)
        return web.Response(body=orjson.dumps(await handler(call)), content_type="application/json")
    return serve
