"""From ``response_format`` and ``tool_choice`` to the format the engine holds decoding to.

``json_object``: any JSON object. ``json_schema``: JSON the schema accepts. A tool choice of
``required`` or a named function holds the reply to a call: for a named function, its
arguments (an object the function's ``parameters`` schema accepts); for ``required``, an
object ``{"name": ..., "arguments": ...}`` naming one of the tools, with arguments that tool
accepts. Each schema is checked here against the JSON Schema meta-schema (a 400 naming the
field); what the grammar compiler cannot express is refused by the replica, also as a 400.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from cluster.api.errors import APIError
from cluster.api.formats import Tool
from cluster.api.models import ChatCompletionRequest, CompletionRequest
from replica.sampling.params import StructuredOutput

NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


def structured_output(body: CompletionRequest | ChatCompletionRequest) -> StructuredOutput | None:
    """The engine's format for a request, or None (free text, or tools left to the model)."""
    if isinstance(body, ChatCompletionRequest):
        for i, tool in enumerate(body.tools or []):
            _check(arguments_schema(tool), f"tools[{i}].function.parameters")
        if body.tool_mode in ("required", "named"):
            return _as_output(call_schema(body))
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput(kind="json_object")
    schema = fmt.json_schema.json_schema
    if schema is None:
        return StructuredOutput(kind="json_object")
    _check(schema, "response_format.json_schema.schema")
    return _as_output(schema)


def call_schema(body: ChatCompletionRequest) -> dict[str, Any]:
    """The schema a constrained tool call is held to."""
    tools = body.tools or []
    if body.tool_mode == "named":
        assert not isinstance(body.tool_choice, str) and body.tool_choice is not None
        (tool,) = [t for t in tools if t.function.name == body.tool_choice.function.name]
        return arguments_schema(tool)
    return {"anyOf": [_named_call(t) for t in tools]}


def arguments_schema(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or NO_ARGUMENTS


def _named_call(tool: Tool) -> dict[str, Any]:
    # "name" before "arguments": the name streams first, then the arguments as they come
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool.function.name},
            "arguments": arguments_schema(tool),
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _check(schema: dict[str, Any], param: str) -> None:
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        at = f" at {where}" if where else ""
        raise APIError(
            400,
            f"{param}: not a valid JSON Schema{at}: {exc.message}",
            code="invalid_schema",
            param=param,
        ) from None


def _as_output(schema: dict[str, Any]) -> StructuredOutput:
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    return StructuredOutput(kind="json_schema", schema_text=text)
