"""gateway/pipeline/relay.py's ``StreamScan``: what it counts in a relayed SSE stream,
however the stream is split into reads, without sockets."""

from __future__ import annotations

from tests.support.servers import sse_chunk


def test_stream_scan_counts_content_events_across_splits():
    from gateway.pipeline.stream_scan import StreamScan

    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    body = role + b"".join(sse_chunk(i, "w ") for i in range(4)) + \
        b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}\n\ndata: [DONE]\n\n'
    for step in (1, 7, 64, len(body)):
        scan = StreamScan()
        for i in range(0, len(body), step):
            scan.feed(body[i:i + step])
        assert scan.done and scan.usage == {"prompt_tokens": 3, "completion_tokens": 4}
        assert scan.content_events == 4
    # "[DONE]" and "data:" inside a token's text are text, not protocol
    tricky = sse_chunk(0, "say data: [DONE]\n") + sse_chunk(1, "data: [DONE]")
    scan = StreamScan()
    scan.feed(tricky)
    assert not scan.done and scan.content_events == 2


def test_stream_scan_single_event_fast_path_agrees_with_the_general_scan():
    """StreamScan.feed takes a shortcut for a read holding exactly one JSON event without
    usage; fed event by event, split at random or whole, every stream must scan alike."""
    import random

    from gateway.pipeline.stream_scan import StreamScan

    rng = random.Random(7)
    pieces = [sse_chunk(0, "plain"), sse_chunk(1, "say data: [DONE]\n"), sse_chunk(2, "}\n\n"),
              b": keep-alive comment}\n\n", b'data: {"choices":[{"delta":{"content":"crlf"}}]}\r\n\r\n',
              b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\n',
              b'event: ping\ndata: {"x":1}\n\n', b"data: [DONE]\n\n", b"data:[DONE] \n\n"]
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'

    def scanned(chunks, general=False):
        s = StreamScan()
        for c in chunks:
            s._feed_general(c) if general else s.feed(c)
        return s.events, s.done, s.usage, s.role_only, s.content_events, s.tail

    general_calls = []

    class Counting(StreamScan):
        def _feed_general(self, chunk):
            general_calls.append(chunk)
            super()._feed_general(chunk)

    fed = 0
    for _ in range(300):
        events = [role] + [rng.choice(pieces) for _ in range(rng.randint(1, 8))]
        body = b"".join(events)
        cuts = sorted(rng.sample(range(1, len(body)), min(len(body) - 1, rng.randint(1, 6))))
        for chunks in (events, [body], [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)])]):
            assert scanned(chunks) == scanned(chunks, general=True), chunks
        c = Counting()
        for e in events:
            c.feed(e)
        fed += len(events)
    assert fed - len(general_calls) > 100  # the one-event reads took the shortcut


def test_a_withholding_scan_keeps_only_the_usage_only_event_from_the_client():
    """The gateway asked the engine for ``usage`` that the client did not ask for: the
    bytes relayed are the stream without the usage-only event, however the stream is
    split into reads (a partial line waits for its end), and ``usage`` is still read.
    An event that carries ``choices`` besides ``usage`` is the client's and passes."""
    import random

    from gateway.pipeline.stream_scan import StreamScan

    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    usage = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":8}}\n\n'
    crlf_usage = b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":8}}\r\n\r\n'
    content = b"".join(sse_chunk(i, f'w{i} usage ') for i in range(4))
    done = b"data: [DONE]\n\n"
    rng = random.Random(11)
    for stream, expected in ((role + content + usage + done, role + content + done),
                             (content + crlf_usage + done, content + done),
                             (content + usage, content)):  # no [DONE]: the stream broke after usage
        for _ in range(60):
            cuts = sorted(rng.sample(range(1, len(stream)), rng.randint(0, 8)))
            scan = StreamScan(withhold=True)
            out = b"".join(scan.feed(stream[a:b]) for a, b in zip([0, *cuts], [*cuts, len(stream)]))
            assert out + scan.flush() == expected, cuts
            assert scan.usage == {"prompt_tokens": 9, "completion_tokens": 8} and scan.content_events == 4
    # a stream whose last event carries both its last token and usage (older llama.cpp): relayed as it is
    both = b'data: {"choices":[{"index":0,"delta":{"content":"x"}}],"usage":{"completion_tokens":5}}\n\n'
    scan = StreamScan(withhold=True)
    assert scan.feed(content + both + done) == content + both + done and scan.usage == {"completion_tokens": 5}
    # a partial line is held until it ends, or until the stream ends (flush)
    scan = StreamScan(withhold=True)
    assert scan.feed(content + b'data: {"cho') == content and scan.feed(b'ices"') == b""
    assert scan.flush() == b'data: {"choices"' and scan.flush() == b""
    # without withholding every byte is relayed as it comes
    scan = StreamScan()
    assert scan.feed(content + usage[:20]) == content + usage[:20] and scan.feed(usage[20:]) == usage[20:]
    assert scan.usage is not None and scan.flush() == b""
