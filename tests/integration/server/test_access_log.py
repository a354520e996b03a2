"""The access log: one info line per request, with its id, route, status, backend,
TTFT and tokens, and never the caller's key or any part of the prompt. Real sockets,
the openai SDK, both server stacks."""

from __future__ import annotations

import hashlib
import logging

import aiohttp
import openai
import pytest

from tests.support.servers import ScriptedBackend, gateway_config, running_gateway

KEY = "sk-access-log-secret-0123456789"
PROMPT = "my-very-private-prompt-text"


@pytest.mark.parametrize("fast_path", [True, False])
async def test_every_request_leaves_one_line_without_key_or_prompt(fast_path, caplog):
    keys = {"keys": [{"name": "team-a", "key_sha256": hashlib.sha256(KEY.encode()).hexdigest()}]}
    async with ScriptedBackend().running() as be:
        cfg = gateway_config([{"name": "b", "url": be.url, "models": ["m"]}], auth=keys,
                             listen={"fast_path": fast_path})
        async with running_gateway(cfg) as gw:
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)
            messages = [{"role": "user", "content": PROMPT}]
            with caplog.at_level(logging.INFO, logger="gateway.access"):
                ok = await client.chat.completions.with_raw_response.create(
                    model="m", messages=messages, max_tokens=4, extra_headers={"x-request-id": "req-ok"})
                with pytest.raises(openai.NotFoundError):
                    await client.chat.completions.create(model="nope", messages=messages, max_tokens=4,
                                                         extra_headers={"x-request-id": "req-404"})
                wrong = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEY + "x", max_retries=0)
                with pytest.raises(openai.AuthenticationError):
                    await wrong.chat.completions.create(model="m", messages=messages, max_tokens=4,
                                                        extra_headers={"x-request-id": "req-401"})
                await client.models.list()
                async with aiohttp.ClientSession() as http:
                    async with http.get(gw.url + "/v1/nowhere", headers={"x-request-id": "req-route",
                                                                         "Authorization": f"Bearer {KEY}"}) as r:
                        assert r.status == 404
                    async with http.get(gw.url + "/health") as r:
                        assert r.status == 200
            await client.close()
            await wrong.close()
    assert ok.http_response.status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "gateway.access"]
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "gateway.access")
    by_id = {line.split()[1]: line for line in lines}
    served = by_id["req-ok"]
    assert "POST /v1/chat/completions 200" in served and "backend=b" in served and "model=m" in served
    assert "ttft_ms=" in served and "ttft_ms=-" not in served and "completion_tokens=" in served
    assert "POST /v1/chat/completions 404 error=model_not_found" in by_id["req-404"]
    assert "POST /v1/chat/completions 401 error=invalid_api_key" in by_id["req-401"]
    assert "GET /v1/nowhere 404" in by_id["req-route"]
    assert any("GET /v1/models 200" in line for line in lines)
    assert not any("/health" in line for line in lines)  # a passing probe is not logged
    assert len([line for line in lines if "req-ok" in line]) == 1
    for line in lines:
        assert KEY not in line and KEY[:12] not in line and PROMPT not in line and "team-a" not in line
