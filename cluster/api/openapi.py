"""The OpenAPI document as the API behaves: every status a path can return, with the OpenAI
error body; no FastAPI 422 (validation errors are 400s here); ``/metrics`` as text; the
served model's id where a body names a model; and the bounds that depend on the model
(token ids below the vocabulary size, ``max_tokens`` up to the server's limit), so that a
body the document allows is a body the server takes (checked by schemathesis)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_ERRORS = {
    "400": "Invalid request: malformed JSON, a wrong type, a value out of range, a prompt over "
    "the context (code context_length_exceeded)",
    "401": "Missing or wrong API key (when the server has keys)",
    "404": "The model is not the one served (code model_not_found)",
    "413": "The body is over the server's max_request_bytes (code request_too_large)",
    "500": "Internal error (never a stack trace)",
    "503": "Overloaded (code overloaded, with retry-after), no replica could serve the "
    "request (code replica_failed), or (GET /ready) the cluster cannot serve yet (code "
    "not_ready, with the readiness report as readiness)",
}
# with "stream": true, each server-sent event: a JSON chunk in data, the last one [DONE]
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
}
# which statuses each operation can return besides 200
_STATUSES = {
    ("post", "/v1/completions"): ("400", "401", "404", "413", "500", "503"),
    ("post", "/v1/chat/completions"): ("400", "401", "404", "413", "500", "503"),
    ("get", "/v1/models"): ("401", "500"),
    ("get", "/metrics"): ("401", "500"),
    ("get", "/cluster/stats"): ("401", "500"),
    ("get", "/cluster/decisions"): ("400", "401", "500"),
    ("post", "/cluster/replicas/{replica_id}/moves"): ("400", "401", "404", "500"),
    ("get", "/health"): ("500",),
    ("get", "/ready"): ("500", "503"),
}


def install_openapi(app: FastAPI, model_id: str, vocab_size: int, max_tokens_limit: int) -> None:
    """Serve the truthful document at ``/openapi.json``."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = _document(app, model_id)
            _model_bounds(doc["components"]["schemas"], vocab_size, max_tokens_limit)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi_schema = None
    app.openapi = build  # type: ignore[method-assign]


def _document(app: FastAPI, model_id: str) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version="1", description=app.description, routes=app.routes)
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    components["Error"] = ERROR_SCHEMA
    for path, operations in doc.get("paths", {}).items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            for status in _STATUSES.get((method, path), ("500",)):
                responses[status] = {
                    "description": _ERRORS[status],
                    "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}
                    },
                }
            if method == "post" and path.startswith("/v1/"):
                responses["200"].setdefault("content", {})["text/event-stream"] = {
                    "schema": _SSE_EVENT
                }
            if path == "/metrics":
                responses["200"] = {
                    "description": "Prometheus metrics",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                }
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        model = components.get(name, {}).get("properties", {}).get("model")
        if model is not None:
            model["description"] = f"The served model's id: '{model_id}' (else 404)"
            model["examples"] = [model_id]
    return doc


def _model_bounds(components: dict[str, Any], vocab_size: int, max_tokens_limit: int) -> None:
    """Token ids in [0, vocab_size), ``max_tokens`` at most the limit, in both bodies."""
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = components[name]["properties"]
        for field in ("max_tokens", "max_completion_tokens"):
            for branch in props.get(field, {}).get("anyOf", []):
                if branch.get("type") == "integer":
                    branch["maximum"] = max_tokens_limit
        token_lists = [props["stop_token_ids"]["anyOf"][0]]
        if "prompt" in props:  # token ids, and a batch of them
            branches = props["prompt"]["anyOf"]
            token_lists += [branches[1], branches[3]["items"]]
        for array in token_lists:
            assert array["items"]["type"] == "integer", array
            array["items"]["maximum"] = vocab_size - 1
        bias = props["logit_bias"]["anyOf"][0]
        (value,) = bias.pop("patternProperties").values()
        bias["propertyNames"] = {"pattern": below_pattern(vocab_size)}
        bias["additionalProperties"] = value


def below_pattern(n: int) -> str:
    """A regular expression for the decimal numbers in [0, n), without leading zeros."""
    if n <= 0:
        raise ValueError("n: must be positive")
    top = str(n - 1)
    shorter = ["[0-9]"] + [f"[1-9][0-9]{{{d - 1}}}" for d in range(2, len(top))]
    if len(top) == 1:
        shorter = []
    same_length = []
    for i, digit in enumerate(top):  # numbers agreeing with top up to i, then smaller
        lowest = 1 if i == 0 and len(top) > 1 else 0
        if int(digit) > lowest:
            rest = len(top) - i - 1
            tail = f"[0-9]{{{rest}}}" if rest else ""
            same_length.append(f"{top[:i]}[{lowest}-{int(digit) - 1}]{tail}")
    same_length.append(top)
    return "^(" + "|".join(shorter + same_length) + ")$"
