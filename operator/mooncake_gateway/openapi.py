"""A small OpenAPI 3 description of the gateway's API (served at ``/openapi.json``)."""

from __future__ import annotations

from typing import Any

_ERROR = {"$ref": "#/components/schemas/Error"}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


def openapi_spec(models: list[str]) -> dict[str, Any]:
    model = {"type": "string", "enum": models} if models else {"type": "string"}
    common = {
        "model": model, "max_tokens": {"type": "integer", "minimum": 1},
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object",
                           "properties": {"include_usage": {"type": "boolean"}}},
        "temperature": {"type": "number"}, "top_p": {"type": "number"},
        "n": {"type": "integer", "enum": [1]},
    }
    prompt = {"oneOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 131071},
         "minItems": 1},
    ]}
    message = {"type": "object", "required": ["role"], "properties": {
        "role": {"type": "string",
                 "enum": ["system", "user", "assistant", "tool", "developer"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "null"}]}}}
    errors = {"400": _json(_ERROR) | {"description": "bad request"},
              "404": _json(_ERROR) | {"description": "unknown model"},
              "429": _json(_ERROR) | {"description": "rejected by admission (Retry-After)"}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "mooncake gateway", "version": "0.1.0"},
        "paths": {
            "/v1/models": {"get": {"responses": {"200": {"description": "served models"}}}},
            "/v1/completions": {"post": {
                "requestBody": _json({"type": "object", "required": ["model", "prompt"],
                                      "properties": {**common, "prompt": prompt}}),
                "responses": {"200": {"description": "completion or SSE stream"}, **errors}}},
            "/v1/chat/completions": {"post": {
                "requestBody": _json({"type": "object", "required": ["model", "messages"],
                                      "properties": {**common, "messages": {
                                          "type": "array", "items": message, "minItems": 1},
                                          "max_completion_tokens": {"type": "integer",
                                                                    "minimum": 1}}}),
                "responses": {"200": {"description": "chat completion or SSE stream"},
                              **errors}}},
            "/health": {"get": {"responses": {"200": {"description": "alive"}}}},
            "/ready": {"get": {"responses": {"200": {"description": "routable"},
                                             "503": {"description": "not yet"}}}},
            "/metrics": {"get": {"responses": {"200": {"description": "Prometheus text"}}}},
            "/conductor/state": {"get": {"responses": {"200": {"description": "state"}}}},
            "/conductor/hot-prefixes": {"get": {"responses": {"200": {"description": "hot"}}}},
            "/conductor/decisions": {"get": {
                "parameters": [{"name": "limit", "in": "query",
                                "schema": {"type": "integer", "minimum": 0}}],
                "responses": {"200": {"description": "recent decisions"}}}},
        },
        "components": {"schemas": {"Error": {"type": "object", "properties": {"error": {
            "type": "object", "properties": {
                "message": {"type": "string"}, "type": {"type": "string"},
                "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}}},
    }
