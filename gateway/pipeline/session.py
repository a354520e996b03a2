"""Naming a request's session: which requests are turns of one conversation or agent loop.

A session's turns go to the backend holding its KV cache (:mod:`routing.sessions`). What
names the session, the first that a request carries:

1. a Responses turn's ``previous_response_id``: the session of the turn it continues,
   kept in that turn's stored record (:mod:`gateway.pipeline.conversation`; a stored
   turn that named none starts one); or its ``conversation``: that conversation's
   session (:func:`of_conversation`);
2. the API's own session field (:attr:`gateway.apis.base.Api.session_field`: OpenAI's
   ``prompt_cache_key``);
3. the ``sessions.header`` request header (``x-session-id`` by default);
4. the ``sessions.body_field`` body field;
5. with ``sessions.key_user``, the API's end-user field (:attr:`~gateway.apis.base.Api.user_field`).

Whatever names it, the session id the router sees is a digest of the caller's key name
and that value (:func:`scoped`): two keys sending the same value have two sessions, so
no caller can steer into, or learn the placement of, another key's session. This step
is the same for every API; an adapter only says where its fields are.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping
from typing import Any

from gateway.apis.base import Api
from gateway.config import Sessions


def scoped(key_name: str, value: str) -> str:
    """The session id of ``value`` for the key called ``key_name``: 32 hex digits of the
    SHA-256 of both (so a key's sessions are its own)."""
    return hashlib.sha256(f"{len(key_name)}:{key_name}\0{value}".encode()).hexdigest()[:32]


def started(key_name: str) -> str:
    """A new session id for the key called ``key_name`` (a stored conversation's first
    turn that no other field named)."""
    return scoped(key_name, "conversation:" + secrets.token_hex(16))


def of_conversation(key_name: str, conversation_id: str) -> str:
    """The session of the conversation ``conversation_id`` of the key called
    ``key_name``: every turn of it, on any replica, is one session."""
    return scoped(key_name, "conversation-id:" + conversation_id)


def field(data: dict[str, Any], path: str) -> str | None:
    """The non-empty string at dotted ``path`` in ``data``, or ``None``."""
    v: Any = data
    for part in path.split("."):
        if not isinstance(v, dict):
            return None
        v = v.get(part)
    return v if isinstance(v, str) and v else None


def session_of(cfg: Sessions, api: Api, data: dict[str, Any], headers: Mapping[str, str],
               key_name: str) -> str | None:
    """The session id request ``data`` of ``api`` names (with ``headers``) for the key
    called ``key_name``, by the rules 2 to 5 of the module docstring, or ``None``. The
    previous response's session (rule 1) is set when the conversation is expanded."""
    if not cfg.enabled:
        return None
    value = field(data, api.session_field) if api.session_field else None
    if value is None and cfg.header is not None:
        value = headers.get(cfg.header) or None
    if value is None and cfg.body_field is not None:
        value = field(data, cfg.body_field)
    if value is None and cfg.key_user and api.user_field:
        user = field(data, api.user_field)
        value = None if user is None else "user:" + user
    return None if value is None else scoped(key_name, value)
