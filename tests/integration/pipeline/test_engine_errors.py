"""Engine errors classified the OpenAI way (issue 19, part 2).

Each engine's real answer to a caller error (status, JSON body, content type, the
format strings taken from the engines' sources, see :mod:`gateway.pipeline.engine_errors`) is
replayed by two scripted backends of one model behind a running gateway: the client
gets OpenAI's form (status, ``type`` ``invalid_request_error``, ``code``, ``param``)
with the engine's message, after exactly one backend attempt, and no breaker opens.
Unrecognised 4xx pass through byte for byte. The last test sends a prompt longer than
its context to two real llama.cpp ``llama-server`` processes.
"""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
import orjson
import pytest
from aiohttp import web

from gateway.errors import BackendStatus
from gateway.pipeline.engine_errors import classify
from tests.support import engines
from tests.support.servers import ScriptedBackend, gateway_config, running_gateway

PROMPT = "why is the sky blue?"
JSON = "application/json"


@dataclass(frozen=True)
class Answer:
    """One engine answer: status, content type and body as the engine sends them."""

    status: int
    body: bytes
    content_type: str = JSON

    @property
    def message(self) -> str:
        obj = orjson.loads(self.body)
        err = obj.get("error", obj)
        return err if isinstance(err, str) else err["message"]


def vllm_flat(message: str, status: int = 400, type_: str = "BadRequestError") -> Answer:
    """vLLM's older ``ErrorResponse`` (and SGLang's): a flat object."""
    return Answer(status, orjson.dumps({"object": "error", "message": message, "type": type_, "param": None,
                                        "code": status}))


def vllm_nested(message: str, status: int = 400, param: str | None = None, type_: str = "BadRequestError") -> Answer:
    """vLLM's later ``ErrorResponse``: ``{"error": {...}}``."""
    return Answer(status, orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": status}}))


def tgi(message: str) -> Answer:
    """TGI's ``ErrorResponse`` for an ``InferError::ValidationError``: 422."""
    return Answer(422, orjson.dumps({"error": message, "error_type": "validation"}))


# What llama-server (the build the real-engine suite uses) answered a prompt of 400
# words with a 256-token context, on chat and completions, streamed or not.
LLAMA_CPP = Answer(400, b'{"error":{"code":400,"message":"request (410 tokens) exceeds the available context size '
                        b'(256 tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":410,'
                        b'"n_ctx":256}}', "application/json; charset=utf-8")

BOTH = ("chat", "completions")


@dataclass(frozen=True)
class Case:
    answer: Answer
    code: str
    param: str | dict[str, str] | None  # a dict: per endpoint
    status: int = 400
    streamed: bool = True  # the engine answers a streamed request the same way (else: inside a 200 stream)
    endpoints: tuple[str, ...] = BOTH


CONTEXT = {"chat": "messages", "completions": "prompt"}

CASES = {
    # vLLM, OpenAIServing._validate_input (older releases: flat envelope)
    "vllm-requested-tokens": Case(vllm_flat(
        "This model's maximum context length is 4096 tokens. However, you requested 4196 tokens (4096 in the "
        "messages, 100 in the completion). Please reduce the length of the messages or completion."),
        "context_length_exceeded", CONTEXT),
    "vllm-requested-tokens-no-max-tokens": Case(vllm_flat(
        "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens in the messages, "
        "Please reduce the length of the messages."), "context_length_exceeded", CONTEXT),
    # vLLM, the same function in later releases (nested envelope)
    "vllm-max-tokens-too-large": Case(vllm_nested(
        "'max_tokens' or 'max_completion_tokens' is too large: 1000. This model's maximum context length is 4096 "
        "tokens and your request has 3500 input tokens (1000 > 4096 - 3500)."), "context_length_exceeded", CONTEXT),
    "vllm-request-has-input-tokens": Case(vllm_nested(
        "This model's maximum context length is 4096 tokens. However, your request has 5000 input tokens. Please "
        "reduce the length of the input messages."), "context_length_exceeded", CONTEXT),
    # vLLM, vllm/renderers/params.py TokenizeParams._token_len_check (VLLMValidationError: param set)
    "vllm-renderer-context-only": Case(vllm_nested(
        "You passed 5000 input tokens and requested 100 output tokens. However, the model's context length is only "
        "4096 tokens, resulting in a maximum input length of 3996 tokens. Please reduce the length of the input "
        "prompt. (parameter=input_tokens, value=5000)", param="input_tokens"), "context_length_exceeded", CONTEXT),
    "vllm-renderer-prompt-contains": Case(vllm_nested(
        "This model's maximum context length is 4096 tokens. However, you requested 100 output tokens and your "
        "prompt contains at least 4097 input tokens, for a total of at least 4197 tokens. Please reduce the length "
        "of the input prompt or the number of requested output tokens. (parameter=input_tokens, value=4097)",
        param="input_tokens"), "context_length_exceeded", CONTEXT),
    # vLLM, vllm/v1/engine/processor.py Processor._validate_model_input (raised in the engine: non-streamed only)
    "vllm-decoder-prompt": Case(vllm_nested(
        "The decoder prompt (length 5000) is longer than the maximum model length of 4096. Make sure that "
        "`max_model_len` is no smaller than the number of text tokens."), "context_length_exceeded", CONTEXT,
        streamed=False),
    # vLLM, SamplingParams._verify_args and TokenizeParams.__post_init__
    "vllm-max-tokens-at-least-1": Case(vllm_flat("max_tokens must be at least 1, got 0."), "invalid_value",
                                       "max_tokens"),
    "vllm-max-tokens-greater-than-context": Case(vllm_nested(
        "max_tokens=5000cannot be greater than max_model_len=max_total_tokens=4096. Please request fewer output "
        "tokens. (parameter=max_tokens, value=5000)", param="max_tokens"), "invalid_value", "max_tokens"),
    # vLLM, OpenAIServing._check_model: an unknown model or LoRA adapter
    "vllm-model-does-not-exist": Case(vllm_flat("The model `m` does not exist.", 404, "NotFoundError"),
                                      "model_not_found", "model", status=404),
    # SGLang, TokenizerManager._validate_one_request (a streamed request gets an error event in a 200 stream)
    "sglang-input-longer": Case(vllm_flat(
        "The input (5000 tokens) is longer than the model's context length (4096 tokens)."),
        "context_length_exceeded", CONTEXT, streamed=False),
    "sglang-requested-token-count": Case(vllm_flat(
        "Requested token count exceeds the model's maximum context length of 4096 tokens. You requested a total of "
        "4196 tokens: 4096 tokens from the input messages and 100 tokens for the completion. Please reduce the "
        "number of tokens in the input messages or the completion to fit within the limit."),
        "context_length_exceeded", CONTEXT, streamed=False),
    # SGLang, OpenAIServingChat._validate_request (before any stream: streamed too; chat only)
    "sglang-max-completion-tokens": Case(vllm_flat(
        "max_completion_tokens is too large: 5000.This model supports at most 4096 completion tokens."),
        "invalid_value", "max_completion_tokens", endpoints=("chat",)),
    "sglang-tool-schema": Case(vllm_flat(
        "Tool 1 function has invalid 'parameters' schema: 'objectx' is not valid under any of the given schemas"),
        "invalid_function_parameters", "tools[1].function.parameters", endpoints=("chat",)),
    # SGLang, LoRARegistry.acquire
    "sglang-lora-not-loaded": Case(vllm_flat(
        "The following requested LoRA adapters are not loaded: sql-lora\nLoaded adapters: dict_keys(['tone-lora'])."),
        "model_not_found", None, status=404, streamed=False),
    # SGLang, OpenAIServingBase.handle_request's catch-all: a 5xx-worded caller error
    "sglang-internal-server-error-context": Case(vllm_flat(
        "Internal server error: The input (5000 tokens) is longer than the model's context length (4096 tokens).",
        500, "InternalServerError"), "context_length_exceeded", CONTEXT, streamed=False),
    # TGI, Validation::validate_input / validate (422; a streamed request gets an error event in a 200 stream)
    "tgi-max-total-tokens": Case(tgi(
        "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096. Given: 4000 `inputs` tokens "
        "and 200 `max_new_tokens`"), "context_length_exceeded", CONTEXT, streamed=False),
    "tgi-input-length": Case(tgi("Input validation error: `inputs` must have less than 4095 tokens. Given: 5000"),
                             "context_length_exceeded", CONTEXT, streamed=False),
    "tgi-max-new-tokens": Case(tgi("Input validation error: `max_new_tokens` must be strictly positive"),
                               "invalid_value", "max_tokens", streamed=False),
    # llama.cpp, recorded from the real llama-server
    "llama.cpp-exceed-context-size": Case(LLAMA_CPP, "context_length_exceeded", CONTEXT),
}


def request_body(endpoint: str, stream: bool) -> dict:
    body: dict = {"model": "m", "max_tokens": 16, "stream": stream}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    return body


async def post(url: str, endpoint: str, body: dict) -> tuple[int, dict[str, str], bytes]:
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, json=body) as r:
            return r.status, dict(r.headers), await r.read()


def replaying(answer: Answer) -> ScriptedBackend:
    async def handler(backend, request, body):
        return web.Response(status=answer.status, body=answer.body, headers={"Content-Type": answer.content_type})
    return ScriptedBackend(handler=handler)


def two_backends_config(a: ScriptedBackend, b: ScriptedBackend):
    # one counted failure would open a breaker
    return gateway_config([{"name": "a", "url": a.url, "models": ["m"]}, {"name": "b", "url": b.url, "models": ["m"]}],
                          breaker={"failure_threshold": 1})


def breakers_closed(gw) -> bool:
    return all(x.breaker.state == "closed" for x in gw.state.fleet.backends.values())


@pytest.mark.parametrize("name", list(CASES))
async def test_engine_error_answered_the_openai_way_once(name):
    case = CASES[name]
    answer = case.answer
    async with replaying(answer).running() as a, replaying(answer).running() as b:
        async with running_gateway(two_backends_config(a, b)) as gw:
            sent = 0
            for endpoint in case.endpoints:
                for stream in ((False, True) if case.streamed else (False,)):
                    status, headers, raw = await post(gw.url, endpoint, request_body(endpoint, stream))
                    sent += 1
                    where = f"{endpoint}, stream={stream}"
                    assert status == case.status, where
                    assert headers["Content-Type"].startswith(JSON), where
                    param = case.param[endpoint] if isinstance(case.param, dict) else case.param
                    assert orjson.loads(raw) == {"error": {"message": answer.message, "type": "invalid_request_error",
                                                           "param": param, "code": case.code}}, where
                    assert len(a.attempt_times) + len(b.attempt_times) == sent, f"{where}: retried"
            assert gw.metric("turbo_gateway_upstream_errors_total", backend="a", reason=f"status_{answer.status}") + \
                gw.metric("turbo_gateway_upstream_errors_total", backend="b", reason=f"status_{answer.status}") == sent
            assert gw.metric("turbo_gateway_retries_total", reason=f"status_{answer.status}") == 0
            assert breakers_closed(gw)
            assert gw.idle("a") and gw.idle("b")


UNRECOGNISED = {
    # TGI's other validation errors (router/src/validation.rs ValidationError::Temperature)
    "tgi-temperature": tgi("Input validation error: `temperature` must be strictly positive"),
    # llama.cpp's other invalid requests already say invalid_request_error
    "llama.cpp-invalid-n": Answer(400, b'{"error":{"code":400,"message":"Field \'n\': Value must be between 1 <= '
                                       b'value <= 1, but got 2","type":"invalid_request_error"}}',
                                  "application/json; charset=utf-8"),
    # vLLM's pydantic validation of a field
    "vllm-other-400": vllm_nested("1 validation error:\n  {'type': 'missing', 'loc': ('body', 'messages')}"),
    # a context-length wording at a status no engine uses for it
    "context-wording-at-413": vllm_nested("This model's maximum context length is 4096 tokens.", 413),
    # OpenAI's form already, code included: relayed untouched (only its code is read)
    "openai-form": Answer(400, b'{"error": {"message": "This model\'s maximum context length is 8192 tokens. However, '
                               b'your messages resulted in 9000 tokens.", "type": "invalid_request_error", '
                               b'"param": "messages", "code": "context_length_exceeded"}}'),
}


@pytest.mark.parametrize("name", list(UNRECOGNISED))
async def test_unrecognised_4xx_passes_through_byte_for_byte(name):
    answer = UNRECOGNISED[name]
    async with replaying(answer).running() as a, replaying(answer).running() as b:
        async with running_gateway(two_backends_config(a, b)) as gw:
            for endpoint in BOTH:
                status, _, raw = await post(gw.url, endpoint, request_body(endpoint, False))
                assert (status, raw) == (answer.status, answer.body)
            assert len(a.attempt_times) + len(b.attempt_times) == 2
            assert breakers_closed(gw)


async def test_error_event_in_a_200_stream_is_relayed_as_the_engine_sent_it():
    """SGLang's context-length error for a streamed request (its ``_generate_chat_stream``
    catches the ValueError after the 200): no error status, so nothing to classify."""
    event = (b'data: {"error": {"object": "error", "message": "The input (5000 tokens) is longer than the model\'s '
             b'context length (4096 tokens).", "type": "BadRequestError", "param": null, "code": 400}}\n\n'
             b'data: [DONE]\n\n')

    async def handler(backend, request, body):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(event)
        await resp.write_eof()
        return resp

    async with ScriptedBackend(handler=handler).running() as be:
        cfg = gateway_config([{"name": "a", "url": be.url, "models": ["m"]}])
        async with running_gateway(cfg) as gw:
            status, _, raw = await post(gw.url, "chat", request_body("chat", True))
            assert (status, raw) == (200, event)


def test_backend_status_carries_the_openai_code():
    answer = CASES["vllm-request-has-input-tokens"].answer
    err = BackendStatus("a", 400, answer.body, JSON, None, classify(400, answer.body, "chat"))
    assert (err.status, err.backend_status, err.code, err.retryable, err.reason) == (
        400, 400, "context_length_exceeded", False, "status_400")
    assert orjson.loads(err.body)["error"]["message"] == answer.message
    plain = BackendStatus("a", 400, b'{"error": {"message": "no"}}', JSON)
    assert (plain.code, plain.body) == (None, b'{"error": {"message": "no"}}')
    wrapped = BackendStatus("a", 500, CASES["sglang-internal-server-error-context"].answer.body, JSON, None,
                            classify(500, CASES["sglang-internal-server-error-context"].answer.body, "completions"))
    assert (wrapped.status, wrapped.backend_status, wrapped.code) == (400, 500, "context_length_exceeded")


@pytest.mark.parametrize("status, body", [
    (503, CASES["vllm-request-has-input-tokens"].answer.body),  # retryable statuses stay the backend's
    (429, CASES["vllm-request-has-input-tokens"].answer.body),
    (404, CASES["sglang-input-longer"].answer.body),
    (422, CASES["vllm-request-has-input-tokens"].answer.body),  # TGI's status, not TGI's envelope
    (400, CASES["tgi-max-total-tokens"].answer.body),  # TGI's envelope, not TGI's status
    (400, b"This model's maximum context length is 4096 tokens."),  # not JSON
    (400, b'["This model\'s maximum context length is 4096 tokens."]'),
    (400, b'{"error": {"message": 42}}'),
    (400, b'{"error": {"code": 400, "message": "m", "type": "server_error"}}'),
    (204, b""),
])
def test_classify_leaves_other_answers_alone(status, body):
    assert classify(status, body, "chat") is None


# ---- a real engine: llama.cpp llama-server -----------------------------------------

CTX = 256  # tokens per slot: a prompt of 400 words is well over it


@pytest.fixture(scope="module")
def small_context_engines(tmp_path_factory):
    binary = engines.llama_server_bin()
    if binary is None:
        pytest.skip(engines.ENABLE_HINT)
    if engines.missing_model_deps():
        pytest.skip(f"needs {', '.join(engines.missing_model_deps())} to generate its model: pip install -e '.[test]'")
    model = engines.tiny_model()
    work = tmp_path_factory.mktemp("engine-errors")
    servers: list[engines.LlamaServer] = []
    try:
        for i in range(2):
            servers.append(engines.LlamaServer(binary, model, work, name=f"llama-{i}", parallel=1,
                                               ctx_per_slot=CTX).start())
        yield servers
    finally:
        for s in servers:
            s.stop()


@pytest.mark.engine
@pytest.mark.slow
async def test_real_llama_server_prompt_longer_than_its_context(small_context_engines):
    long_prompt = " ".join(["word"] * 400)
    cfg = gateway_config([{"name": s.name, "url": s.url, "models": [engines.MODEL_ALIAS]}
                          for s in small_context_engines], breaker={"failure_threshold": 1})
    async with running_gateway(cfg) as gw:
        sent = 0
        for endpoint in BOTH:
            for stream in (False, True):
                body = {**request_body(endpoint, stream), "model": engines.MODEL_ALIAS}
                body["messages" if endpoint == "chat" else "prompt"] = (
                    [{"role": "user", "content": long_prompt}] if endpoint == "chat" else long_prompt)
                direct_status, _, direct = await post(small_context_engines[0].url, endpoint, body)
                engine_error = orjson.loads(direct)["error"]
                assert (direct_status, engine_error["type"]) == (400, "exceed_context_size_error")
                status, _, raw = await post(gw.url, endpoint, body)
                sent += 1
                assert status == 400, raw
                assert orjson.loads(raw) == {"error": {"message": engine_error["message"],
                                                       "type": "invalid_request_error",
                                                       "param": CONTEXT[endpoint],
                                                       "code": "context_length_exceeded"}}
        attempts = sum(gw.metric("turbo_gateway_upstream_errors_total", backend=s.name, reason="status_400")
                       for s in small_context_engines)
        assert attempts == sent  # one attempt each: never retried on the other engine
        assert breakers_closed(gw)
        assert all(gw.idle(s.name) for s in small_context_engines)
