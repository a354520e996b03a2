"""Engine-control fields held back (issue 27, point 2): a caller cannot set the body
fields that steer an engine (a KV connector's peer, the engine's queue priority,
SGLang's bootstrap server, the engine's request id); ``limits.engine_fields`` lists
them, ``limits.engine_fields_action`` refuses (400 naming the field) or strips them,
and a key may be granted some (``auth.keys[].engine_fields``)."""

from __future__ import annotations

import hashlib

import openai
import orjson
import pytest

from tests.support.servers import ScriptedBackend, gateway_config, running_gateway

CHAT = [{"role": "user", "content": "hi"}]
DEFAULTS = {"kv_transfer_params": {"remote_host": "10.0.0.9", "remote_port": 5557, "remote_engine_id": "e",
                                   "remote_block_ids": [1, 2]},
            "priority": -100, "bootstrap_host": "10.0.0.9", "bootstrap_port": 8998, "bootstrap_room": 7,
            "rid": "someone-elses", "request_id": "someone-elses"}


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.mark.parametrize("fast_path", [True, False])
async def test_each_default_engine_field_is_refused_with_a_400_naming_it(fast_path):
    be = ScriptedBackend()
    async with be.running():
        cfg = gateway_config([{"name": "b", "url": be.url, "models": ["m"]}], listen={"fast_path": fast_path})
        async with running_gateway(cfg) as gw:
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
            for name, value in DEFAULTS.items():
                with pytest.raises(openai.BadRequestError) as e:
                    await client.chat.completions.create(model="m", messages=CHAT, extra_body={name: value})
                assert e.value.status_code == 400 and e.value.body["param"] == name  # type: ignore[index]
                assert e.value.body["code"] == "unsupported_parameter" and name in e.value.message  # type: ignore[index]
                with pytest.raises(openai.BadRequestError):
                    await client.completions.create(model="m", prompt="p", extra_body={name: value})
            assert be.bodies == []  # nothing reached the engine
            ok = await client.chat.completions.create(model="m", messages=CHAT, extra_body={"top_k": 5})
            assert ok.choices[0].message.content == "hello"  # other unknown fields pass through
            assert orjson.loads(be.bodies[-1])["top_k"] == 5


async def test_strip_removes_the_fields_and_serves_the_rest():
    be = ScriptedBackend()
    async with be.running(), running_gateway(gateway_config(
            [{"name": "b", "url": be.url, "models": ["m"]}],
            limits={"engine_fields_action": "strip", "engine_fields": ["priority", "kv_transfer_params", "x_mine"]})) \
            as gw:
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        await client.chat.completions.create(model="m", messages=CHAT,
                                             extra_body={"priority": -5, "x_mine": 1, "top_k": 3, "rid": "r"})
        sent = orjson.loads(be.bodies[-1])
        assert "priority" not in sent and "x_mine" not in sent
        assert sent["top_k"] == 3 and sent["rid"] == "r"  # not in this config's list
        assert sent["messages"] == CHAT


async def test_a_key_granted_a_field_may_set_it_and_no_other_key_may():
    be = ScriptedBackend()
    keys = [{"name": "orchestrator", "key_sha256": _sha("k-orch"), "engine_fields": ["priority"]},
            {"name": "tenant", "key_sha256": _sha("k-tenant")}]
    async with be.running(), running_gateway(gateway_config([{"name": "b", "url": be.url, "models": ["m"]}],
                                                            auth={"keys": keys})) as gw:
        orch = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k-orch", max_retries=0)
        tenant = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k-tenant", max_retries=0)
        await orch.chat.completions.create(model="m", messages=CHAT, extra_body={"priority": 10})
        assert orjson.loads(be.bodies[-1])["priority"] == 10
        with pytest.raises(openai.BadRequestError) as e:  # granted priority, not the KV peer
            await orch.chat.completions.create(model="m", messages=CHAT, extra_body={"kv_transfer_params": {}})
        assert e.value.body["param"] == "kv_transfer_params"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as e:
            await tenant.chat.completions.create(model="m", messages=CHAT, extra_body={"priority": 10})
        assert e.value.body["param"] == "priority"  # type: ignore[index]
        assert len(be.bodies) == 1
