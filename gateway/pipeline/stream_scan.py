"""Reading an answer for what settlement needs: the first token, the events and ``usage``.

:class:`StreamScan` scans a server-sent-event stream incrementally as it is relayed
(events, the final ``usage``, ``data: [DONE]``) without parsing the events it does not
need, and, when the gateway asked the engine for ``usage`` on the client's behalf,
withholds the usage-only event from the client; :func:`whole_usage` finds ``usage`` in a
whole (non-streamed) answer; :class:`TypedEventScan` scans the typed-event streams of
the Responses and Messages APIs (:func:`scan_for` picks the scan of an API). The
gateway's own relay and the endpoint picker's response phase both use them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import orjson

from gateway.apis.base import Api
from gateway.apis.registry import CHAT

_MAX_SCAN_TAIL_BYTES = 1024 * 1024
_MAX_UNCOUNTED_BYTES = 64 * 1024  # whole lines whose events wait to be counted (StreamScan)
_EMPTY_CONTENT = re.compile(rb'"content":\s*(""|null)')


class StreamScan:
    """Incremental scan of an SSE byte stream: counts ``data:`` events, keeps the last
    ``usage`` object seen and whether ``data: [DONE]`` arrived. Only complete lines are
    inspected; a partial line waits in ``tail``.

    The events of a read of several lines are counted when the count is asked for
    (:attr:`events`, :attr:`content_events`) or once more than
    :data:`_MAX_UNCOUNTED_BYTES` of such reads wait (a reference to each, no copy): a
    stream whose engine reports ``usage`` with its completion tokens, as every stream
    the gateway asks it of does, needs no count of its last reads at all.

    ``withhold``: the client did not ask for ``usage`` (``stream_options.include_usage``)
    but the engine was asked for it, so the event that carries only ``usage`` (its
    ``choices`` empty) is kept from the client; :meth:`feed` then returns complete lines
    only, and a partial line is held back until its end arrives (or :meth:`flush`).

    ``kept``: a list that receives every chunk fed, for a stream that may be continued
    on another backend if its own fails (set by :mod:`gateway.pipeline.migration`), else
    ``None``."""

    __slots__ = ("counted", "done", "drop_blank", "kept", "overflow", "role_only", "seen", "tail", "uncounted",
                 "uncounted_bytes", "usage", "withhold")

    def __init__(self, withhold: bool = False) -> None:
        self.withhold = withhold
        self.kept: list[bytes] | None = None  # the bytes read, kept while open (gateway.pipeline.migration)
        self.drop_blank = False  # the withheld event's blank line is still to come
        self.tail = b""
        self.counted = 0  # the events counted so far; those of ``uncounted`` are not yet
        self.uncounted: list[bytes] = []  # whole lines not counted yet, each starting at a line start
        self.uncounted_bytes = 0
        self.seen = False  # a ``data:`` line arrived (the first one is looked at for the role)
        self.done = False
        self.usage: dict[str, Any] | None = None
        self.overflow = False
        self.role_only = 0  # 1 when the first event only announced the role (vLLM, llama.cpp)

    def feed(self, chunk: bytes) -> bytes:
        """Scan the next bytes of the stream, ``chunk``; returns the bytes to relay to
        the client: ``chunk`` itself unless withholding (see the class doc)."""
        if self.kept is not None:  # a stream that may be continued elsewhere (gateway.pipeline.migration)
            self.kept.append(chunk)
        if self.overflow:
            return chunk
        # the usual read of a stream: one whole JSON event ("data: {...}\n\n", no other
        # line: its first line end is the one before the last byte) without usage; this
        # is what the general scan concludes for it, at the cost of one substring search
        # and three cheap checks (a read of several events fails them at its first line end)
        if not self.tail and self.seen and chunk.endswith(b"}\n\n") and chunk.find(b"\n") == len(chunk) - 2 and \
                chunk.startswith(b"data:") and chunk.rfind(b'"usage"') < 0:
            self.counted += 1
            return chunk
        return self._feed_general(chunk)

    def flush(self) -> bytes:
        """The bytes held back from the client (withholding: a partial last line), to be
        relayed now that the stream ended or broke; withholding stops."""
        if not self.withhold:
            return b""
        self.withhold = False
        return self.tail

    def _feed_general(self, chunk: bytes) -> bytes:
        nl = chunk.rfind(b"\n")
        if nl < 0:
            self.tail += chunk
            if len(self.tail) > _MAX_SCAN_TAIL_BYTES:  # no line this long is scanned: relay it as it is
                out = self.tail if self.withhold else chunk
                self.overflow, self.tail, self.withhold = True, b"", False
                return out
            return b"" if self.withhold else chunk
        if nl == len(chunk) - 1:  # whole events: no copy
            complete = self.tail + chunk if self.tail else chunk
            self.tail = b""
        else:
            complete = self.tail + chunk[: nl + 1] if self.tail else chunk[: nl + 1]
            self.tail = chunk[nl + 1:]
        if not self.seen:
            first = complete[: complete.find(b"\n")]
            if b'"role"' in first and (b'"content"' not in first or _EMPTY_CONTENT.search(first)):
                self.role_only = 1
            self.seen = complete.startswith(b"data:") or b"\ndata:" in complete
        # counted when asked for (see the class doc)
        self.uncounted.append(complete)
        self.uncounted_bytes += len(complete)
        if self.uncounted_bytes > _MAX_UNCOUNTED_BYTES:
            self._count()
        i = complete.rfind(b"[DONE]")  # the last event, when the stream is well formed
        if i >= 0:
            line = complete[complete.rfind(b"\n", 0, i) + 1:complete.find(b"\n", i)].rstrip(b"\r ")
            if line == b"data: [DONE]" or line == b"data:[DONE]":
                self.done = True
        skip = 0
        if self.drop_blank:  # the blank line after a usage-only event withheld
            self.drop_blank = False
            if complete.startswith((b"\n", b"\r\n")):
                skip = complete.find(b"\n") + 1
        # the usual read; searched from the end, where a stream's usage is (and which is
        # the quicker search through JSON text when it is absent)
        i = complete.rfind(b'"usage"')
        if i < 0:
            if not self.withhold:
                return chunk
            return complete[skip:] if skip else complete
        return self._usage(chunk, complete, skip, i)

    def _usage(self, chunk: bytes, complete: bytes, skip: int, i: int) -> bytes:
        """Read the last ``usage`` object of the lines ``complete`` (of which the read
        ``chunk`` is the end; ``i``: where its last ``"usage"`` is); returns what
        :meth:`feed` returns: withholding, ``complete`` without its first ``skip``
        bytes and the usage-only event."""
        cut = stop = 0
        while i >= 0:  # the last line with a usage object
            start = complete.rfind(b"\n", 0, i) + 1
            line_end = complete.find(b"\n", i) + 1  # complete ends with a line end
            obj = None
            if complete[start:start + 5] == b"data:":
                try:
                    obj = orjson.loads(complete[start + 5:line_end])
                except orjson.JSONDecodeError:
                    pass
            if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                self.usage = obj["usage"]
                if self.withhold and not obj.get("choices"):  # the usage-only event: not the client's
                    cut, stop = start, line_end
                    if stop == len(complete):  # its blank line comes with the next read
                        self.drop_blank = True
                    else:
                        after = complete[stop:stop + 2]
                        stop += 1 if after[:1] == b"\n" else 2 if after == b"\r\n" else 0
                break
            i = complete.rfind(b'"usage"', 0, start)
        if not self.withhold:
            return chunk
        if not stop:
            return complete[skip:]
        lines = memoryview(complete)  # the two parts are copied once, into the result
        return b"".join((lines[skip:cut], lines[stop:]))

    def _count(self) -> None:
        """Count the events of the lines waiting in ``uncounted``."""
        n = 0
        for lines in self.uncounted:
            # each starts at a line start: events are counted only at line starts, so
            # that "data:" or "[DONE]" inside a token's text changes nothing
            n += lines.startswith(b"data:") + lines.count(b"\ndata:")
        self.counted += n
        self.uncounted.clear()
        self.uncounted_bytes = 0

    @property
    def events(self) -> int:
        """The ``data:`` events scanned so far."""
        if self.uncounted:
            self._count()
        return self.counted

    @property
    def content_events(self) -> int:
        """``data:`` events that were neither ``[DONE]``, a usage-only chunk nor a
        role-only first chunk: the completion tokens when ``usage`` is absent (one
        token per event, as vLLM and llama.cpp stream)."""
        return max(self.events - (1 if self.done else 0) - (1 if self.usage else 0) - self.role_only, 0)


def whole_usage(data: bytes, api: Api = CHAT) -> Any:
    """The usage object of a whole (non-streamed) response body of ``api``, or ``None``."""
    if b'"usage"' in data:
        try:
            obj = orjson.loads(data)
            return api.usage_in(obj) if isinstance(obj, dict) else None
        except orjson.JSONDecodeError:
            pass
    return None


def scan_for(api: Api, withhold: bool = False) -> StreamScan:
    """The scan of a stream of ``api``: :class:`StreamScan` for the APIs whose streams
    end with ``data: [DONE]``, :class:`TypedEventScan` for those of typed events."""
    return TypedEventScan(api) if api.end_events else StreamScan(withhold)


class TypedEventScan(StreamScan):
    """The scan of a stream of typed events (the Responses and Messages APIs): each
    event's JSON names its type (``"type":"response.output_text.delta"``), which the
    scan counts without parsing (a type inside generated text is escaped, so it never
    matches); ``done`` once an end event of the API arrived; ``usage`` merges the usage
    objects of its events (:meth:`gateway.apis.base.Api.usage_in`: Messages reports the
    prompt's at the start, the output's at the end). Nothing is withheld.

    Such a stream's first bytes announce it (``response.created``, ``message_start``)
    before the engine generated anything: its first token is its first output delta.
    ``on_first_token``, when set, is called once with the bytes that brought it (or the
    stream's end, for an answer with no output)."""

    __slots__ = ("api", "deltas", "ends", "final", "on_first_token")

    def __init__(self, api: Api) -> None:
        super().__init__(False)
        self.api = api
        self.on_first_token: Callable[[bytes], None] | None = None
        self.final: dict[str, Any] | None = None  # the last event that carried usage (Responses: the response)
        self.deltas = _type_markers(api.delta_event)
        self.ends = tuple(m for e in api.end_events for m in _type_markers(e))

    def feed(self, chunk: bytes) -> bytes:
        if self.kept is not None:  # a stream that may be continued elsewhere (gateway.pipeline.migration)
            self.kept.append(chunk)
        if self.overflow:
            return chunk
        nl = chunk.rfind(b"\n")
        if nl < 0:
            self.tail += chunk
            if len(self.tail) > _MAX_SCAN_TAIL_BYTES:
                self.overflow, self.tail = True, b""
            return chunk
        complete = self.tail + chunk[: nl + 1] if self.tail else chunk[: nl + 1]
        self.tail = chunk[nl + 1:]
        for m in self.deltas:
            self.counted += complete.count(m)
        if not self.done and any(m in complete for m in self.ends):
            self.done = True
        if b'"usage"' in complete:
            self._usages(complete)
        if self.on_first_token is not None and (self.counted or self.done):
            first, self.on_first_token = self.on_first_token, None
            first(complete)
        return chunk

    def _usages(self, complete: bytes) -> None:
        start = 0
        while (i := complete.find(b'"usage"', start)) >= 0:
            line_start = complete.rfind(b"\n", 0, i) + 1
            start = complete.find(b"\n", i) + 1
            if not complete.startswith(b"data:", line_start):
                continue
            try:
                obj = orjson.loads(complete[line_start + 5:start])
            except orjson.JSONDecodeError:
                continue
            usage = self.api.usage_in(obj) if isinstance(obj, dict) else None
            if usage is not None:
                self.usage = {**self.usage, **usage} if self.usage else usage
                self.final = obj

    @property
    def content_events(self) -> int:
        """The output-token events (one token each, as the engines stream them)."""
        return self.counted


def _type_markers(name: bytes) -> tuple[bytes, ...]:
    """How an event's JSON names its type ``name``, compact or with a space."""
    return (b'"type":"' + name + b'"', b'"type": "' + name + b'"') if name else ()
