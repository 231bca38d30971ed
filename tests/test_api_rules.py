"""The rules between a body's fields: the OpenAPI document's schema for a body refuses
exactly the bodies the server refuses for them (``cluster.api.formats``), rule by rule, and
takes the body once the rule holds; the two rules JSON Schema cannot state are the
server's alone."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from pydantic import BaseModel, ValidationError

from cluster.api import formats as rules  # the rule table
from cluster.api.models import ChatCompletionRequest, CompletionRequest

TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
NAMED = {"type": "function", "function": {"name": "weather"}}
CALL = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
JSON = {"type": "json_object"}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "hi", **fields}


# (model, a body breaking the rule, the same body with the rule kept, the rule)
CASES = [
    (ChatCompletionRequest, chat(tools=[], tool_choice=NAMED), chat(tools=[TOOL], tool_choice=NAMED), rules.TOOL_CHOICE_NEEDS_TOOLS),  # noqa: E501
    (ChatCompletionRequest, chat(tool_choice="auto"), chat(tool_choice="none"), rules.TOOL_CHOICE_NEEDS_TOOLS),  # noqa: E501
    (ChatCompletionRequest, chat(tools=None, tool_choice="required"), chat(tools=[TOOL], tool_choice="required"), rules.TOOL_CHOICE_NEEDS_TOOLS),  # noqa: E501
    (ChatCompletionRequest, chat(tools=[TOOL], tool_choice="required", response_format=JSON), chat(tools=[TOOL], tool_choice="required", response_format={"type": "text"}), rules.FORMAT_OR_CALL),  # noqa: E501
    (ChatCompletionRequest, chat(tools=[TOOL], tool_choice=NAMED, response_format=JSON), chat(tools=[TOOL], tool_choice="auto", response_format=JSON), rules.FORMAT_OR_CALL),  # noqa: E501
    (ChatCompletionRequest, chat(response_format=JSON, min_tokens=3), chat(response_format=JSON, min_tokens=0), rules.MIN_TOKENS_HELD),  # noqa: E501
    (ChatCompletionRequest, chat(tools=[TOOL], tool_choice="required", min_tokens=1), chat(tools=[TOOL], tool_choice="auto", min_tokens=1), rules.MIN_TOKENS_HELD),  # noqa: E501
    (CompletionRequest, completion(response_format=JSON, min_tokens=2), completion(response_format={"type": "text"}, min_tokens=2), rules.MIN_TOKENS_HELD),  # noqa: E501
    (ChatCompletionRequest, chat(messages=[{"role": "user", "content": "x", "tool_calls": [CALL]}]), chat(messages=[{"role": "assistant", "tool_calls": [CALL]}]), rules.CALLS_ARE_THE_ASSISTANTS),  # noqa: E501
]  # fmt: skip


def document_takes(model: type[BaseModel], body: dict[str, Any]) -> bool:
    """Whether the body's schema, as the OpenAPI document publishes it, takes ``body``."""
    return jsonschema.Draft202012Validator(model.model_json_schema()).is_valid(body)


def published(rule: rules.Rule, schema: dict[str, Any]) -> bool:
    """Whether ``schema`` (a body's, or one of its ``$defs``) carries ``rule``."""
    found = [schema.get("allOf", [])] + [d.get("allOf", []) for d in schema["$defs"].values()]
    return any(rule.schema in each for each in found)


@pytest.mark.parametrize(("model", "broken", "kept", "rule"), CASES)
def test_the_document_and_the_server_refuse_the_same_bodies(model, broken, kept, rule) -> None:
    assert published(rule, model.model_json_schema())
    assert not document_takes(model, broken)
    with pytest.raises(ValidationError, match=rule.message):
        model.model_validate(broken)
    assert document_takes(model, kept)
    model.model_validate(kept)


def test_the_rules_json_schema_cannot_state_are_the_servers_alone() -> None:
    duplicate = chat(tools=[TOOL, TOOL])
    unknown = chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "x"}})
    for body, message in ((duplicate, "must be unique"), (unknown, "no tool is named 'x'")):
        assert document_takes(ChatCompletionRequest, body)  # stated in words only
        with pytest.raises(ValidationError, match=message):
            ChatCompletionRequest.model_validate(body)
