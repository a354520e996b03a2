"""Client and admin API keys.

Keys are held only as SHA-256 digests (the config gives the digest, or names an
environment variable whose value is hashed at load and not kept). A presented
``Authorization: Bearer <key>`` is hashed and looked up by digest, and the stored
digest is compared with :func:`hmac.compare_digest`: the lookup's timing depends on the
hash of the caller's own input, never on how much of a stored key it matched.

Keys never appear in logs, metric labels or error bodies: everything downstream sees
only the key's configured ``name``.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from aiohttp import web

from gateway.config import ENGINE_FIELDS, Auth, ClientKey, Limits
from gateway.errors import ClientError, unknown_route

ANONYMOUS = "anonymous"
NO_KEY = b"not an ASCII bearer token"  # a digest no configured key has


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request: the key's ``name`` (``anonymous`` without keys), its limits
    and its admission priority and fair-share weight."""

    name: str
    key: ClientKey | None = None
    held_back: frozenset[str] = frozenset()  # body fields this caller may not set (limits.engine_fields)

    @property
    def priority(self) -> int:
        return self.key.priority if self.key is not None else 0

    @property
    def weight(self) -> float:
        return self.key.weight if self.key is not None else 1.0

    @property
    def route_details(self) -> bool:
        """Whether its answers carry ``x-turbo-route``'s cache details by its key's grant
        (``auth.keys[].route_details``); see :attr:`KeyRing.route_details_all`."""
        return self.key is not None and self.key.route_details

    @property
    def batch_priority(self) -> bool:
        """Whether its ``x-turbo-priority: batch`` is honoured: a key granted it
        (``auth.keys[].batch_priority``), or any caller when no keys are configured
        (every caller is then the same anonymous one)."""
        return self.key.batch_priority if self.key is not None else self.name == ANONYMOUS


CALLER = web.RequestKey("caller", Caller)  # the authenticated Caller of a /v1/ request (aiohttp routes)


def bearer_digest(headers) -> bytes | None:
    """SHA-256 of the bearer token in ``headers`` (a case-insensitive mapping), or
    ``None`` when the header is absent or not a bearer token."""
    return _digest(headers.get("Authorization"))


def _digest(header: str | None) -> bytes | None:
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    if not token.isascii():
        # A bearer token is ASCII (RFC 6750). The stacks decode a header's other bytes
        # differently (aiohttp UTF-8, the lean protocol latin-1, gRPC UTF-8 with
        # replacement), so such a token matches no key on any of them.
        return NO_KEY
    return hashlib.sha256(token.encode()).digest()


class KeyRing:
    """The configured client keys, by digest."""

    def __init__(self, cfg: Auth, limits: Limits | None = None) -> None:
        held = frozenset(limits.engine_fields if limits is not None else ENGINE_FIELDS)
        self.by_digest: dict[bytes, ClientKey] = {k.digest(): k for k in cfg.keys}
        # digest -> (that digest, its caller), built once: a request allocates nothing here
        self.callers: dict[bytes, tuple[bytes, Caller]] = {d: (d, Caller(k.name, k, held - set(k.engine_fields)))
                                                           for d, k in self.by_digest.items()}
        self.by_name: dict[str, Caller] = {c.name: c for _, c in self.callers.values()}
        self.anonymous = Caller(ANONYMOUS, None, held)
        self.strip = limits is not None and limits.engine_fields_action == "strip"
        # x-turbo-route's cache details for every caller: one tenant (no keys), or told so
        self.route_details_all = not cfg.keys or cfg.route_details == "everyone"
        # auth.cache_isolation per_key: each key's cache_salt, from its name (stable across key rotation)
        self.isolate = bool(cfg.keys) and cfg.cache_isolation == "per_key"
        self._salts: dict[str, str] = {}

    def cache_salt(self, name: str) -> str:
        """The ``cache_salt`` of key ``name`` under ``auth.cache_isolation: per_key``:
        derived from the name (stable across a key's rotation), cached."""
        salt = self._salts.get(name)
        if salt is None:
            salt = self._salts[name] = hashlib.sha256(f"turbo-gateway cache_salt\0{name}".encode()).hexdigest()[:32]
        return salt

    def named(self, name: str) -> Caller:
        """The caller of the key called ``name`` (a batch's owner, whose lines are
        served in process): its limits, priority and engine fields; a name no
        configured key has any more is a caller without limits, still counted under
        that name."""
        found = self.by_name.get(name)
        if found is not None:
            return found
        return self.anonymous if name == ANONYMOUS else Caller(name, None, self.anonymous.held_back)

    @property
    def enabled(self) -> bool:
        return bool(self.by_digest)

    def authenticate(self, headers) -> Caller:
        """The caller of a request with ``headers`` (a case-insensitive mapping): its
        key is ``Authorization: Bearer KEY``, else ``x-api-key: KEY`` (how the
        anthropic SDK sends it). Raises :class:`ClientError` 401 when keys are
        configured and the request carries none or an unknown one."""
        if not self.by_digest:
            return self.anonymous
        authorization = headers.get("Authorization")
        if authorization is None:
            key = headers.get("x-api-key")
            authorization = f"Bearer {key}" if key else None
        return self.authenticate_value(authorization)

    def authenticate_value(self, authorization: str | None) -> Caller:
        """:meth:`authenticate` given the ``Authorization`` header's value (``None``:
        absent), for a head not yet made a mapping."""
        if not self.by_digest:
            return self.anonymous
        digest = _digest(authorization)
        if digest is None:
            raise ClientError(401, "You didn't provide an API key. Send it as `Authorization: Bearer KEY`.",
                              code="missing_api_key", headers={"WWW-Authenticate": "Bearer"})
        found = self.callers.get(digest)
        if found is None or not hmac.compare_digest(digest, found[0]):
            raise ClientError(401, "Incorrect API key provided.", code="invalid_api_key",
                              headers={"WWW-Authenticate": "Bearer"})
        return found[1]


def check_admin(request: web.Request, admin_digest: bytes | None) -> None:
    """Admin endpoints: 404 (as an unknown route) when no admin key is configured,
    401 without the right key."""
    if admin_digest is None:
        raise unknown_route(request.method, request.path)
    digest = bearer_digest(request.headers)
    if digest is None or not hmac.compare_digest(digest, admin_digest):
        raise ClientError(401, "This endpoint needs the admin key.", code="invalid_api_key",
                          headers={"WWW-Authenticate": "Bearer"})
