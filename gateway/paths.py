"""One reading of a request's path for every stack: the lean protocol (which serves
only the exact completion paths and hands every other one to aiohttp), the aiohttp
app (:func:`canonical_routing`) and the endpoint picker.

Engines route on a decoded, cleaned path (uvicorn percent-decodes, ``%2F`` included),
so a gateway that matched the raw bytes would let ``/v1/chat%2Fcompletions`` or
``/v1//completions/`` past its front door to a generating engine. Every stack matches
on :func:`canonical_path` instead, and the endpoint picker forwards that path, so an
engine sees exactly what was matched.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

from aiohttp import web
from yarl import URL

CANONICAL_PATH = web.RequestKey("canonical_path", str)


def canonical_path(target: str) -> str:
    """The path of request target ``target`` (query dropped) as it is matched:
    percent-decoded once, ``.`` and ``..`` segments resolved, runs of ``/`` merged and
    a trailing ``/`` dropped (``/`` stays ``/``). A plain path is returned as it is."""
    path = target.split("?", 1)[0]
    if "%" in path:
        path = unquote(path, errors="surrogateescape")
    if "//" not in path and "/." not in path and (len(path) < 2 or path[-1] != "/") and path.startswith("/"):
        return path
    out: list[str] = []
    for seg in path.split("/"):
        if seg in ("", "."):
            continue
        if seg == "..":
            if out:
                out.pop()
            continue
        out.append(seg)
    return "/" + "/".join(out)


def canonical_routing(app: web.Application) -> None:
    """Make ``app``'s router match every request on its :func:`canonical_path`, which
    handlers and middleware read as ``request[CANONICAL_PATH]``."""
    router = app.router
    resolve = router.resolve

    async def canonical_resolve(request: web.Request) -> Any:
        path = canonical_path(request.raw_path)
        request[CANONICAL_PATH] = path
        if path != request.rel_url.path_safe:
            request = request.clone(rel_url=URL.build(path=path, query_string=request.rel_url.query_string))
        return await resolve(request)

    router.resolve = canonical_resolve  # type: ignore[method-assign]
