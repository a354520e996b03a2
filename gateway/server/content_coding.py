"""Request bodies sent with a ``Content-Encoding`` the lean protocol decodes itself
(``gzip``, ``x-gzip``, ``deflate``): :func:`decode_body`."""

from __future__ import annotations

import zlib

from gateway.errors import ClientError


def decode_body(body: bytes, coding: str, limit: int) -> bytes:
    """A ``gzip`` or ``deflate`` request body, decompressed (zlib), at most ``limit``
    bytes. Raises :class:`ClientError` 400 (not a valid stream of that coding) or 413."""
    modes = (16 + zlib.MAX_WBITS,) if coding in ("gzip", "x-gzip") else (zlib.MAX_WBITS, -zlib.MAX_WBITS)
    why = ""
    for wbits in modes:  # "deflate" is the zlib format (RFC 9110); some clients send raw deflate
        d = zlib.decompressobj(wbits)
        try:
            out = d.decompress(body, limit + 1)
        except zlib.error as e:
            why = str(e)
            continue
        if len(out) > limit:
            raise ClientError(413, f"Request body exceeds the limit of {limit} bytes once decompressed.",
                              code="request_too_large")
        if d.eof and not d.unused_data:
            return out
        why = "the compressed stream is truncated or followed by other bytes"
    raise ClientError(400, f"The request body could not be read (Content-Encoding: {coding}): "
                           f"{why}", code="invalid_body")
