"""What the OpenAPI document can only state in words, taught to schemathesis's generator.

JSON Schema cannot say that a named ``tool_choice`` names one of ``tools``, that tool names
are unique, that a required call and a response format exclude each other (the document's
descriptions do), nor which JSON Schemas the grammar compiler takes. So before a generated
body is sent, those relations are made to hold (``map_body``): every other generated value
is sent as generated, and the server must accept every body the document allows (the
``positive_data_acceptance`` check) and refuse every other. ``before_call`` applies it in
every phase (``map_body`` alone leaves the examples and coverage phases out).
"""

from __future__ import annotations

from typing import Any

import schemathesis

SIMPLE_SCHEMA = {"type": "object"}
MAX_TOOLS = 4  # 64 listed in the prompt would not fit the test model's 1,024-token context


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: Any) -> None:
    case.body = hold_relations(case.body)


def hold_relations(body: Any) -> Any:
    if not isinstance(body, dict):
        return body
    _schemas(body)
    names = _tools(body)
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        if names:
            choice["function"]["name"] = names[0]
        else:
            body["tool_choice"] = "none"
    elif choice in ("auto", "required") and not names:
        body["tool_choice"] = "none"
    constrained = isinstance(body.get("tool_choice"), dict) or body.get("tool_choice") == "required"
    if constrained and body.get("tools"):
        body.pop("response_format", None)
    if body.get("response_format") is not None or constrained:
        body.pop("min_tokens", None)
    _messages(body)
    return body


def _schemas(body: dict[str, Any]) -> None:
    fmt = body.get("response_format")
    spec = fmt.get("json_schema") if isinstance(fmt, dict) else None
    if isinstance(spec, dict) and isinstance(spec.get("schema"), dict):
        spec["schema"] = SIMPLE_SCHEMA


def _tools(body: dict[str, Any]) -> list[str]:
    if isinstance(body.get("tools"), list):  # a prompt must fit the context (also in words)
        body["tools"] = body["tools"][:MAX_TOOLS]
    names = []
    for i, tool in enumerate(body.get("tools") or []):
        if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
            function = tool["function"]
            function["name"] = f"tool_{i}"
            if isinstance(function.get("parameters"), dict):
                function["parameters"] = SIMPLE_SCHEMA
            names.append(function["name"])
    return names


def _messages(body: dict[str, Any]) -> None:
    for message in body.get("messages") or []:
        if not isinstance(message, dict):
            continue
        if message.get("tool_calls"):
            message["role"] = "assistant"
        elif message.get("content") is None:
            message["content"] = ""
