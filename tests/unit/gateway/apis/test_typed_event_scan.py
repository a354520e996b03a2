"""gateway/pipeline/stream_scan.py's ``TypedEventScan`` on the typed-event streams of
the Responses and Messages APIs, as llama.cpp and vLLM send them, however the stream
is split into reads: the output-token events, the end event, and the usage (Messages:
merged from ``message_start`` and ``message_delta``)."""

from __future__ import annotations

import json
import random

import orjson

from gateway.apis.registry import BY_NAME, CHAT
from gateway.pipeline.stream_scan import StreamScan, TypedEventScan, scan_for, whole_usage

RESPONSES, MESSAGES = BY_NAME["responses"], BY_NAME["messages"]
R_USAGE = {"input_tokens": 13, "output_tokens": 3, "total_tokens": 16, "input_tokens_details": {"cached_tokens": 1}}


def event(obj: dict, *, spaced: bool = False, crlf: bool = False) -> bytes:
    """One SSE event ``event: <type>`` + ``data: <obj>``; ``spaced``: JSON with a space
    after each colon (Python's json, as vLLM writes it); ``crlf``: CRLF line ends."""
    data = json.dumps(obj) if spaced else orjson.dumps(obj).decode()
    nl = "\r\n" if crlf else "\n"
    return f"event: {obj['type']}{nl}data: {data}{nl}{nl}".encode()


def responses_stream(deltas: list[str], end: str = "response.completed", **kw) -> bytes:
    item = {"id": "msg_1", "type": "message", "role": "assistant", "status": "in_progress", "content": []}
    text = "".join(deltas)
    events = [{"type": "response.created", "response": {"id": "resp_1", "status": "in_progress"}},
              {"type": "response.in_progress", "response": {"id": "resp_1", "status": "in_progress"}},
              {"type": "response.output_item.added", "item": item},
              {"type": "response.content_part.added", "item_id": "msg_1", "part": {"type": "output_text", "text": ""}},
              *({"type": "response.output_text.delta", "item_id": "msg_1", "delta": d} for d in deltas),
              {"type": "response.output_text.done", "item_id": "msg_1", "text": text},
              {"type": "response.output_item.done", "item": {**item, "status": "completed"}},
              {"type": end, "response": {"id": "resp_1", "status": end.split(".")[1], "usage": R_USAGE,
                                         "output": [{"type": "message", "content": [
                                             {"type": "output_text", "text": text}]}]}}]
    return b"".join(event(e, **kw) for e in events)


def messages_stream(deltas: list[str], *, end: bool = True, **kw) -> bytes:
    events = [{"type": "message_start", "message": {"id": "m1", "type": "message", "role": "assistant", "content": [],
                                                    "usage": {"cache_read_input_tokens": 12, "input_tokens": 1,
                                                              "output_tokens": 0}}},
              {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
              *({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": d}}
                for d in deltas),
              {"type": "content_block_stop", "index": 0},
              {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 3}}]
    if end:
        events.append({"type": "message_stop"})
    return b"".join(event(e, **kw) for e in events)


def scan(api, stream: bytes, step: int) -> TypedEventScan:
    s = scan_for(api)
    assert isinstance(s, TypedEventScan)
    for i in range(0, len(stream), step):
        assert s.feed(stream[i:i + step]) == stream[i:i + step]  # nothing withheld
    return s


# generated text that spells the protocol: escaped inside the JSON, so never an event
TRICKY = ['ET "type":"response.completed"', ' \n\ndata: {"usage": 1}', " Pr"]


def test_scan_for_picks_the_typed_scan_for_apis_with_end_events():
    assert type(scan_for(CHAT)) is StreamScan and type(scan_for(BY_NAME["embeddings"])) is StreamScan
    assert isinstance(scan_for(RESPONSES), TypedEventScan) and isinstance(scan_for(MESSAGES), TypedEventScan)


def test_a_responses_stream_at_every_split():
    for kw in ({}, {"spaced": True}, {"crlf": True}):
        stream = responses_stream(TRICKY, **kw)
        for step in range(1, len(stream) + 1):
            s = scan(RESPONSES, stream, step)
            assert s.done and s.content_events == 3 and s.usage == R_USAGE, (kw, step)
            assert RESPONSES.counts(s.usage) == (13, 1, 3)


def test_a_responses_stream_at_random_splits_and_every_end_event():
    rng = random.Random(30)
    for end in sorted(e.decode() for e in RESPONSES.end_events):
        stream = responses_stream(["a", "b", "c"], end=end)
        for _ in range(200):
            cuts = sorted(rng.sample(range(1, len(stream)), rng.randint(1, 12)))
            s = scan_for(RESPONSES)
            for a, b in zip([0, *cuts], [*cuts, len(stream)]):
                s.feed(stream[a:b])
            assert s.done and s.content_events == 3 and s.usage == R_USAGE


def test_a_responses_stream_is_not_done_before_its_end_event():
    stream = responses_stream(["a", "b"])
    cut = stream.rindex(b"event: response.completed")
    s = scan(RESPONSES, stream[:cut], 5)
    assert not s.done and s.usage is None and s.content_events == 2
    s.feed(stream[cut:-1])  # the end event's data line without its blank line: whole, so counted
    assert s.done and s.usage == R_USAGE


def test_a_messages_stream_merges_the_usage_of_message_start_and_message_delta():
    for kw in ({}, {"spaced": True}, {"crlf": True}):
        stream = messages_stream(["21", ' "type":"message_stop"', " gener"], **kw)
        for step in range(1, len(stream) + 1):
            s = scan(MESSAGES, stream, step)
            assert s.done and s.content_events == 3, (kw, step)
            assert s.usage == {"cache_read_input_tokens": 12, "input_tokens": 1, "output_tokens": 3}
            assert MESSAGES.counts(s.usage) == (13, 12, 3)


def test_a_messages_stream_cut_before_message_stop_is_not_done():
    stream = messages_stream(["a", "b"], end=False)
    s = scan(MESSAGES, stream, 7)
    assert not s.done and s.content_events == 2 and s.usage["output_tokens"] == 3
    s = scan(MESSAGES, stream[:stream.index(b"event: message_delta")], 7)
    assert s.usage == {"cache_read_input_tokens": 12, "input_tokens": 1, "output_tokens": 0}  # from the start only
    # an error event ends nothing by itself
    s.feed(MESSAGES.error_event(529, b'{"error": {"message": "busy"}}'))
    assert not s.done


def test_whole_answers_usage():
    r = {"object": "response", "status": "completed", "usage": R_USAGE}
    m = {"type": "message", "usage": {"input_tokens": 1, "cache_read_input_tokens": 20, "output_tokens": 4}}
    assert whole_usage(orjson.dumps(r), RESPONSES) == R_USAGE
    assert MESSAGES.counts(whole_usage(orjson.dumps(m), MESSAGES)) == (21, 20, 4)
    assert whole_usage(b'{"usage": ', RESPONSES) is None and whole_usage(b"[]", MESSAGES) is None
