"""The request bodies' formats and tools: ``response_format`` (text, any JSON object, or a
JSON schema), ``tools`` and ``tool_choice``, and the tool calls an assistant message carries
back into the conversation; and the rules between them and the rest of a body. The schemas
themselves are checked where they are used (``cluster.api.structured``).

The rules are written once as JSON Schema (2020-12 ``if``/``then``, ``Rule``): the OpenAPI
document publishes each in its body's schema (``allOf``), and the server checks a body with
the very same schema, so the document allows exactly the bodies the server takes and a
client's generator (schemathesis, an SDK's validator) needs no word of ours. Two rules of
``tools`` are not among them because JSON Schema cannot state them: it cannot compare two
values of one document (the ``$data`` proposal never became standard), so "function names
are unique" and "a named ``tool_choice`` names one of ``tools``" are checked in
``ChatCompletionRequest`` and stated in the fields' descriptions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, Field

MAX_TOOLS = 64
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # a function's or a schema's name, as OpenAI allows


class CalledFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: str
    arguments: str = Field(description="JSON text")


class ToolCall(BaseModel):
    """A call the assistant made, as it comes back in the conversation."""

    model_config = ConfigDict(strict=True, extra="ignore")

    id: str
    type: Literal["function"]
    function: CalledFunction


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(
        None, alias="schema", description="a JSON Schema; absent: any JSON object"
    )
    strict: bool | None = Field(None, description="accepted: the schema is always enforced")


class TextFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]


class JSONObjectFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["json_object"]


class JSONSchemaResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[
    TextFormat | JSONObjectFormat | JSONSchemaResponseFormat, Field(discriminator="type")
]


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="a JSON Schema of the arguments; absent: no arguments"
    )
    strict: bool | None = Field(None, description="accepted: constrained calls always conform")


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["function"]
    function: FunctionName


# -- the rules between a body's fields --------------------------------------------------

_CONSTRAINED_CHOICE = {"anyOf": [{"const": "required"}, {"type": "object"}]}
_FORMAT_HELD = {
    "type": "object",
    "required": ["type"],
    "properties": {"type": {"enum": ["json_object", "json_schema"]}},
}


@dataclass(frozen=True)
class Rule:
    """One rule: a body that matches ``when`` must match ``then``, else a 400 naming
    ``param`` with ``message``."""

    param: str
    message: str
    when: dict[str, Any]
    then: dict[str, Any]

    def __post_init__(self) -> None:  # compiled once: the rule runs on every request
        validator = jsonschema.Draft202012Validator(self.schema)
        object.__setattr__(self, "_validator", validator)

    @property
    def schema(self) -> dict[str, Any]:
        return {"if": self.when, "then": self.then}

    def holds(self, body: dict[str, Any]) -> bool:
        return bool(self._validator.is_valid(body))  # type: ignore[attr-defined]


def _present(field: str, value: dict[str, Any]) -> dict[str, Any]:
    """A body where ``field`` is present and matches ``value``."""
    return {"required": [field], "properties": {field: value}}


def _absent_or(field: str, allowed: dict[str, Any]) -> dict[str, Any]:
    """``field`` absent, or matching ``allowed``."""
    return {"properties": {field: allowed}}


# a response format or a held tool call decides every token: no room for forced length
MIN_TOKENS_HELD = Rule(
    "min_tokens",
    "min_tokens: not supported with a response format or a required tool call",
    when={
        "anyOf": [
            _present("response_format", _FORMAT_HELD),
            _present("tool_choice", _CONSTRAINED_CHOICE),
        ]
    },
    then=_absent_or("min_tokens", {"const": 0}),
)
TOOL_CHOICE_NEEDS_TOOLS = Rule(
    "tool_choice",
    "tool_choice: needs tools",
    when=_present("tool_choice", {"anyOf": [{"enum": ["auto", "required"]}, {"type": "object"}]}),
    then=_present("tools", {"type": "array", "minItems": 1}),
)
_FREE_TEXT = {"type": "object", "properties": {"type": {"const": "text"}}}
FORMAT_OR_CALL = Rule(
    "response_format",
    "response_format: not with tool_choice required or named",
    when=_present("tool_choice", _CONSTRAINED_CHOICE),
    then=_absent_or("response_format", {"anyOf": [{"type": "null"}, _FREE_TEXT]}),
)
CALLS_ARE_THE_ASSISTANTS = Rule(
    "messages",
    "messages: only an assistant message has tool_calls",
    when=_present("tool_calls", {"type": "array", "minItems": 1}),
    then=_present("role", {"const": "assistant"}),
)

COMPLETION_RULES = (MIN_TOKENS_HELD,)
CHAT_RULES = (TOOL_CHOICE_NEEDS_TOOLS, FORMAT_OR_CALL, MIN_TOKENS_HELD)
MESSAGE_RULES = (CALLS_ARE_THE_ASSISTANTS,)


def published(rules: tuple[Rule, ...]) -> dict[str, Any]:
    """What a body's schema carries for ``rules`` (pydantic's ``json_schema_extra``)."""
    return {"allOf": [rule.schema for rule in rules]}


def check_rules(rules: tuple[Rule, ...], body: dict[str, Any]) -> None:
    """Raise ``ValueError`` (pydantic's 400) with the first rule ``body`` breaks."""
    for rule in rules:
        if not rule.holds(body):
            raise ValueError(rule.message)
