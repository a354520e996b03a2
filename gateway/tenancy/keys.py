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

from gateway.config import Auth, ClientKey
from gateway.errors import ClientError, unknown_route

ANONYMOUS = "anonymous"


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request: the key's ``name`` (``anonymous`` without keys), its limits
    and its admission priority and fair-share weight."""

    name: str
    key: ClientKey | None = None

    @property
    def priority(self) -> int:
        return self.key.priority if self.key is not None else 0

    @property
    def weight(self) -> float:
        return self.key.weight if self.key is not None else 1.0


CALLER = web.RequestKey("caller", Caller)  # the authenticated Caller of a /v1/ request (aiohttp routes)


def bearer_digest(headers) -> bytes | None:
    """SHA-256 of the bearer token in ``headers`` (a case-insensitive mapping), or
    ``None`` when the header is absent or not a bearer token."""
    header = headers.get("Authorization")
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


class KeyRing:
    """The configured client keys, by digest."""

    def __init__(self, cfg: Auth) -> None:
        self.by_digest: dict[bytes, ClientKey] = {k.digest(): k for k in cfg.keys}
        self.anonymous = Caller(ANONYMOUS)

    @property
    def enabled(self) -> bool:
        return bool(self.by_digest)

    def authenticate(self, headers) -> Caller:
        """The caller of a request with ``headers`` (a case-insensitive mapping).
        Raises :class:`ClientError` 401 when keys are configured and the request
        carries none or an unknown one."""
        if not self.by_digest:
            return self.anonymous
        digest = bearer_digest(headers)
        if digest is None:
            raise ClientError(401, "You didn't provide an API key. Send it as `Authorization: Bearer KEY`.",
                              code="missing_api_key", headers={"WWW-Authenticate": "Bearer"})
        key = self.by_digest.get(digest)
        if key is None or not hmac.compare_digest(digest, key.digest()):
            raise ClientError(401, "Incorrect API key provided.", code="invalid_api_key",
                              headers={"WWW-Authenticate": "Bearer"})
        return Caller(key.name, key)


def check_admin(request: web.Request, admin_digest: bytes | None) -> None:
    """Admin endpoints: 404 (as an unknown route) when no admin key is configured,
    401 without the right key."""
    if admin_digest is None:
        raise unknown_route(request.method, request.path)
    digest = bearer_digest(request.headers)
    if digest is None or not hmac.compare_digest(digest, admin_digest):
        raise ClientError(401, "This endpoint needs the admin key.", code="invalid_api_key",
                          headers={"WWW-Authenticate": "Bearer"})
