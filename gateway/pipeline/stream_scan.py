"""Reading an answer for what settlement needs: the first token, the events and ``usage``.

:class:`StreamScan` scans a server-sent-event stream incrementally as it is relayed
(events, the final ``usage``, ``data: [DONE]``) without parsing the events it does not
need; :func:`whole_usage` finds ``usage`` in a whole (non-streamed) answer. The gateway's
own relay and the endpoint picker's response phase both use them.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

_MAX_SCAN_TAIL_BYTES = 1024 * 1024
_EMPTY_CONTENT = re.compile(rb'"content":\s*(""|null)')


class StreamScan:
    """Incremental scan of an SSE byte stream: counts ``data:`` events, keeps the last
    ``usage`` object seen and whether ``data: [DONE]`` arrived. Only complete lines are
    inspected; a partial line waits in ``tail``."""

    __slots__ = ("done", "events", "overflow", "role_only", "tail", "usage")

    def __init__(self) -> None:
        self.tail = b""
        self.events = 0
        self.done = False
        self.usage: dict[str, Any] | None = None
        self.overflow = False
        self.role_only = 0  # 1 when the first event only announced the role (vLLM, llama.cpp)

    def feed(self, chunk: bytes) -> None:
        if self.overflow:
            return
        # the usual read of a stream: one whole JSON event ("data: {...}\n\n", no other
        # line) without usage; this is what the general scan concludes for it, at the
        # cost of one substring search and three cheap checks
        if not self.tail and self.events and chunk.endswith(b"}\n\n") and chunk.count(b"\n") == 2 and \
                chunk.startswith(b"data:") and chunk.find(b'"usage"') < 0:
            self.events += 1
            return
        self._feed_general(chunk)

    def _feed_general(self, chunk: bytes) -> None:
        nl = chunk.rfind(b"\n")
        if nl < 0:
            self.tail += chunk
            if len(self.tail) > _MAX_SCAN_TAIL_BYTES:
                self.overflow, self.tail = True, b""
            return
        if nl == len(chunk) - 1:  # whole events: no copy
            complete = self.tail + chunk if self.tail else chunk
            self.tail = b""
        else:
            complete = self.tail + chunk[: nl + 1] if self.tail else chunk[: nl + 1]
            self.tail = chunk[nl + 1:]
        if self.events == 0:
            first = complete[: complete.find(b"\n")]
            if b'"role"' in first and (b'"content"' not in first or _EMPTY_CONTENT.search(first)):
                self.role_only = 1
        # ``complete`` starts at a line start: count events only at line starts, so that
        # "data:" or "[DONE]" inside a token's text changes nothing
        self.events += complete.startswith(b"data:") + complete.count(b"\ndata:")
        i = complete.rfind(b"[DONE]")  # the last event, when the stream is well formed
        if i >= 0:
            line = complete[complete.rfind(b"\n", 0, i) + 1:complete.find(b"\n", i)].rstrip(b"\r ")
            if line == b"data: [DONE]" or line == b"data:[DONE]":
                self.done = True
        if complete.find(b'"usage"') >= 0:
            for line in reversed(complete.split(b"\n")):
                if line.startswith(b"data:") and b'"usage"' in line:
                    try:
                        obj = orjson.loads(line[5:])
                    except orjson.JSONDecodeError:
                        continue
                    if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                        self.usage = obj["usage"]
                        break

    @property
    def content_events(self) -> int:
        """``data:`` events that were neither ``[DONE]``, a usage-only chunk nor a
        role-only first chunk: the completion tokens when ``usage`` is absent (one
        token per event, as vLLM and llama.cpp stream)."""
        return max(self.events - (1 if self.done else 0) - (1 if self.usage else 0) - self.role_only, 0)


def whole_usage(data: bytes) -> Any:
    """The ``usage`` object of a whole (non-streamed) response body, or ``None``."""
    if b'"usage"' in data:
        try:
            obj = orjson.loads(data)
            return obj.get("usage") if isinstance(obj, dict) else None
        except orjson.JSONDecodeError:
            pass
    return None
