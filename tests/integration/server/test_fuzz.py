"""Fuzzing the HTTP surface (hypothesis) from the gateway's own OpenAPI document:
malformed JSON, wrong types, huge and deeply nested fields, invalid UTF-8, wrong
content types, compressed bodies. Always an answer below 500 with an OpenAI error
body for 4xx; never a 5xx, a hang or a crash.

The gateway and a backend that always answers run on a loop in a background thread;
hypothesis drives raw HTTP/1.1 requests (``http.client``) at it.
"""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import threading
from contextlib import contextmanager

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.servers import ScriptedBackend, gateway_config, running_gateway

PATHS = ["/v1/chat/completions", "/v1/completions"]
TIMEOUT_S = 10.0  # a request not answered within this is a hang


@contextmanager
def gateway_in_thread(**cfg_overrides):
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stop: asyncio.Event | None = None
    box: dict = {}

    async def main() -> None:
        nonlocal stop
        stop = asyncio.Event()
        async with ScriptedBackend().running() as be:
            cfg = gateway_config([{"name": "b", "url": be.url, "models": ["m"]}], **cfg_overrides)
            async with running_gateway(cfg) as gw:
                box["port"] = int(gw.url.rsplit(":", 1)[1])
                box["gw"] = gw
                ready.set()
                await stop.wait()

    t = threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True)
    t.start()
    assert ready.wait(30)
    try:
        yield box
    finally:
        loop.call_soon_threadsafe(stop.set)  # type: ignore[union-attr]
        t.join(30)
        loop.close()


@pytest.fixture(scope="module")
def gw():
    with gateway_in_thread(limits={"max_body_bytes": 1 << 20}) as box:
        yield box


def request(port: int, method: str, path: str, body: bytes = b"", headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.getheader("Content-Type") or "", r.read()
    finally:
        conn.close()


def check(status: int, ctype: str, body: bytes, *, protocol_error_ok: bool = False) -> None:
    assert status < 500, (status, body[:300])
    if status == 400 and protocol_error_ok and ctype.startswith("text/plain"):
        # a body that cannot be decoded per its Content-Encoding is refused by aiohttp's
        # HTTP parser before any handler runs: a plain-text 400, still a clear 4xx
        assert any(w in body.lower() for w in (b"content-encoding", b"decode", b"deflate", b"gzip", b"br")), body
        return
    if status >= 400:
        assert ctype.startswith("application/json"), ctype
        err = orjson.loads(body)["error"]
        assert isinstance(err["message"], str) and "type" in err


def test_openapi_document_is_served_and_covers_the_surface(gw):
    status, ctype, body = request(gw["port"], "GET", "/openapi.json")
    assert status == 200 and ctype.startswith("application/json")
    doc = json.loads(body)
    assert doc["openapi"].startswith("3.")
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model}", "/health",
                 "/ready", "/metrics"):
        assert path in doc["paths"]
    assert not [p for p in doc["paths"] if p.startswith("/admin/")]  # no admin key: those answer 404
    # every response schema reference resolves
    text = body.decode()
    for name in doc["components"]["schemas"]:
        assert f"#/components/schemas/{name}" in text or name == "Model"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=50),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=30,
)


def _request_bodies():
    """Bodies shaped by the OpenAPI schemas: right fields with wrong types, missing
    required fields, extra fields, plus valid ones."""
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]) | json_values},
                                    optional={"content": json_values})
    chat = st.fixed_dictionaries({}, optional={
        "model": st.sampled_from(["m", "", "unknown"]) | json_values,
        "messages": st.lists(message | json_values, max_size=3) | json_values,
        "stream": st.booleans() | json_values,
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": json_values}) | json_values,
        "max_tokens": st.integers(-5, 5) | json_values,
        "max_completion_tokens": st.integers(-5, 5) | json_values,
        "prompt": st.text(max_size=20) | json_values,
    })
    return st.one_of(chat, st.dictionaries(st.text(max_size=10), json_values, max_size=5), json_values)


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(PATHS), body=_request_bodies())
def test_fuzz_json_bodies_never_5xx(gw, path, body):
    status, ctype, resp = request(gw["port"], "POST", path, json.dumps(body).encode(),
                                  {"Content-Type": "application/json"})
    check(status, ctype, resp)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(PATHS + ["/v1/models", "/v1/models/m", "/nope", "/v1/chat/completions/x"]),
       method=st.sampled_from(["POST", "GET", "PUT", "DELETE", "PATCH"]),
       raw=st.binary(max_size=300),
       ctype=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded",
                              "multipart/form-data; boundary=x", "application/json; charset=latin-1",
                              "application/vnd.api+json", "", "garbage/;;"]),
       encoding=st.sampled_from([None, "gzip", "br", "deflate", "identity"]))
def test_fuzz_raw_bytes_methods_content_types_and_encodings(gw, path, method, raw, ctype, encoding):
    headers = {"Content-Type": ctype} if ctype else {}
    body = raw
    if encoding is not None:
        headers["Content-Encoding"] = encoding
        if encoding == "gzip":
            body = gzip.compress(raw)
    status, rctype, resp = request(gw["port"], method, path, body, headers)
    check(status, rctype, resp, protocol_error_ok=encoding not in (None, "identity"))


@pytest.mark.parametrize("body", [
    b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe invalid utf-8"}]}',
    b'{"model": "m", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * (2 << 20) + b'"}]}',
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": ' + b"9" * 10000 + b"}",
    b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
    b"\x1f\x8b\x08\x00garbage",
    b'{"model": "m"' * 1000,
])
def test_pathological_bodies(gw, body):
    status, ctype, resp = request(gw["port"], "POST", "/v1/chat/completions", body,
                                  {"Content-Type": "application/json"})
    check(status, ctype, resp)


def test_gateway_still_healthy_and_idle_after_fuzzing(gw):
    status, _, body = request(gw["port"], "POST", "/v1/chat/completions",
                              orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
                              {"Content-Type": "application/json"})
    assert status == 200, body
    assert request(gw["port"], "GET", "/health")[0] == 200
    assert gw["gw"].idle("b")


@pytest.mark.parametrize("encoding", ["deflate", "gzip", "br"])
def test_undecodable_compressed_body_is_400_not_500(gw, encoding):
    # found by the fuzzer: aiohttp raised from request.read() and the gateway answered 500
    status, ctype, resp = request(gw["port"], "POST", "/v1/chat/completions", b"\x06",
                                  {"Content-Type": "application/json", "Content-Encoding": encoding})
    assert status == 400, resp
    check(status, ctype, resp, protocol_error_ok=True)


def test_gzip_compressed_valid_body_is_accepted(gw):
    body = gzip.compress(orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
    status, _, resp = request(gw["port"], "POST", "/v1/chat/completions", body,
                              {"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert status == 200, resp
