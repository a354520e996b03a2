"""Engine errors in OpenAI's terms: an inference engine's answer to a caller error,
recognised by the engine's own words and given the ``type``, ``code`` and ``param``
OpenAI uses for that error, so that clients which only know OpenAI's form (the openai
SDKs, LangChain, LiteLLM's ``ContextWindowExceededError``) recognise it. The engine's
message text is kept.

One pure function, :func:`classify`; :func:`gateway.pipeline.attempt._raise_status`
calls it on every non-200 answer of a backend. A classified answer is the caller's
error: it is never retried on another backend (it would fail the same way) and never
counts against the backend's circuit breaker.

What is recognised (the stable part of each engine's format string; N, M, P vary) and
the OpenAI ``code`` it becomes:

``context_length_exceeded`` (400, ``param`` ``messages`` for chat, ``prompt`` for
completions):

- vLLM, 400: ``This model's maximum context length is N tokens. However, you requested
  M tokens ...`` (older releases) and ``... However, your request has P input tokens
  ...`` (``vllm/entrypoints/openai/serving_engine.py``, later
  ``vllm/entrypoints/openai/engine/serving.py``, ``OpenAIServing._validate_input``);
  ``'max_tokens' or 'max_completion_tokens' is too large: M. This model's maximum
  context length is N tokens and your request has P input tokens (...)`` (the same
  function); ``This model's maximum context length is N tokens. However, you requested
  M output tokens and your prompt contains [at least] P input tokens ...`` and ``You
  passed P input tokens ... However, the model's context length is only N tokens ...``
  (``vllm/renderers/params.py``, ``TokenizeParams._token_len_check`` and
  ``_text_len_check``); ``The decoder prompt (length P) is longer than the maximum
  model length of N. ...`` (``vllm/v1/engine/processor.py``,
  ``Processor._validate_model_input``).
- SGLang, 400: ``The input (P tokens) is longer than the model's context length (N
  tokens).`` and ``Requested token count exceeds the model's maximum context length of
  N tokens. ...`` (``python/sglang/srt/managers/tokenizer_manager.py``,
  ``TokenizerManager._validate_one_request``); ``Input length (P tokens) exceeds the
  maximum allowed length (N tokens). ...`` (``python/sglang/srt/managers/utils.py``,
  ``validate_input_length``).
- TGI, 422: ``Input validation error: `inputs` tokens + `max_new_tokens` must be <= N.
  ...`` and ``Input validation error: `inputs` must have less than N tokens. ...``
  (``router/src/validation.rs``, ``Validation::validate_input``:
  ``ValidationError::MaxTotalTokens`` and ``InputLength``, prefixed by
  ``InferError::ValidationError`` in ``router/src/infer/mod.rs``).
- llama.cpp, 400: ``type`` ``exceed_context_size_error``, whatever the message
  (``tools/server/server-context.cpp``, ``update_slots`` sends
  ``ERROR_TYPE_EXCEED_CONTEXT_SIZE``; the wording changes between builds, the type does
  not).

``invalid_value`` (400, ``param`` the field the message names, else ``max_tokens``):

- vLLM, 400: ``max_tokens must be at least 1, got M.`` (``vllm/sampling_params.py``,
  ``SamplingParams._verify_args``); ``max_tokens=M cannot be greater than ...``
  (``vllm/renderers/params.py``, ``TokenizeParams.__post_init__``).
- SGLang, 400: ``max_completion_tokens is too large: M.This model supports at most N
  completion tokens.`` (``python/sglang/srt/entrypoints/openai/serving_chat.py``,
  ``OpenAIServingChat._validate_request``).
- TGI, 422: ``Input validation error: `max_new_tokens` must be strictly positive`` and
  ``... `max_new_tokens` must be <= N. Given: M`` (``router/src/validation.rs``,
  ``Validation::validate``: ``ValidationError::NegativeMaxNewTokens`` and
  ``MaxNewTokens``).

``invalid_function_parameters`` (400, ``param`` ``tools[I].function.parameters``):

- SGLang, 400: ``Tool I function has invalid 'parameters' schema: ...``
  (``OpenAIServingChat._validate_request``).

``model_not_found`` (404, ``param`` ``model`` when the message names the model field):

- vLLM, 404: ``The model `X` does not exist.`` (``OpenAIServing._check_model``: an
  unknown model or LoRA adapter).
- SGLang, 400: ``The following requested LoRA adapters are not loaded: ...``
  (``python/sglang/srt/lora/lora_registry.py``, ``LoRARegistry.acquire``; earlier
  ``TokenizerManager._validate_lora_adapters``).

The envelopes the engines wrap a message in:

- ``{"object": "error", "message": ..., "type": "BadRequestError", "param": null,
  "code": 400}``: vLLM's older ``ErrorResponse`` (``vllm/entrypoints/openai/protocol.py``)
  and SGLang (``OpenAIServingBase.create_error_response``);
- ``{"error": {"message": ..., "type": "BadRequestError", "param": ..., "code": 400}}``:
  vLLM's later ``ErrorResponse``;
- ``{"error": {"code": 400, "message": ..., "type": "exceed_context_size_error",
  "n_prompt_tokens": ..., "n_ctx": ...}}``: llama.cpp (``format_error_response`` in
  ``tools/server/server-common.cpp``, earlier ``utils.hpp``;
  ``server_task_result_error::to_json`` adds the counts);
- ``{"error": "...", "error_type": "validation"}`` with status 422: TGI
  (``ErrorResponse`` in ``router/src/lib.rs``; the status from ``impl From<InferError>
  for (StatusCode, Json<ErrorResponse>)`` in ``router/src/server.rs``).

A context-length wording is also recognised on a 500 (an engine's catch-all envelope
around a caller's error, such as SGLang's ``Internal server error: ...`` from
``OpenAIServingBase.handle_request``): it is still the caller's error, answered 400.
A body already in OpenAI's form with one of the codes above, at the status OpenAI uses
for it (an OpenAI-compatible server that classifies for itself), is kept byte for byte.
No other status (401, 413, 429, 502 to 504, ...) is ever classified.

Streamed requests: vLLM, llama.cpp and SGLang's request checks (``_validate_request``)
refuse a streamed request with the same status and body, which is classified. SGLang's
and TGI's other errors for a streamed request come as an error event inside a 200
stream (``data: {"error": ...}``): no error status reaches :func:`classify`, and they
are relayed as the engine sent them.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import orjson

from gateway.apis.registry import BY_NAME
from gateway.errors import error_body

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
INVALID_VALUE = "invalid_value"
INVALID_FUNCTION_PARAMETERS = "invalid_function_parameters"
MODEL_NOT_FOUND = "model_not_found"

# the status OpenAI answers each code with
OPENAI_STATUS = {CONTEXT_LENGTH_EXCEEDED: 400, INVALID_VALUE: 400, INVALID_FUNCTION_PARAMETERS: 400,
                 MODEL_NOT_FOUND: 404}

_NESTED, _FLAT, _TGI = "nested", "flat", "tgi"  # the envelopes (see the module docstring)


class _Rule(NamedTuple):
    code: str
    envelopes: frozenset[str]
    statuses: frozenset[int]  # the engine statuses the rule applies to
    pattern: re.Pattern[str] | None  # searched in the message; None: the envelope's type is ``error_type``
    param: str | None  # formatted with the pattern's named groups and ``prompt`` (messages or prompt)
    error_type: str | None = None


def _rule(code: str, envelopes: tuple[str, ...], statuses: tuple[int, ...], pattern: str | None,
          param: str | None, error_type: str | None = None) -> _Rule:
    return _Rule(code, frozenset(envelopes), frozenset(statuses), re.compile(pattern) if pattern else None, param,
                 error_type)


_CTX, _VALUE, _TOOLS, _MODEL = CONTEXT_LENGTH_EXCEEDED, INVALID_VALUE, INVALID_FUNCTION_PARAMETERS, MODEL_NOT_FOUND
_JSON = (_NESTED, _FLAT)  # vLLM, SGLang
_CTX_STATUS = (400, 500)
_RULES: tuple[_Rule, ...] = (
    # llama.cpp: the error type is the stable part
    _rule(_CTX, (_NESTED,), (400,), None, "{prompt}", error_type="exceed_context_size_error"),
    # vLLM (and OpenAI's own wording)
    _rule(_CTX, _JSON, _CTX_STATUS, r"maximum context length is \d+ tokens", "{prompt}"),
    _rule(_CTX, _JSON, _CTX_STATUS, r"the model's context length is only \d+ tokens", "{prompt}"),
    _rule(_CTX, _JSON, _CTX_STATUS, r"prompt \(length \d+\) .{0,80}?is longer than the maximum model length of \d+",
          "{prompt}"),
    # SGLang
    _rule(_CTX, _JSON, _CTX_STATUS, r"The input \(\d+ tokens\) is longer than the model's context length", "{prompt}"),
    _rule(_CTX, _JSON, _CTX_STATUS, r"Requested token count exceeds the model's maximum context length of \d+",
          "{prompt}"),
    _rule(_CTX, _JSON, _CTX_STATUS, r"Input length \(\d+ tokens\) exceeds the maximum allowed length", "{prompt}"),
    # TGI
    _rule(_CTX, (_TGI,), (422,), r"`inputs` tokens \+ `max_new_tokens` must be <= \d+", "{prompt}"),
    _rule(_CTX, (_TGI,), (422,), r"`inputs` must have less than \d+ tokens", "{prompt}"),
    # an invalid max_tokens
    _rule(_VALUE, _JSON, (400,), r"\b(?P<field>max_tokens|max_completion_tokens)=-?\d+ ?cannot be greater than",
          "{field}"),
    _rule(_VALUE, _JSON, (400,), r"\bmax_tokens must be at least 1, got -?\d+", "max_tokens"),
    _rule(_VALUE, _JSON, (400,), r"\b(?P<field>max_completion_tokens|max_tokens) is too large: \d+", "{field}"),
    _rule(_VALUE, (_TGI,), (422,), r"`max_new_tokens` must be (?:strictly positive|<= \d+)", "max_tokens"),
    # a bad tool schema
    _rule(_TOOLS, _JSON, (400,), r"\bTool (?P<index>\d+) function has invalid 'parameters' schema",
          "tools[{index}].function.parameters"),
    # an unknown model or LoRA adapter
    _rule(_MODEL, _JSON, (404,), r"^The model `[^`]*` does not exist", "model"),
    _rule(_MODEL, _JSON, (400,), r"requested LoRA adapters are not loaded", None),
)


# the statuses :func:`classify` may classify (any other is relayed as the engine sent it)
CLASSIFIED_STATUSES = frozenset({s for rule in _RULES for s in rule.statuses} | set(OPENAI_STATUS.values()))


class _EngineError(NamedTuple):
    envelope: str
    message: str
    error_type: object
    code: object


def _engine_error(obj: object) -> _EngineError | None:
    """The message, ``type`` and ``code`` of an engine's error body in one of the
    envelopes of the module docstring, or ``None``."""
    if not isinstance(obj, dict):
        return None
    err = obj.get("error")
    if isinstance(err, dict):
        message = err.get("message")
        return _EngineError(_NESTED, message, err.get("type"), err.get("code")) if isinstance(message, str) else None
    if isinstance(err, str):
        return _EngineError(_TGI, err, obj.get("error_type"), None) if isinstance(obj.get("error_type"), str) else None
    message = obj.get("message")
    if obj.get("object") == "error" and isinstance(message, str):
        return _EngineError(_FLAT, message, obj.get("type"), obj.get("code"))
    return None


def context_length_exceeded(limit: int, prompt_tokens: int, max_tokens: int | None,
                            endpoint: str) -> tuple[int, bytes, str]:
    """The answer to a prompt the gateway knows cannot fit, in the form of
    :func:`classify`'s: ``(400, OpenAI error body, "context_length_exceeded")``, with
    vLLM's wording (``limit`` the context length, ``prompt_tokens`` exact, ``max_tokens``
    as requested or ``None``; ``endpoint`` names the ``param``)."""
    if max_tokens is None:
        message = (f"This model's maximum context length is {limit} tokens. However, your request has "
                   f"{prompt_tokens} input tokens. Please reduce the length of the input messages.")
    else:
        message = (f"This model's maximum context length is {limit} tokens. However, you requested "
                   f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
                   "completion). Please reduce the length of the messages or completion.")
    status = OPENAI_STATUS[CONTEXT_LENGTH_EXCEEDED]
    param = BY_NAME[endpoint].prompt_param
    return status, error_body(message, status, code=CONTEXT_LENGTH_EXCEEDED, param=param,
                              type_="invalid_request_error"), CONTEXT_LENGTH_EXCEEDED


def classify(status: int, body: bytes, endpoint: str) -> tuple[int, bytes, str] | None:
    """Classify a backend's error answer as a caller error in OpenAI's terms.

    ``status``: the backend's HTTP status; ``body``: its response body (bytes, JSON or
    not); ``endpoint``: the API's name (:mod:`gateway.apis`; its ``prompt_param`` is
    the request field a context-length error names: ``messages``, ``prompt``...).

    Returns ``(status, body, code)``: the status OpenAI answers with (400, or 404 for
    ``model_not_found``), the OpenAI error body ``{"error": {"message": <the engine's
    message>, "type": "invalid_request_error", "param": ..., "code": ...}}`` as bytes,
    and the OpenAI code (``context_length_exceeded``, ``invalid_value``,
    ``invalid_function_parameters``, ``model_not_found``). A body already in OpenAI's
    form with one of those codes is returned unchanged. Returns ``None`` for any other
    answer (unrecognised, not JSON, a status the rule does not cover), which is then
    relayed as before. Raises nothing.

    The engine wordings and their sources (engine file and function) are listed in
    the module docstring.
    """
    if status < 400:
        return None
    try:
        found = _engine_error(orjson.loads(body))
    except orjson.JSONDecodeError:
        return None
    if found is None:
        return None
    if found.envelope == _NESTED and found.error_type == "invalid_request_error" and isinstance(found.code, str) \
            and OPENAI_STATUS.get(found.code) == status:
        return status, body, found.code
    for rule in _RULES:
        if found.envelope not in rule.envelopes or status not in rule.statuses:
            continue
        groups: dict[str, str] = {}
        if rule.pattern is None:
            if found.error_type != rule.error_type:
                continue
        else:
            match = rule.pattern.search(found.message)
            if match is None:
                continue
            groups = match.groupdict()
        openai_status = OPENAI_STATUS[rule.code]
        param = None if rule.param is None else rule.param.format(
            prompt=BY_NAME[endpoint].prompt_param, **groups)
        return openai_status, error_body(found.message, openai_status, code=rule.code, param=param,
                                         type_="invalid_request_error"), rule.code
    return None
