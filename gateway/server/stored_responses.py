"""The Responses API's routes on a stored response, answered from the fleet's store
(:mod:`gateway.store.responses`), never by an engine, and what every stored route
shares (:class:`Call`, :func:`page`); :mod:`gateway.server.stored_routes` serves them:

- ``GET /v1/responses/{id}``: the response object (a background one's current status);
- ``DELETE /v1/responses/{id}``: ``{"id", "object": "response", "deleted": true}``;
- ``GET /v1/responses/{id}/input_items``: the input it answered (the previous turns
  included), as a list (``order`` ``asc`` or ``desc``, ``limit`` 1-100, ``after``);
- ``POST /v1/responses/{id}/cancel``: a background response cancelled
  (:mod:`gateway.pipeline.background`); 400 for any other.

A caller sees only what was made with its own key (404 for any other); a store that
does not answer gives 503. Errors are OpenAI's shape.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.errors import ClientError
from gateway.pipeline import background
from gateway.pipeline.conversation import unavailable
from gateway.pipeline.openai_request import parse_json_object
from gateway.store.responses import StoreUnavailable

if TYPE_CHECKING:
    from gateway.runtime import GatewayState


@dataclass(slots=True)
class Call:
    """One call of a stored route: the gateway's state, the caller's key name
    (``owner``), the path's parameters, the query and the body."""

    state: GatewayState
    owner: str
    params: dict[str, str]
    query: Mapping[str, str]
    body: bytes = b""

    def json(self) -> dict[str, Any]:
        """The body as a JSON object (an empty body: ``{}``). Raises
        :class:`ClientError` 400."""
        return parse_json_object(self.body) if self.body.strip() else {}


Handler = Callable[[Call], Awaitable[Any]]


async def stored(get: Callable[[], Awaitable[Any]]) -> Any:
    """``await get()``, a store read: 503 when the store does not answer."""
    try:
        return await get()
    except StoreUnavailable as e:
        raise unavailable(e) from None


def page(items: list[Any], query: Mapping[str, str]) -> dict[str, Any]:
    """One page of ``items`` (oldest first, each with an ``id``) as OpenAI lists them:
    ``order`` (``desc`` by default), ``limit`` (1-100, 20 by default), ``after`` (an
    id). Raises :class:`ClientError` 400 on a bad parameter."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ClientError(400, "`order` must be `asc` or `desc`.", param="order", code="invalid_value")
    limit_text = query.get("limit", "20")
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= 100:
        raise ClientError(400, "`limit` must be an integer from 1 to 100.", param="limit", code="invalid_value")
    items = items[::-1] if order == "desc" else list(items)
    after = query.get("after")
    if after is not None:
        ids = [i.get("id") if isinstance(i, dict) else None for i in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    data = items[:int(limit_text)]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(items) > len(data)}


async def _record(call: Call) -> tuple[str, dict[str, Any]]:
    rid = call.params["id"]
    record = await stored(lambda: call.state.responses.get(call.owner, rid))
    if record is None:
        raise ClientError(404, f"No response found with id '{rid}'.", code="response_not_found")
    return rid, record


async def _get(call: Call) -> Any:
    _, record = await _record(call)
    return record.get("response")


async def _delete(call: Call) -> Any:
    rid = call.params["id"]
    if not await stored(lambda: call.state.responses.delete(call.owner, rid)):
        raise ClientError(404, f"No response found with id '{rid}'.", code="response_not_found")
    return {"id": rid, "object": "response", "deleted": True}


async def _input_items(call: Call) -> Any:
    rid, record = await _record(call)
    items = [{**item, "id": item.get("id") or f"{rid}_input_{i}"} if isinstance(item, dict) else item
             for i, item in enumerate(record.get("input", ()))]
    return page(items, call.query)


async def _cancel(call: Call) -> Any:
    rid, record = await _record(call)
    response = record.get("response") or {}
    if not response.get("background"):
        raise ClientError(400, "Only responses created with background=true can be cancelled.",
                          code="not_background")
    return await background.cancel(call.state, call.owner, rid, record)


ROUTES: list[tuple[str, str, Handler]] = [
    ("GET", "/v1/responses/{id}", _get), ("DELETE", "/v1/responses/{id}", _delete),
    ("GET", "/v1/responses/{id}/input_items", _input_items), ("POST", "/v1/responses/{id}/cancel", _cancel)]
