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
256 request ids or 512 attempt suffixes), turned into ids all at once, and handed out
one each; the ids not handed out are dropped in a forked child (``--workers``), so two
processes never hand out the same ones.
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
    """Ids made from ``os.urandom`` and not handed out yet: ``ids`` of 32 hex digits
    (:func:`new_id`), ``suffixes`` of 16 (:func:`upstream_id`); each list is refilled
    from one page when it runs out."""

    __slots__ = ("ids", "suffixes")

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.suffixes: list[str] = []

    def forget(self) -> None:
        self.ids.clear()
        self.suffixes.clear()


_ENTROPY = _Entropy()
os.register_at_fork(after_in_child=_ENTROPY.forget)


def _page(n: int) -> list[str]:
    """One page of ``os.urandom``, as ids of ``n`` bytes each, in hex."""
    digits = os.urandom(_PAGE).hex()
    w = 2 * n
    return [digits[i:i + w] for i in range(0, 2 * _PAGE, w)]


def new_id() -> str:
    """A new request id: 32 hex digits from the cryptographic source."""
    ids = _ENTROPY.ids
    if not ids:
        ids += _page(16)
    return ids.pop()


def request_id(headers) -> str:
    """The request's id: the caller's ``x-request-id`` when it is a valid one (see
    the module doc), else a :func:`new_id`."""
    rid = headers.get(REQUEST_ID_HEADER)
    if rid and _VALID.fullmatch(rid) is not None:
        return rid
    return new_id()


def upstream_id(request_id: str) -> str:
    """The id one upstream attempt of request ``request_id`` carries: that id, ``-``
    and 16 random hex digits (a new value on every call)."""
    suffixes = _ENTROPY.suffixes
    if not suffixes:
        suffixes += _page(8)
    return f"{request_id}-{suffixes.pop()}"
