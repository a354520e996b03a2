"""gateway/server/fast_path.py: the response heads the data plane writes itself, without
sockets."""

from __future__ import annotations

from gateway.server.lean_downstream import response_head


def test_response_head_drops_cr_lf_nul_and_replaces_non_latin1():
    head = response_head(200, {"x-a": "a\r\nSet-Cookie: evil", "x-b": "caf\xe9\u20ac\x00z", "x-c": ""}, b"Tail: 1\r\n")
    lines = head.split(b"\r\n")
    assert b"x-a: aSet-Cookie: evil" in lines and b"x-b: caf\xe9?z" in lines and b"x-c: " in lines
    assert not any(line.startswith(b"Set-Cookie") for line in lines)
    assert head.endswith(b"Tail: 1\r\n\r\n") and head.count(b"\r\n\r\n") == 1
