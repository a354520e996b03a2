"""The OpenAPI 3.1 document of the gateway's own HTTP API, served at ``GET /openapi.json``
(:mod:`gateway.ops.admin` routes it): every API the gateway routes (chat and
completions, Responses, Anthropic Messages, embeddings, rerank, score, tokenize: the
paths of :mod:`gateway.apis.registry`), the stored responses and conversations
(:mod:`gateway.server.stored_routes`), models, usage, health, metrics and the admin endpoints,
with their error answers; and the same document without the admin endpoints, for a
gateway without an admin key. Schemas list only the fields the gateway reads or
answers with; every other field passes through. It is data, kept apart from the
handlers it describes so that they read as code. It is one document, over 400 lines
because every route and schema is spelled out in it: split, it would no longer read as
the one API it describes.
"""

from __future__ import annotations

import orjson

_ERROR = {"$ref": "#/components/schemas/Error"}


def _err(desc: str) -> dict:
    return {"description": desc, "content": {"application/json": {"schema": _ERROR}}}


_COMMON_ERRORS = {
    "400": _err("malformed JSON or an invalid field"),
    "401": _err("missing or wrong API key (when keys are configured)"),
    "404": _err("unknown model"),
    "413": _err("body over limits.max_body_bytes"),
    "415": _err("not a JSON content type"),
    "429": _err("a per-key limit; see Retry-After"),
    "502": _err("the backends failed"),
    "503": _err("no backend available or the fleet is saturated; see Retry-After"),
    "504": _err("the backends timed out"),
}

_ANTHROPIC_ERRORS = {status: {"description": e["description"], "content": {"application/json": {
    "schema": {"$ref": "#/components/schemas/AnthropicError"}}}} for status, e in _COMMON_ERRORS.items()}
_PREFILL_ONLY = " Priced as prefill only (no output tokens); never streams."


def _api(op_id: str, request: str, answer: str, desc: str, errors: dict = _COMMON_ERRORS,
         security: list | None = None, streams: bool = True) -> dict:
    """A ``POST`` of one routed API: its request and answer schemas (component names)."""
    ok = "the engine's answer (JSON), or its stream (text/event-stream)" if streams else "the engine's answer"
    op = {"operationId": op_id, "description": desc,
          "requestBody": {"required": True, "content": {"application/json": {
              "schema": {"$ref": f"#/components/schemas/{request}"}}}},
          "responses": {"200": {"description": ok, "content": {"application/json": {
              "schema": {"$ref": f"#/components/schemas/{answer}"}}}}, **errors}}
    if security is not None:
        op["security"] = security
    return {"post": op}


def _rerank(op_id: str) -> dict:
    return _api(op_id, "RerankRequest", "RerankResult",
                "Rerank `documents` by relevance to `query` (vLLM's and Jina's shape); `/v1/rerank`, `/rerank` "
                "and `/v2/rerank` are one API, sent upstream as `/v1/rerank`." + _PREFILL_ONLY, streams=False)


_OBJ = {"type": "object"}
_INT = {"type": "integer"}
_STRINGS = {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1}]}
_POOL_USAGE = {"type": "object", "properties": {"prompt_tokens": _INT, "total_tokens": _INT}}
_RESPONSE_ID = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
_CONVERSATION_ID = {"name": "conversation_id", "in": "path", "required": True, "schema": {"type": "string"}}
_ITEM_ID = {"name": "item_id", "in": "path", "required": True, "schema": {"type": "string"}}
_PAGE = [{"name": n, "in": "query", "required": False, "schema": sch} for n, sch in (
    ("order", {"enum": ["asc", "desc"]}), ("limit", {"type": "integer", "minimum": 1, "maximum": 100}),
    ("after", {"type": "string"}))]
_STORE_ERRORS = {"404": _err("no such object of the caller's"), "503": _err("the store did not answer")}
_CONVERSATION = {"200": {"description": "the conversation", "content": {"application/json": {
    "schema": {"$ref": "#/components/schemas/Conversation"}}}}, **_STORE_ERRORS}
_ITEMS = {"200": {"description": "a list of items (`data`, `first_id`, `last_id`, `has_more`)"}, **_STORE_ERRORS}
_CONVERSATION_REF = {"oneOf": [{"type": "string"}, {"type": "object", "required": ["id"],
                                                    "properties": {"id": {"type": "string"}}}]}
_ANTHROPIC_KEY: list[dict[str, list[str]]] = [{"bearer": []}, {"apiKey": []}]

_BATCH_STATUSES = ["validating", "in_progress", "finalizing", "cancelling", "completed", "failed", "expired",
                   "cancelled"]

_STREAMING = {
    "stream": {"type": ["boolean", "null"]},
    "stream_options": {"type": ["object", "null"], "properties": {"include_usage": {"type": "boolean"}}},
    "max_tokens": {"type": ["integer", "null"], "minimum": 1},
    "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1},
}

_USAGE_PARAMS = [
    {"name": "model", "in": "query", "required": False, "description": "only this model's usage",
     "schema": {"type": "string"}},
    {"name": "since", "in": "query", "required": False,
     "description": "Unix seconds or ISO 8601 (rounded down to its hour); default: 24 hours before `until`",
     "schema": {"type": "string"}},
    {"name": "until", "in": "query", "required": False,
     "description": "Unix seconds or ISO 8601 (exclusive: hours that start before it); default: now",
     "schema": {"type": "string"}},
]

OPENAPI = {
    "openapi": "3.1.0",
    "info": {"title": "turbo-gateway", "version": "0.1.0",
             "description": "OpenAI-compatible gateway, also serving Anthropic's Messages API. Request bodies are "
                            "forwarded byte for byte; only the fields below are validated, every other field passes "
                            "through to the backend."},
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                            "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key",
                                       "description": "the same keys, as the anthropic SDK sends them"}},
        "schemas": {
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
                               "choices": {"type": "array", "items": _OBJ},
                               "usage": {"$ref": "#/components/schemas/CompletionUsage"}}},
            "Completion": {
                "type": "object", "required": ["id", "object", "choices"], "additionalProperties": True,
                "properties": {"id": {"type": "string"}, "object": {"const": "text_completion"},
                               "choices": {"type": "array", "items": _OBJ},
                               "usage": {"$ref": "#/components/schemas/CompletionUsage"}}},
            "CompletionUsage": {
                "type": "object", "properties": {
                    "prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT,
                    "prompt_tokens_details": {"type": ["object", "null"], "properties": {"cached_tokens": _INT}}}},
            "ResponsesRequest": {
                "type": "object", "required": ["model", "input"], "additionalProperties": True,
                "properties": {"model": {"type": "string", "minLength": 1},
                               "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": _OBJ}]},
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
                               "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": _OBJ}]},
                               "instructions": {"type": ["string", "null"]}, "tools": {"type": "array"},
                               "previous_response_id": {"type": ["string", "null"]},
                               "conversation": _CONVERSATION_REF}},
            "InputTokens": {"type": "object", "required": ["object", "input_tokens"], "properties": {
                "object": {"const": "response.input_tokens"}, "input_tokens": _INT}},
            "TokenizeRequest": {
                "type": "object", "required": ["model"], "additionalProperties": True,
                "anyOf": [{"required": ["prompt"]}, {"required": ["messages"]}, {"required": ["content"]}],
                "properties": {"model": {"type": "string", "minLength": 1}, "prompt": {"type": "string"},
                               "messages": {"type": "array", "minItems": 1, "items": _OBJ},
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
                               "status": {"type": "string"}, "output": {"type": "array", "items": _OBJ},
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
                               "system": {"oneOf": [{"type": "string"}, {"type": "array", "items": _OBJ}]},
                               "max_tokens": {"type": "integer", "minimum": 1},
                               "stream": {"type": ["boolean", "null"]}, "tools": {"type": "array"}}},
            "Message": {
                "type": "object", "required": ["id", "type", "role", "content"], "additionalProperties": True,
                "properties": {"id": {"type": "string"}, "type": {"const": "message"}, "role": {"const": "assistant"},
                               "content": {"type": "array", "items": _OBJ}, "stop_reason": {"type": ["string", "null"]},
                               "usage": {"type": "object", "properties": {
                                   "input_tokens": _INT, "output_tokens": _INT, "cache_read_input_tokens": _INT,
                                   "cache_creation_input_tokens": _INT}}}},
            "CountTokensRequest": {
                "type": "object", "required": ["model", "messages"], "additionalProperties": True,
                "properties": {"model": {"type": "string", "minLength": 1},
                               "messages": {"type": "array", "minItems": 1, "items": _OBJ},
                               "system": {"oneOf": [{"type": "string"}, {"type": "array", "items": _OBJ}]}}},
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
                                   "oneOf": [{"type": "string"}, _OBJ]}},
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
        },
    },
    "security": [{"bearer": []}],
    "paths": {
        "/v1/chat/completions": _api("createChatCompletion", "ChatCompletionRequest", "ChatCompletion",
                                     "OpenAI's Chat Completions; a stream ends with `data: [DONE]`."),
        "/v1/completions": _api("createCompletion", "CompletionRequest", "Completion",
                                "OpenAI's Completions; a stream ends with `data: [DONE]`."),
        "/v1/responses": _api("createResponse", "ResponsesRequest", "Response",
                              "OpenAI's Responses API; a stream ends with `response.completed`, "
                              "`response.incomplete` or `response.failed`, whose `usage` is counted."),
        "/v1/responses/{response_id}": {
            "get": {"operationId": "getResponse", "parameters": [_RESPONSE_ID],
                    "responses": {"200": {"description": "a stored response of the caller's", "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/Response"}}}},
                        "404": _err("no such response of the caller's"), "503": _err("the store did not answer")}},
            "delete": {"operationId": "deleteResponse", "parameters": [_RESPONSE_ID],
                       "responses": {"200": {"description": '`{"id", "object": "response", "deleted": true}`'},
                                     "404": _err("no such response of the caller's"),
                                     "503": _err("the store did not answer")}}},
        "/v1/responses/{response_id}/input_items": {"get": {
            "operationId": "listResponseInputItems", "parameters": [_RESPONSE_ID, *_PAGE],
            "responses": {"200": {"description": "the items it answered, previous turns included (a list)"},
                          "404": _err("no such response of the caller's"), "503": _err("the store did not answer")}}},
        "/v1/responses/{response_id}/cancel": {"post": {
            "operationId": "cancelResponse", "parameters": [_RESPONSE_ID],
            "responses": {"200": {"description": "a background response, `cancelled` (or as it is when it ended)",
                                  "content": {"application/json": {"schema": {
                                      "$ref": "#/components/schemas/Response"}}}},
                          "400": _err("not a background response"), **_STORE_ERRORS}}},
        "/v1/responses/input_tokens": _api("countResponseInputTokens", "InputTokensRequest", "InputTokens",
                                           "The input tokens of a Responses request (`previous_response_id` and "
                                           "`conversation` expanded): from the model's tokenizer when configured, "
                                           "else a backend's answer, else the gateway's estimate "
                                           "(`x-turbo-token-count: estimated`).", streams=False),
        "/v1/conversations": {"post": {
            "operationId": "createConversation", "requestBody": {"required": False, "content": {"application/json": {
                "schema": {"type": "object", "properties": {"items": {"type": "array", "maxItems": 20, "items": _OBJ},
                                                            "metadata": _OBJ}}}}},
            "responses": {**_CONVERSATION, "400": _err("a bad item or metadata")}}},
        "/v1/conversations/{conversation_id}": {
            "get": {"operationId": "getConversation", "parameters": [_CONVERSATION_ID], "responses": _CONVERSATION},
            "post": {"operationId": "updateConversation", "parameters": [_CONVERSATION_ID],
                     "requestBody": {"required": True, "content": {"application/json": {"schema": {
                         "type": "object", "required": ["metadata"], "properties": {"metadata": _OBJ}}}}},
                     "responses": {**_CONVERSATION, "400": _err("bad metadata")}},
            "delete": {"operationId": "deleteConversation", "parameters": [_CONVERSATION_ID], "responses": {
                "200": {"description": '`{"id", "object": "conversation.deleted", "deleted": true}`'},
                **_STORE_ERRORS}}},
        "/v1/conversations/{conversation_id}/items": {
            "get": {"operationId": "listConversationItems", "parameters": [_CONVERSATION_ID, *_PAGE],
                    "responses": _ITEMS},
            "post": {"operationId": "createConversationItems", "parameters": [_CONVERSATION_ID],
                     "requestBody": {"required": True, "content": {"application/json": {"schema": {
                         "type": "object", "required": ["items"], "properties": {
                             "items": {"type": "array", "minItems": 1, "maxItems": 20, "items": _OBJ}}}}}},
                     "responses": {**_ITEMS, "400": _err("a bad item")}}},
        "/v1/conversations/{conversation_id}/items/{item_id}": {
            "get": {"operationId": "getConversationItem", "parameters": [_CONVERSATION_ID, _ITEM_ID],
                    "responses": {"200": {"description": "the item"}, **_STORE_ERRORS}},
            "delete": {"operationId": "deleteConversationItem", "parameters": [_CONVERSATION_ID, _ITEM_ID],
                       "responses": _CONVERSATION}},
        "/tokenize": _api("tokenize", "TokenizeRequest", "Tokens",
                          "vLLM's tokenize (a `prompt`, or chat `messages` rendered by the chat template): from the "
                          "model's tokenizer when configured, else a backend's answer.", streams=False),
        "/detokenize": _api("detokenize", "DetokenizeRequest", "Detokenized",
                            "vLLM's detokenize: from the model's tokenizer when configured, else a backend's answer.",
                            streams=False),
        "/v1/messages": _api("createMessage", "MessagesRequest", "Message",
                             "Anthropic's Messages API; errors in Anthropic's shape. A stream's usage is "
                             "`message_start`'s and `message_delta`'s.", _ANTHROPIC_ERRORS, _ANTHROPIC_KEY),
        "/v1/messages/count_tokens": _api("countMessageTokens", "CountTokensRequest", "CountTokens",
                                          "The prompt tokens of a Messages request: from the model's tokenizer when "
                                          "configured, else an engine's answer.",
                                          _ANTHROPIC_ERRORS, _ANTHROPIC_KEY, streams=False),
        "/v1/embeddings": _api("createEmbedding", "EmbeddingsRequest", "EmbeddingList",
                               "OpenAI's embeddings." + _PREFILL_ONLY, streams=False),
        "/v1/rerank": _rerank("createRerank"),
        "/rerank": _rerank("createRerankUnversioned"),
        "/v2/rerank": _rerank("createRerankV2"),
        "/v1/score": _api("createScore", "ScoreRequest", "ScoreList",
                          "vLLM's score: `text_1` against each of `text_2`." + _PREFILL_ONLY, streams=False),
        "/v1/models": {"get": {"operationId": "listModels", "responses": {
            "200": {"description": "the served models", "content": {"application/json": {"schema": {
                "type": "object", "properties": {"object": {"const": "list"}, "data": {
                    "type": "array", "items": {"$ref": "#/components/schemas/Model"}}}}}}},
            "401": _COMMON_ERRORS["401"]}}},
        "/v1/models/{model}": {"get": {
            "operationId": "retrieveModel",
            "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": {"description": "one model", "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/Model"}}}},
                "401": _COMMON_ERRORS["401"], "404": _COMMON_ERRORS["404"]}}},
        "/health": {"get": {"operationId": "health", "security": [],
                            "responses": {"200": {"description": "the process serves"}}}},
        "/ready": {"get": {"operationId": "ready", "security": [],
                           "responses": {"200": {"description": "a backend passed its health check"},
                                         "503": {"description": "no healthy backend"}}}},
        "/metrics": {"get": {"operationId": "metrics", "security": [],
                             "responses": {"200": {"description": "Prometheus text format"}}}},
        "/openapi.json": {"get": {"operationId": "openapi", "security": [],
                                  "responses": {"200": {"description": "this document"}}}},
        "/admin/backends": {"get": {"operationId": "adminBackends", "responses": {
            "200": {"description": "backend status"}, "401": _COMMON_ERRORS["401"],
            "404": _err("admin endpoints are off (no admin key configured)")}}},
        "/admin/backends/{name}/drain": {"post": {
            "operationId": "adminDrain",
            "parameters": [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": {"description": "the backend takes no new requests"},
                          "401": _COMMON_ERRORS["401"], "404": _err("unknown backend, or admin off")}}},
        "/admin/backends/{name}/undrain": {"post": {
            "operationId": "adminUndrain",
            "parameters": [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": {"description": "the backend takes requests again"},
                          "401": _COMMON_ERRORS["401"], "404": _err("unknown backend, or admin off")}}},
        "/admin/reload": {"post": {"operationId": "adminReload", "responses": {
            "200": {"description": "reloaded"}, "400": _err("the new config was rejected; the old one stays"),
            "401": _COMMON_ERRORS["401"], "404": _err("admin endpoints are off"),
            "409": _err("not started from a config file")}}},
        "/admin/usage": {"get": {
            "operationId": "adminUsage",
            "parameters": _USAGE_PARAMS + [{"name": "key", "in": "query", "required": False,
                                            "description": "only this key name's usage", "schema": {"type": "string"}}],
            "responses": {"200": {"description": "every key's usage", "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/Usage"}}}},
                "400": _err("a bad since or until"), "401": _COMMON_ERRORS["401"],
                "404": _err("admin endpoints are off"), "503": _err("the usage ledger's Redis is unreachable")}}},
        "/v1/usage": {"get": {
            "operationId": "ownUsage",
            "parameters": _USAGE_PARAMS,
            "responses": {"200": {"description": "the calling key's own usage", "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/Usage"}}}},
                "400": _err("a bad since or until"), "401": _COMMON_ERRORS["401"],
                "403": _err("`key` names another key"), "503": _err("the usage ledger's Redis is unreachable")}}},
        "/admin/batches": {"get": {
            "operationId": "adminListBatches",
            "parameters": [
                {"name": "status", "in": "query", "required": False,
                 "description": "only batches in these statuses (repeat it, or separate with commas)",
                 "schema": {"type": "string"}},
                {"name": "limit", "in": "query", "required": False,
                 "schema": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 20}},
                {"name": "after", "in": "query", "required": False,
                 "description": "a batch id: the page starts after it", "schema": {"type": "string"}}],
            "responses": {
                "200": {"description": "every caller's batches, newest first", "content": {"application/json": {
                    "schema": {"type": "object", "properties": {
                        "object": {"const": "list"},
                        "data": {"type": "array", "items": {"$ref": "#/components/schemas/AdminBatch"}},
                        "first_id": {"type": ["string", "null"]}, "last_id": {"type": ["string", "null"]},
                        "has_more": {"type": "boolean"}}}}}},
                "400": _err("a bad status, limit or after"), "401": _COMMON_ERRORS["401"],
                "404": _err("admin endpoints are off, or the batch API is not enabled")}}},
        "/admin/batches/{batch_id}": {"get": {
            "operationId": "adminRetrieveBatch",
            "parameters": [{"name": "batch_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {
                "200": {"description": "the batch with its progress and the queue's consumers",
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/AdminBatch"}}}},
                "401": _COMMON_ERRORS["401"],
                "404": _err("unknown batch, admin endpoints off, or the batch API not enabled")}}},
        "/admin/batches/{batch_id}/cancel": {"post": {
            "operationId": "adminCancelBatch",
            "parameters": [{"name": "batch_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {
                "200": {"description": "cancelling (or already cancelled), whoever owns it",
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/AdminBatch"}}}},
                "401": _COMMON_ERRORS["401"],
                "404": _err("unknown batch, admin endpoints off, or the batch API not enabled"),
                "409": _err("the batch is finalizing or finished (batch_not_cancellable)")}}},
    },
}
OPENAPI_BYTES = orjson.dumps(OPENAPI)


def _without_admin(doc: dict) -> dict:
    """``doc`` without the ``/admin/`` paths and the schemas only they use."""
    paths = {p: v for p, v in doc["paths"].items() if not p.startswith("/admin/")}
    schemas = doc["components"]["schemas"]
    keep: set[str] = set()
    text = orjson.dumps(paths).decode()
    while True:
        more = {n for n in schemas if n not in keep and f"#/components/schemas/{n}" in text}
        if not more:
            break
        keep |= more
        text = orjson.dumps([schemas[n] for n in more]).decode()
    return {**doc, "paths": paths,
            "components": {**doc["components"], "schemas": {n: v for n, v in schemas.items() if n in keep}}}


OPENAPI_NO_ADMIN_BYTES = orjson.dumps(_without_admin(OPENAPI))
