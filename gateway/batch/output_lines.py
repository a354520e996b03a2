"""The lines of OpenAI batch output and error files: one written (:func:`output_line`)
and the ``usage`` read back from one (:func:`line_usage`).
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson


def output_line(custom_id: str | None, status: int | None, request_id: str | None, body: Any,
                error: dict[str, Any] | None) -> bytes:
    """One line of an OpenAI batch output or error file."""
    response = None if status is None else {"status_code": status, "request_id": request_id, "body": body}
    return orjson.dumps({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response,
                         "error": error})


def line_usage(line: bytes) -> tuple[int, int, int, int]:
    """(input, cached input, output, reasoning) tokens of an output line whose response
    body carries an OpenAI ``usage`` (``prompt_tokens``, ``prompt_tokens_details.
    cached_tokens``, ``completion_tokens``, ``completion_tokens_details.
    reasoning_tokens``); zeros for what it lacks."""
    try:
        usage = orjson.loads(line)["response"]["body"]["usage"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return 0, 0, 0, 0
    if not isinstance(usage, dict):
        return 0, 0, 0, 0

    def n(obj: Any, name: str) -> int:
        v = obj.get(name) if isinstance(obj, dict) else None
        return v if isinstance(v, int) and v > 0 else 0

    return (n(usage, "prompt_tokens"), n(usage.get("prompt_tokens_details"), "cached_tokens"),
            n(usage, "completion_tokens"), n(usage.get("completion_tokens_details"), "reasoning_tokens"))
