"""The schemas of the gateway's OpenAPI document (``components.schemas``): each request and
answer body the gateway reads or answers with, by name, listing only the fields it reads or
writes (every other field passes through). :mod:`gateway.server.openapi` assembles the
document; :mod:`gateway.server.openapi_paths` refers to these by name.
"""

from __future__ import annotations

OBJECT = {"type": "object"}
_INT = {"type": "integer"}
_STRINGS = {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1}]}
_POOL_USAGE = {"type": "object", "properties": {"prompt_tokens": _INT, "total_tokens": _INT}}
_CONVERSATION_REF = {"oneOf": [{"type": "string"}, {"type": "object", "required": ["id"],
                                                    "properties": {"id": {"type": "string"}}}]}
_BATCH_STATUSES = ["validating", "in_progress", "finalizing", "cancelling", "completed", "failed", "expired",
                   "cancelled"]

_STREAMING = {
    "stream": {"type": ["boolean", "null"]},
    "stream_options": {"type": ["object", "null"], "properties": {"include_usage": {"type": "boolean"}}},
    "max_tokens": {"type": ["integer", "null"], "minimum": 1},
    "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1},
}


SCHEMAS = {
    "Error": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}},
    "ChatCompletionRequest": {
        "type": "object", "required": ["model", "messages"], "additionalProperties": True,
        "properties": {"model": {"type": "string", "minLength": 1},
                       "messages": {"type": "array", "minItems": 1, "items": {
                           "type": "object", "required": ["role"], "additionalProperties": True,
                           "properties": {"role": {"type": "string"}}}},
                       **_STREAMING}},
    "CompletionRequest": {
        "type": "object", "required": ["model", "prompt"], "additionalProperties": True,
        "properties": {"model": {"type": "string", "minLength": 1},
                       "prompt": {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1}]},
                       **_STREAMING}},
    "ChatCompletion": {
        "type": "object", "required": ["id", "object", "choices"], "additionalProperties": True,
        "properties": {"id": {"type": "string"}, "object": {"const": "chat.completion"},
                       "choices": {"type": "array", "items": OBJECT},
                       "usage": {"$ref": "#/components/schemas/CompletionUsage"}}},
    "Completion": {
        "type": "object", "required": ["id", "object", "choices"], "additionalProperties": True,
        "properties": {"id": {"type": "string"}, "object": {"const": "text_completion"},
                       "choices": {"type": "array", "items": OBJECT},
                       "usage": {"$ref": "#/components/schemas/CompletionUsage"}}},
    "CompletionUsage": {
        "type": "object", "properties": {
            "prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT,
            "prompt_tokens_details": {"type": ["object", "null"], "properties": {"cached_tokens": _INT}}}},
    "ResponsesRequest": {
        "type": "object", "required": ["model", "input"], "additionalProperties": True,
        "properties": {"model": {"type": "string", "minLength": 1},
                       "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": OBJECT}]},
                       "instructions": {"type": ["string", "null"]},
                       "max_output_tokens": {"type": ["integer", "null"], "minimum": 1},
                       "stream": {"type": ["boolean", "null"]}, "tools": {"type": "array"},
                       "previous_response_id": {"type": ["string", "null"], "description": (
                           "a response of the caller's, kept by the gateway: its input and output go "
                           "before `input`")},
                       "store": {"type": ["boolean", "null"], "description": "false: the gateway keeps "
                                                                             "nothing of this turn"},
                       "conversation": {**_CONVERSATION_REF, "description": (
                           "a conversation of the caller's, kept by the gateway: its items go before "
                           "`input`, the turn's input and output are appended to it")},
                       "background": {"type": ["boolean", "null"], "description": (
                           "true: answered `queued` at once and run by the gateway; poll "
                           "`GET /v1/responses/{id}` (not with `stream` or `store: false`)")}}},
    "InputTokensRequest": {
        "type": "object", "required": ["model"], "additionalProperties": True,
        "properties": {"model": {"type": "string", "minLength": 1},
                       "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": OBJECT}]},
                       "instructions": {"type": ["string", "null"]}, "tools": {"type": "array"},
                       "previous_response_id": {"type": ["string", "null"]},
                       "conversation": _CONVERSATION_REF}},
    "InputTokens": {"type": "object", "required": ["object", "input_tokens"], "properties": {
        "object": {"const": "response.input_tokens"}, "input_tokens": _INT}},
    "TokenizeRequest": {
        "type": "object", "required": ["model"], "additionalProperties": True,
        "anyOf": [{"required": ["prompt"]}, {"required": ["messages"]}, {"required": ["content"]}],
        "properties": {"model": {"type": "string", "minLength": 1}, "prompt": {"type": "string"},
                       "messages": {"type": "array", "minItems": 1, "items": OBJECT},
                       "content": {"type": "string", "description": "llama.cpp's shape: forwarded"},
                       "add_special_tokens": {"type": "boolean"}, "add_generation_prompt": {"type": "boolean"},
                       "return_token_strs": {"type": ["boolean", "null"]}}},
    "Tokens": {"type": "object", "required": ["tokens"], "additionalProperties": True, "properties": {
        "count": _INT, "max_model_len": {"type": ["integer", "null"]},
        "tokens": {"type": "array", "items": _INT},
        "token_strs": {"type": ["array", "null"], "items": {"type": "string"}}}},
    "DetokenizeRequest": {
        "type": "object", "required": ["model", "tokens"], "additionalProperties": True,
        "properties": {"model": {"type": "string", "minLength": 1},
                       "tokens": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}}},
    "Detokenized": {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
    "Conversation": {"type": "object", "required": ["id", "object", "created_at"], "properties": {
        "id": {"type": "string"}, "object": {"const": "conversation"}, "created_at": _INT,
        "metadata": {"type": "object", "additionalProperties": {"type": "string"}}}},
    "Response": {
        "type": "object", "required": ["id", "object", "status"], "additionalProperties": True,
        "properties": {"id": {"type": "string"}, "object": {"const": "response"},
                       "status": {"type": "string"}, "output": {"type": "array", "items": OBJECT},
                       "usage": {"type": "object", "properties": {
                           "input_tokens": _INT, "output_tokens": _INT, "total_tokens": _INT,
                           "input_tokens_details": {"type": "object",
                                                    "properties": {"cached_tokens": _INT}}}}}},
    "MessagesRequest": {
        "type": "object", "required": ["model", "messages", "max_tokens"], "additionalProperties": True,
        "properties": {"model": {"type": "string", "minLength": 1},
                       "messages": {"type": "array", "minItems": 1, "items": {
                           "type": "object", "required": ["role"], "additionalProperties": True,
                           "properties": {"role": {"enum": ["user", "assistant"]}}}},
                       "system": {"oneOf": [{"type": "string"}, {"type": "array", "items": OBJECT}]},
                       "max_tokens": {"type": "integer", "minimum": 1},
                       "stream": {"type": ["boolean", "null"]}, "tools": {"type": "array"}}},
    "Message": {
        "type": "object", "required": ["id", "type", "role", "content"], "additionalProperties": True,
        "properties": {"id": {"type": "string"}, "type": {"const": "message"}, "role": {"const": "assistant"},
                       "content": {"type": "array", "items": OBJECT}, "stop_reason": {"type": ["string", "null"]},
                       "usage": {"type": "object", "properties": {
                           "input_tokens": _INT, "output_tokens": _INT, "cache_read_input_tokens": _INT,
                           "cache_creation_input_tokens": _INT}}}},
    "CountTokensRequest": {
        "type": "object", "required": ["model", "messages"], "additionalProperties": True,
        "properties": {"model": {"type": "string", "minLength": 1},
                       "messages": {"type": "array", "minItems": 1, "items": OBJECT},
                       "system": {"oneOf": [{"type": "string"}, {"type": "array", "items": OBJECT}]}}},
    "CountTokens": {"type": "object", "required": ["input_tokens"], "properties": {"input_tokens": _INT}},
    "AnthropicError": {"type": "object", "required": ["type", "error"], "properties": {
        "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
            "type": {"type": "string"}, "message": {"type": "string"}}}}},
    "EmbeddingsRequest": {
        "type": "object", "required": ["model", "input"], "additionalProperties": True,
        "properties": {"model": {"type": "string", "minLength": 1}, "input": _STRINGS,
                       "encoding_format": {"enum": ["float", "base64"]}}},
    "EmbeddingList": {
        "type": "object", "required": ["object", "data"], "additionalProperties": True,
        "properties": {"object": {"const": "list"}, "usage": _POOL_USAGE, "data": {"type": "array", "items": {
            "type": "object", "properties": {"index": _INT, "embedding": {
                "oneOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}]}}}}}},
    "RerankRequest": {
        "type": "object", "required": ["model", "query", "documents"], "additionalProperties": True,
        "properties": {"model": {"type": "string", "minLength": 1}, "query": {"type": "string"},
                       "documents": {"type": "array", "minItems": 1, "items": {
                           "oneOf": [{"type": "string"}, OBJECT]}},
                       "top_n": {"type": "integer", "minimum": 1}}},
    "RerankResult": {
        "type": "object", "required": ["results"], "additionalProperties": True,
        "properties": {"usage": _POOL_USAGE, "results": {"type": "array", "items": {
            "type": "object", "properties": {"index": _INT, "relevance_score": {"type": "number"}}}}}},
    "ScoreRequest": {
        "type": "object", "required": ["model", "text_1", "text_2"], "additionalProperties": True,
        "properties": {"model": {"type": "string", "minLength": 1}, "text_1": _STRINGS, "text_2": _STRINGS}},
    "ScoreList": {
        "type": "object", "required": ["data"], "additionalProperties": True,
        "properties": {"usage": _POOL_USAGE, "data": {"type": "array", "items": {
            "type": "object", "properties": {"index": _INT, "score": {"type": "number"}}}}}},
    "Model": {"type": "object", "required": ["id", "object"],
              "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                             "created": {"type": "integer"}, "owned_by": {"type": "string"}}},
    "Usage": {
        "type": "object", "required": ["object", "since", "until", "data", "by_key_model", "totals"],
        "description": "Usage ledger buckets (one per key, model and hour; `hour` is its start in Unix "
                       "seconds), totals per key and model, and in all. `cost` is in the currency of "
                       "`usage.prices` (0 for unpriced models).",
        "properties": {"object": {"const": "usage"}, "since": {"type": "integer"},
                       "until": {"type": "integer"},
                       "data": {"type": "array", "items": {"type": "object"}},
                       "by_key_model": {"type": "array", "items": {"type": "object"}},
                       "totals": {"type": "object", "properties": {
                           "requests": {"type": "integer"}, "prompt_tokens": {"type": "integer"},
                           "cached_prompt_tokens": {"type": "integer"},
                           "completion_tokens": {"type": "integer"}, "errors": {"type": "integer"},
                           "total_tokens": {"type": "integer"}, "cost": {"type": "number"}}}}},
    "AdminBatch": {
        "type": "object", "required": ["id", "object", "status", "request_counts"],
        "additionalProperties": True,
        "description": "The OpenAI batch object plus `owner`, the name of the key that created it",
        "properties": {
            "id": {"type": "string"}, "object": {"const": "batch"},
            "status": {"enum": _BATCH_STATUSES},
            "request_counts": {"type": "object", "properties": {
                "total": {"type": "integer"}, "completed": {"type": "integer"},
                "failed": {"type": "integer"}}},
            "owner": {"type": ["string", "null"]},
            "progress": {"type": "object", "description": "GET /admin/batches/{batch_id} only",
                         "properties": {"results_recorded": {"type": "integer"},
                                        "in_flight": {"type": "integer"},
                                        "enqueued": {"type": "integer"},
                                        "to_enqueue": {"type": ["integer", "null"]},
                                        "closing": {"type": ["string", "null"]}}},
            "queue": {"type": "object", "description": "GET /admin/batches/{batch_id} only: the line "
                                                       "queue all batches share",
                      "properties": {"length": {"type": "integer"}, "pending": {"type": "integer"},
                                     "lag": {"type": ["integer", "null"]},
                                     "consumers": {"type": "array", "items": {
                                         "type": "object", "properties": {
                                             "name": {"type": "string"}, "pending": {"type": "integer"},
                                             "idle_ms": {"type": "integer"}}}}}}}},
}
