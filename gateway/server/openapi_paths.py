"""The paths of the gateway's OpenAPI document: every route the gateway serves (the routed
APIs of :mod:`gateway.apis.registry`, the stored responses and conversations, models,
usage, health, metrics, the admin endpoints), with its parameters and error answers.
:mod:`gateway.server.openapi` assembles the document; the bodies are named schemas of
:mod:`gateway.server.openapi_schemas`.
"""

from __future__ import annotations

from gateway.server.openapi_schemas import OBJECT

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
_ANTHROPIC_KEY: list[dict[str, list[str]]] = [{"bearer": []}, {"apiKey": []}]

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


PATHS = {
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
            "schema": {"type": "object", "properties": {"items": {"type": "array", "maxItems": 20, "items": OBJECT},
                                                        "metadata": OBJECT}}}}},
        "responses": {**_CONVERSATION, "400": _err("a bad item or metadata")}}},
    "/v1/conversations/{conversation_id}": {
        "get": {"operationId": "getConversation", "parameters": [_CONVERSATION_ID], "responses": _CONVERSATION},
        "post": {"operationId": "updateConversation", "parameters": [_CONVERSATION_ID],
                 "requestBody": {"required": True, "content": {"application/json": {"schema": {
                     "type": "object", "required": ["metadata"], "properties": {"metadata": OBJECT}}}}},
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
                         "items": {"type": "array", "minItems": 1, "maxItems": 20, "items": OBJECT}}}}}},
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
}
