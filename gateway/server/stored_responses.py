"""The Responses API's routes on a stored response, answered by the gateway from the
fleet's store (:mod:`gateway.store.responses`), never by an engine:

- ``GET /v1/responses/{id}``: the response object;
- ``DELETE /v1/responses/{id}``: ``{"id", "object": "response", "deleted": true}``;
- ``GET /v1/responses/{id}/input_items``: the input it answered (the previous turns
  included), as a list (``order`` ``asc`` or ``desc``, ``limit`` 1-100, ``after``);
- ``POST /v1/responses/{id}/cancel``: 400, as for any response not run in the
  background (this gateway runs none).

A caller sees only the responses made with its own key (404 for any other); a store
that does not answer gives 503.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from gateway.errors import ClientError
from gateway.pipeline.conversation import unavailable
from gateway.runtime import STATE
from gateway.store.responses import StoreUnavailable
from gateway.tenancy.keys import ANONYMOUS, CALLER


def setup(app: web.Application) -> None:
    app.router.add_get("/v1/responses/{id}", _get)
    app.router.add_delete("/v1/responses/{id}", _delete)
    app.router.add_get("/v1/responses/{id}/input_items", _input_items)
    app.router.add_post("/v1/responses/{id}/cancel", _cancel)


def _json(obj: Any) -> web.Response:
    return web.Response(body=orjson.dumps(obj), content_type="application/json")


def _owner(request: web.Request) -> str:
    caller = request.get(CALLER)
    return caller.name if caller is not None else ANONYMOUS


async def _record(request: web.Request) -> tuple[str, dict[str, Any]]:
    rid = request.match_info["id"]
    try:
        record = await request.app[STATE].responses.get(_owner(request), rid)
    except StoreUnavailable as e:
        raise unavailable(e) from None
    if record is None:
        raise ClientError(404, f"No response found with id '{rid}'.", code="response_not_found")
    return rid, record


async def _get(request: web.Request) -> web.Response:
    _, record = await _record(request)
    return _json(record.get("response"))


async def _delete(request: web.Request) -> web.Response:
    rid = request.match_info["id"]
    try:
        found = await request.app[STATE].responses.delete(_owner(request), rid)
    except StoreUnavailable as e:
        raise unavailable(e) from None
    if not found:
        raise ClientError(404, f"No response found with id '{rid}'.", code="response_not_found")
    return _json({"id": rid, "object": "response", "deleted": True})


async def _input_items(request: web.Request) -> web.Response:
    rid, record = await _record(request)
    q = request.query
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ClientError(400, "`order` must be `asc` or `desc`.", param="order", code="invalid_value")
    limit_text = q.get("limit", "20")
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= 100:
        raise ClientError(400, "`limit` must be an integer from 1 to 100.", param="limit", code="invalid_value")
    items = [{**item, "id": item.get("id") or f"{rid}_input_{i}"} if isinstance(item, dict) else item
             for i, item in enumerate(record.get("input", ()))]
    if order == "desc":
        items.reverse()
    after = q.get("after")
    if after is not None:
        ids = [i.get("id") for i in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:int(limit_text)]
    return _json({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                  "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)})


async def _cancel(request: web.Request) -> web.Response:
    await _record(request)
    raise ClientError(400, "Only responses created with background=true can be cancelled; this gateway runs none "
                           "in the background.", code="not_background")
