"""gateway/pipeline/attempt.py's ``_no_route``: which engine answers say that the
backend has no route for an API (learned, the request retried elsewhere) and which are
about the request (relayed to the client)."""

from __future__ import annotations

import pytest

from gateway.pipeline.attempt import _no_route

LLAMA_501 = b'{"error":{"code":501,"message":"This server does not support %s.","type":"not_supported_error"}}'


@pytest.mark.parametrize("status, body", [
    (404, b'{"detail":"Not Found"}'),  # FastAPI (vLLM, SGLang)
    (404, b'{"error":{"message":"File Not Found","type":"not_found_error","code":404}}'),  # llama.cpp
    (404, b"404: Not Found"),  # aiohttp
    (501, LLAMA_501 % b"embeddings"),  # llama-server without --embeddings
    (501, LLAMA_501 % b"reranking"),  # without --reranking
    (501, LLAMA_501 % b"completions"),  # a generating API on a server started with --embeddings

])
def test_answers_that_say_the_api_has_no_route(status, body):
    assert _no_route(status, body)


@pytest.mark.parametrize("status, body", [
    (404, b'{"error":{"message":"The model `x` does not exist.","type":"NotFoundError","code":404}}'),
    (404, b'{"error":{"message":"Response resp_1 not found for model m"}}'),
    (400, b'{"error":{"message":"This server does not support embeddings."}}'),  # a 400 is about the request
    (501, b'{"error":{"message":"Not implemented: beam search"}}'),  # a feature of the request, not the API
    (500, b"Not Found"),
])
def test_answers_about_the_request_are_not(status, body):
    assert not _no_route(status, body)
