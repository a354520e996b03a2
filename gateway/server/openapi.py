"""The OpenAPI 3.1 document of the gateway's own HTTP API, served at ``GET /openapi.json``
(:mod:`gateway.ops.admin` routes it): every API the gateway routes (chat and
completions, Responses, Anthropic Messages, embeddings, rerank, score, tokenize: the
paths of :mod:`gateway.apis.registry`), the stored responses and conversations
(:mod:`gateway.server.stored_routes`), models, usage, health, metrics and the admin endpoints,
with their error answers; and the same document without the admin endpoints, for a
gateway without an admin key. Schemas list only the fields the gateway reads or
answers with; every other field passes through. It is data, kept apart from the
handlers it describes so that they read as code: the paths, with their parameters and
errors, are in :mod:`gateway.server.openapi_paths`, the request and answer schemas in
:mod:`gateway.server.openapi_schemas`; this module puts them together in one document.
"""

from __future__ import annotations

import orjson

from gateway.server.openapi_paths import PATHS
from gateway.server.openapi_schemas import SCHEMAS

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
        "schemas": SCHEMAS,
    },
    "security": [{"bearer": []}],
    "paths": PATHS,
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
