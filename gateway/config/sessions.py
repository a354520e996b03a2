"""Sessions: ``sessions`` (:mod:`gateway.pipeline.session`, :mod:`routing.sessions`)."""

from __future__ import annotations

from pydantic import Field

from gateway.config.base import Strict


class Sessions(Strict):
    """Which requests are turns of one session, and how long a session's home is kept.
    A session's next turn goes to the backend holding its KV cache (its home) unless the
    estimate says moving is cheaper; with `state.url` set every replica shares the homes
    and they outlive a restart. A session id is always scoped by the caller's key: one
    key can never address another key's session."""

    enabled: bool = Field(
        True, description="Name sessions and keep their homes. Off: no request has a session and routing is "
        "as without them.")
    header: str | None = Field(
        "x-session-id", min_length=1, pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$",
        description="A request header whose value names the session (after a Responses turn's "
        "`previous_response_id` and the API's own field, OpenAI's `prompt_cache_key`). Unset: none.")
    body_field: str | None = Field(
        None, min_length=1, pattern=r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$",
        description="A request body field whose string value names the session, after the header; a dotted "
        "path reaches into objects (`metadata.session_id`). Unset: none.")
    key_user: bool = Field(
        False, description="When nothing else names a session, the caller's key plus the request's end-user "
        "field (OpenAI's `user`, Anthropic's `metadata.user_id`) does: every request of one user of one key is "
        "one session.")
    ttl_s: float = Field(
        1800.0, gt=0, description="The longest a waiting session is kept (then its next turn is placed as new). "
        "How long it is kept is learned from the gaps between sessions' turns (docs/sessions.md); this is its "
        "cap, and the time kept until enough gaps were seen.")
    max_sessions: int = Field(
        100_000, ge=1, description="Sessions held per replica; the least recently seen one leaves first.")
