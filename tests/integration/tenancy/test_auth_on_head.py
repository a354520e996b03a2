"""Authenticate on the head (issue 27, point 5): with keys configured, a request
without a valid key is answered 401 and its connection closed before any of its body
is read, on the lean protocol as on aiohttp (a head the lean protocol hands over, and
``listen.fast_path: false``)."""

from __future__ import annotations

import asyncio
import hashlib

import openai
import pytest

from tests.support.servers import ScriptedBackend, gateway_config, running_gateway

KEY = "sk-right"
BIG = 64 * 1024 * 1024  # the head announces a body far larger than anything sent


def _cfg(url: str, fast_path: bool = True):
    return gateway_config([{"name": "b", "url": url, "models": ["m"]}], listen={"fast_path": fast_path},
                          limits={"max_body_bytes": 2 * BIG},
                          auth={"keys": [{"name": "k", "key_sha256": hashlib.sha256(KEY.encode()).hexdigest()}]})


async def _head_only(url: str, head: str) -> tuple[bytes, bool]:
    """Send ``head`` and nothing more; returns everything the gateway sent and whether
    it then closed the connection (the wait is bounded: a gateway that waits for the
    body fails the test instead of hanging it)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head.encode("latin-1"))
        await writer.drain()
        try:
            got = await asyncio.wait_for(reader.read(-1), 20)  # to EOF
        except TimeoutError:
            return b"", False
        return got, True
    finally:
        writer.close()


def _post(path: str, *extra: str, length: int = BIG, version: str = "1.1") -> str:
    lines = [f"POST {path} HTTP/{version}", "Host: gw", "Content-Type: application/json", *extra]
    if length >= 0:
        lines.append(f"Content-Length: {length}")
    return "\r\n".join(lines) + "\r\n\r\n"


HEADS = {
    "lean": _post("/v1/chat/completions"),
    "lean_completions_wrong_key": _post("/v1/completions", "Authorization: Bearer sk-wrong"),
    "handed_over_chunked": _post("/v1/chat/completions", "Transfer-Encoding: chunked", length=-1),
    "handed_over_other_path": _post("/v1/models/m"),
}


@pytest.mark.parametrize("kind", sorted(HEADS))
@pytest.mark.parametrize("fast_path", [True, False])
async def test_a_head_without_a_valid_key_gets_401_and_a_close_before_its_body(kind, fast_path):
    be = ScriptedBackend()
    async with be.running(), running_gateway(_cfg(be.url, fast_path)) as gw:
        got, closed = await _head_only(gw.url, HEADS[kind])
        assert closed, "the gateway waited for the body of an unauthenticated request"
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 401 "), got[:200]
        assert b"authentication_error" in body or b"invalid_api_key" in body
        assert be.bodies == []


async def test_a_valid_key_is_still_served_on_both_stacks():
    be = ScriptedBackend()
    for fast_path in (True, False):
        async with be.running(), running_gateway(_cfg(be.url, fast_path)) as gw:
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)
            r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            assert r.choices[0].message.content == "hello"
            models = await client.models.list()
            assert [m.id for m in models.data] == ["m"]
