"""A small OpenAPI 3 description of the gateway's API (served at ``/openapi.json``)."""

from __future__ import annotations

from typing import Any

_ERROR = {"$ref": "#/components/schemas/Error"}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


_MODEL_QUERY = {"name": "model", "in": "query", "schema": {"type": "string"},
                "description": "one model (404 when not served); all when omitted"}
_NUM = {"type": "number"}
_INT = {"type": "integer", "minimum": 0}
_STR = {"type": "string"}
_BOOL = {"type": "boolean"}


def _obj(props: dict[str, Any], required: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        out["required"] = sorted(props)
    return out


def _described(schema: dict[str, Any], text: str) -> dict[str, Any]:
    return {**schema, "description": text}


#: one instance in ``GET /conductor/registry``
REGISTRY_INSTANCE = {
    "type": "object",
    "required": ["pod", "role", "revision", "url", "listed", "draining", "healthy",
                 "registered", "routable", "inflight", "index_blocks", "unique_blocks",
                 "cache_capacity_blocks"],
    "properties": {
        "pod": _described(_STR, "namespace/name of the pod (static endpoints: their name "
                          "or URL)"),
        "role": {"type": "string", "enum": ["prefill", "decode"]},
        "revision": _described(_STR, "the pod's mooncake.io/revision label ('' if none)"),
        "url": _described(_STR, "the engine's HTTP base URL"),
        "listed": _described(_BOOL, "in the latest endpoint list (ready pod); an instance "
                             "no longer listed is shown while it has requests in flight"),
        "draining": _described(_BOOL, "annotated mooncake.io/drain=true: no new requests"),
        "healthy": _described(_BOOL, "a health check passed since it joined, and it is not "
                              "marked down"),
        "registered": _described(_BOOL, "healthy once and its KV events replayed since it "
                                 "joined or came back"),
        "routable": _described(_BOOL, "new requests may go there: listed, registered, "
                               "healthy, not draining, and (while revisions are mixed) a "
                               "decode of its revision is routable"),
        "inflight": _described(_INT, "requests this gateway has in flight there"),
        "index_blocks": _described(_INT, "blocks the gateway's index says it holds"),
        "unique_blocks": _described(_INT, "of those, blocks no other instance holds (the "
                                    "cached work lost if the pod goes)"),
        "cache_capacity_blocks": _described({"type": ["integer", "null"]},
                                            "KV cache blocks the engine reports (null until "
                                            "its /metrics were read)"),
        "predicted_wait_s": _described(_NUM, "prefill only: predicted queue wait, modelled s"),
        "batch": _described(_INT, "decode only: requests decoding there (this gateway's)"),
    },
}

REGISTRY = _obj({"models": {"type": "array", "items": _obj({
    "model": _STR,
    "source": _described({"type": ["string", "null"]},
                         "namespace/name of the model's ConfigMap; null: the gateway's own "
                         "settings"),
    "revisions": _described({"type": "array", "items": _STR},
                            "revisions of the listed instances, sorted"),
    "instances": {"type": "array", "items": REGISTRY_INSTANCE},
})}})

HOT_PREFIX = _obj({
    "model": _STR,
    "prefix": _described(_STR, "the prefix's last block key, 16 hex digits"),
    "blocks": _INT, "tokens": _described(_INT, "blocks x block size"),
    "rate_per_s": _described(_NUM, "decayed accesses per modelled second"),
    "rate_per_wall_s": _NUM,
    "holders": _described({"type": "array", "items": _STR},
                          "routable prefill instances holding the whole prefix (pods)"),
    "holders_predicted_wait_s": _described({"type": "object", "additionalProperties": _NUM},
                                           "each holder's predicted prefill wait"),
    "keys": {"type": "array", "items": _STR},
    "token_ids": _described({"type": ["array", "null"], "items": _INT},
                            "only with tokens=1: the prefix's token ids (null when the "
                            "gateway did not keep them)"),
})
HOT_PREFIX["required"] = [k for k in HOT_PREFIX["required"] if k != "token_ids"]

MODEL_CATALOG = _obj({
    "kubernetes_models": _described(
        {"type": ["object", "null"], "properties": {
            "namespace": {"type": ["string", "null"]}, "label_selector": _STR, "key": _STR,
            "listed": _BOOL, "documents": _INT}},
        "the ConfigMap watch (null: not on)"),
    "models": {"type": "array", "items": _obj({
        "model": _STR, "source": {"type": ["string", "null"]}})},
    "invalid": {"type": "array", "items": _obj({"source": _STR, "error": _STR})},
    "conflicts": {"type": "array", "items": _obj({
        "source": _STR, "model": _STR,
        "winner": _described(_STR, "the ConfigMap serving the model, or 'settings'")})},
})


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
            "/conductor/hot-prefixes": {"get": {
                "parameters": [
                    _MODEL_QUERY,
                    {"name": "limit", "in": "query", "schema": _INT},
                    {"name": "tokens", "in": "query",
                     "schema": {"type": "string", "enum": ["0", "1", "true", "false",
                                                           "yes", "no"]},
                     "description": "1: include each prefix's token_ids"}],
                "responses": {"200": _json({"type": "array", "items": HOT_PREFIX})
                              | {"description": "hot prefixes, hottest first"},
                              "404": _json(_ERROR) | {"description": "unknown model"}}}},
            "/conductor/registry": {"get": {
                "parameters": [_MODEL_QUERY],
                "responses": {"200": _json(REGISTRY) | {"description": "per model, every "
                                                        "pod the gateway routes to"},
                              "404": _json(_ERROR) | {"description": "unknown model"}}}},
            "/conductor/models": {"get": {"responses": {
                "200": _json(MODEL_CATALOG) | {"description": "served models, invalid and "
                                               "conflicting ConfigMaps"}}}},
            "/conductor/load": {"get": {"responses": {
                "200": {"description": "per model, this replica's own in-flight load per "
                        "instance (what the other replicas add to theirs)"}}}},
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
