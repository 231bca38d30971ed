"""The request bodies' formats and tools: ``response_format`` (text, any JSON object, or a
JSON schema), ``tools`` and ``tool_choice``, and the tool calls an assistant message carries
back into the conversation. The schemas themselves are checked where they are used
(``cluster.api.structured``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

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
