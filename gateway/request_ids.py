"""Request ids: the one the caller sees, and the one each upstream attempt carries.

The caller's ``x-request-id`` is kept (echoed in the answer, written in the logs) when it
is at most :data:`MAX_CHARS` characters of ``A-Z a-z 0-9 . _ : / + = @ -``; any other
value (too long, spaces, quotes, non-ASCII, control characters) is **replaced** by a
new id, which the answer then carries, rather than refused: a caller's tracing header
is no reason to fail its request, and the answer says which id the gateway used.

An engine never sees the caller's id as it is: vLLM takes ``x-request-id`` as its own
internal request id, so two requests with one id collide in the engine (the second
fails, and with several API processes a duplicate has crashed it). Each upstream
attempt carries :func:`upstream_id`: the request's id as a readable prefix, then 16
hex digits from the operating system's cryptographic source, distinct per attempt and
unpredictable to callers. Ids the gateway makes itself come from that source too.

The random bytes are read from ``os.urandom`` a page at a time (one system call per
256 ids, not one per id), and the page is dropped in a forked child (``--workers``),
so two processes never hand out the same bytes.
"""

from __future__ import annotations

import os
import re

from aiohttp import web

from gateway.errors import REQUEST_ID_HEADER

REQUEST_ID = web.RequestKey("request_id", str)  # the request's id, on an aiohttp request

MAX_CHARS = 128
_VALID = re.compile(rf"[A-Za-z0-9._:/+=@-]{{1,{MAX_CHARS}}}")
_PAGE = 4096


class _Entropy:
    """Bytes of ``os.urandom`` not handed out yet: ``page`` from ``pos`` on."""

    __slots__ = ("page", "pos")

    def __init__(self) -> None:
        self.page = b""
        self.pos = _PAGE

    def forget(self) -> None:
        self.page, self.pos = b"", _PAGE


_ENTROPY = _Entropy()
os.register_at_fork(after_in_child=_ENTROPY.forget)


def _hex(n: int) -> str:
    """``n`` bytes of the page, as hex, each handed out once."""
    e = _ENTROPY
    pos = e.pos
    if pos + n > _PAGE:
        e.page, pos = os.urandom(_PAGE), 0
    e.pos = pos + n
    return e.page[pos:pos + n].hex()


def new_id() -> str:
    """A new request id: 32 hex digits from the cryptographic source."""
    return _hex(16)


def request_id(headers) -> str:
    """The request's id: the caller's ``x-request-id`` when it is a valid one (see
    the module doc), else a :func:`new_id`."""
    rid = headers.get(REQUEST_ID_HEADER)
    if rid and _VALID.fullmatch(rid) is not None:
        return rid
    return _hex(16)


def upstream_id(request_id: str) -> str:
    """The id one upstream attempt of request ``request_id`` carries: that id, ``-``
    and 16 random hex digits (a new value on every call)."""
    return f"{request_id}-{_hex(8)}"
