"""OpenAI's Conversations API, kept by the gateway in the fleet's store
(:mod:`gateway.store.responses`) under the caller's key name, as the openai SDK's
``client.conversations`` calls it:

- ``POST /v1/conversations`` (``items``: at most 20 input items, ``metadata``): a new
  conversation ``{"id": "conv_...", "object": "conversation", "created_at", "metadata"}``;
- ``GET``, ``POST`` (``metadata``) and ``DELETE /v1/conversations/{id}``;
- ``GET /v1/conversations/{id}/items`` (``order``, ``limit``, ``after``), ``POST`` (at
  most 20 ``items``), and ``GET``, ``DELETE /v1/conversations/{id}/items/{item_id}``.

A Responses request naming the conversation (``conversation``) gets its items before
its own input, and its input and output items appended once answered
(:mod:`gateway.pipeline.conversation`). Errors: 400 (a bad field), 404 (no such
conversation or item of the caller's), 503 (the store did not answer).
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from gateway.errors import ClientError
from gateway.pipeline.conversation import with_ids
from gateway.server.stored_responses import Call, Handler, page, stored

MAX_ITEMS = 20  # items one call may add (OpenAI's bound)
MAX_METADATA = 16  # metadata keys (OpenAI's bound)
_ROLES = ("user", "assistant", "system", "developer")


def _metadata(body: dict[str, Any]) -> dict[str, str]:
    meta = body.get("metadata")
    if meta is None:
        return {}
    if not isinstance(meta, dict) or len(meta) > MAX_METADATA or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in meta.items()):
        raise ClientError(400, f"`metadata` must be an object of at most {MAX_METADATA} string values (keys of at "
                               "most 64 characters, values of at most 512).", param="metadata", code="invalid_value")
    return meta


def _items(body: dict[str, Any], required: bool) -> list[dict[str, Any]]:
    items = body.get("items")
    if items is None and not required:
        return []
    if not isinstance(items, list) or (required and not items) or len(items) > MAX_ITEMS:
        raise ClientError(400, f"`items` must be an array of 1 to {MAX_ITEMS} input items.", param="items",
                          code="invalid_value" if "items" in body else "missing_required_parameter")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ClientError(400, f"`items[{i}]` must be an object.", param=f"items[{i}]", code="invalid_type")
        if item.get("type", "message") == "message" and (
                item.get("role") not in _ROLES or not isinstance(item.get("content"), (str, list))):
            raise ClientError(400, f"`items[{i}]`: a message needs a `role` ({', '.join(_ROLES)}) and a string or "
                                   "array `content`.", param=f"items[{i}]", code="invalid_value")
    return with_ids(items)


async def _conversation(call: Call) -> dict[str, Any]:
    cid = call.params["id"]
    found = await stored(lambda: call.state.responses.conversation(call.owner, cid))
    if found is None:
        raise ClientError(404, f"Conversation with id '{cid}' not found.", code="conversation_not_found")
    return found


async def _create(call: Call) -> Any:
    body = call.json()
    meta, items = _metadata(body), _items(body, required=False)
    cid = "conv_" + secrets.token_hex(24)
    obj = {"id": cid, "object": "conversation", "created_at": int(time.time()), "metadata": meta}
    store = call.state.responses
    store.put_conversation(call.owner, cid, obj)
    if not store.append_items(call.owner, cid, items):
        raise ClientError(400, "An item is larger than responses.max_record_bytes.", param="items",
                          code="invalid_value")
    return obj


async def _get(call: Call) -> Any:
    return await _conversation(call)


async def _update(call: Call) -> Any:
    body = call.json()
    if "metadata" not in body:
        raise ClientError(400, "`metadata` is required.", param="metadata", code="missing_required_parameter")
    obj = {**await _conversation(call), "metadata": _metadata(body)}
    call.state.responses.put_conversation(call.owner, obj["id"], obj)
    return obj


async def _delete(call: Call) -> Any:
    cid = call.params["id"]
    if not await stored(lambda: call.state.responses.delete_conversation(call.owner, cid)):
        raise ClientError(404, f"Conversation with id '{cid}' not found.", code="conversation_not_found")
    return {"id": cid, "object": "conversation.deleted", "deleted": True}


async def _all_items(call: Call) -> list[dict[str, Any]]:
    await _conversation(call)
    return await stored(lambda: call.state.responses.items(call.owner, call.params["id"]))


async def _list_items(call: Call) -> Any:
    return page(await _all_items(call), call.query)


async def _add_items(call: Call) -> Any:
    items = _items(call.json(), required=True)
    await _conversation(call)
    if not call.state.responses.append_items(call.owner, call.params["id"], items):
        raise ClientError(400, "An item is larger than responses.max_record_bytes.", param="items",
                          code="invalid_value")
    return {"object": "list", "data": items, "first_id": items[0]["id"], "last_id": items[-1]["id"],
            "has_more": False}


async def _item(call: Call) -> dict[str, Any]:
    iid = call.params["item_id"]
    for item in await _all_items(call):
        if item.get("id") == iid:
            return item
    raise ClientError(404, f"Item with id '{iid}' not found.", code="item_not_found")


async def _get_item(call: Call) -> Any:
    return await _item(call)


async def _delete_item(call: Call) -> Any:
    item = await _item(call)
    if not await stored(lambda: call.state.responses.remove_item(call.owner, call.params["id"], item)):
        raise ClientError(404, f"Item with id '{call.params['item_id']}' not found.", code="item_not_found")
    return await _conversation(call)


ROUTES: list[tuple[str, str, Handler]] = [
    ("POST", "/v1/conversations", _create),
    ("GET", "/v1/conversations/{id}", _get),
    ("POST", "/v1/conversations/{id}", _update),
    ("DELETE", "/v1/conversations/{id}", _delete),
    ("GET", "/v1/conversations/{id}/items", _list_items),
    ("POST", "/v1/conversations/{id}/items", _add_items),
    ("GET", "/v1/conversations/{id}/items/{item_id}", _get_item),
    ("DELETE", "/v1/conversations/{id}/items/{item_id}", _delete_item),
]
