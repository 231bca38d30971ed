"""The OpenAI-compatible request bodies (strict: a wrong type is a 400, not a coercion; a
JSON number with no fraction, like ``5.0``, is an integer as JSON Schema says).

Unknown fields are ignored, as clients send optional OpenAI fields we do not model; fields
we model but do not support (``best_of`` other than ``n``, ``suffix``) are refused. Every
constraint a schema can state is stated here, so the OpenAPI document is the contract;
the model-dependent bounds (token ids, ``max_tokens``) are added by ``cluster.api.openapi``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from annotated_types import Ge, Le
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from cluster.api.formats import (
    CHAT_RULES,
    COMPLETION_RULES,
    MAX_TOOLS,
    MESSAGE_RULES,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolCall,
    check_rules,
    published,
)
from replica.sampling.params import MAX_LOGPROBS, MAX_N

MAX_STOPS = 4
MAX_STOP_CHARS = 256
MAX_PROMPTS = 32  # prompts in one completions request


def _integral(value: Any) -> Any:
    """``5.0`` is the integer 5 in JSON; ``5.5`` (and ``"5"``, ``true``) stay wrong."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# bounds go before INTEGRAL in ``Annotated`` (after it, pydantic drops them from the schema)
INTEGRAL = BeforeValidator(_integral)
TokenId = Annotated[int, Ge(0), INTEGRAL]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class CacheRetention(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    ttl_s: float = Field(
        ge=0.0, description="keep this session's blocks this long after the answer; 0: release"
    )


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(
        strict=True, extra="ignore", json_schema_extra=published(MESSAGE_RULES)
    )

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(
        None, description="absent or null: empty (as an assistant message with tool_calls)"
    )
    tool_calls: list[ToolCall] | None = Field(None, description="assistant messages only")
    tool_call_id: str | None = Field(None, description="tool messages: the call answered")

    @model_validator(mode="after")
    def _check_role_fields(self) -> ChatMessage:
        check_rules(MESSAGE_RULES, as_sent(self))
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _CommonRequest(BaseModel):
    """The fields both endpoints take: model, sampling, streaming, stop and cache salt."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str = Field(description="the served model's id (GET /v1/models)")
    max_tokens: Annotated[int, Ge(1), INTEGRAL] | None = Field(
        None, description="tokens to generate"
    )
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: Annotated[int, Ge(1), Le(MAX_N), INTEGRAL] = Field(
        1, description="choices; they share one prefill"
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = Field(
        None, description="a stop string or up to 4 of them"
    )
    seed: Annotated[int, INTEGRAL] | None = Field(
        None, description="choice i samples with seed + i"
    )
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[Annotated[str, Field(pattern=r"^(0|[1-9][0-9]*)$")], Bias] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100]"
    )
    user: str | None = Field(None, description="accepted, unused")
    # vLLM's extensions
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    min_tokens: Annotated[int, Ge(0), INTEGRAL] = Field(
        0, description="no end of text before this many tokens (at most max_tokens)"
    )
    stop_token_ids: list[TokenId] | None = Field(None, max_length=64)
    ignore_eos: bool = False
    cache_salt: str | None = Field(
        None, min_length=1, max_length=256, description="isolates a tenant's cached blocks"
    )
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object, or json_schema: decoding held to the format"
    )
    cache_retention: CacheRetention | None = Field(
        None, description="keep its blocks this long: for its session's next turn (x-session-id)"
    )
    speculation: bool = Field(
        True,
        description="prompt-lookup drafts verified in the step (never changes the tokens); "
        "false: one token per step",
    )

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def as_sent(body: BaseModel) -> dict[str, Any]:
    """A validated body as JSON again, with only the fields the client sent (what the
    document's rules are written against)."""
    return body.model_dump(mode="json", by_alias=True, exclude_unset=True)


TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(_CommonRequest):
    model_config = ConfigDict(
        strict=True, extra="ignore", json_schema_extra=published(COMPLETION_RULES)
    )

    prompt: (
        str
        | TokenIds
        | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    ) = Field(
        description="a text, token ids, or a batch of either (one choice per prompt and n; "
        "an empty text starts from the model's document boundary)"
    )
    echo: bool = Field(False, description="the prompt before the completion (and its logprobs)")
    logprobs: Annotated[int, Ge(0), Le(MAX_LOGPROBS), INTEGRAL] | None = Field(
        None, description="alternatives"
    )
    # the document offers null only: any other value but n (or "") is refused
    best_of: Annotated[int, INTEGRAL] | None = Field(
        None, description="refused unless equal to n", json_schema_extra={"type": "null"}
    )
    suffix: str | None = Field(None, description="refused", json_schema_extra={"type": "null"})
    # the one place max_tokens may be 0: with echo and logprobs, that scores the prompt
    max_tokens: Annotated[int, Ge(0), INTEGRAL] | None = Field(
        None, description="tokens to generate (0 with echo scores the prompt)"
    )

    @model_validator(mode="after")
    def _check_unsupported(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: not supported (only equal to n)")
        if self.suffix:
            raise ValueError("suffix: not supported")
        check_rules(COMPLETION_RULES, as_sent(self))
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch: every prompt, a text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]


class ChatCompletionRequest(_CommonRequest):
    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra=published(CHAT_RULES))

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Ge(1), INTEGRAL] | None = Field(
        None, description="overrides max_tokens"
    )
    logprobs: bool = Field(False, description="log-probabilities of the answer's tokens")
    top_logprobs: Annotated[int, Ge(0), Le(MAX_LOGPROBS), INTEGRAL] | None = Field(
        None, description="alternatives (ignored without logprobs)"
    )
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="functions the model may call; their names must be unique (else 400)"
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description="default: auto with tools, none without; a named function must be one "
        "of tools (else 400)",
    )
    parallel_tool_calls: bool | None = Field(None, description="accepted: one call per reply")

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        check_rules(CHAT_RULES, as_sent(self))
        # the two rules JSON Schema cannot state (cluster.api.formats)
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: no tool is named {choice.function.name!r}")
        return self

    @property
    def tool_mode(self) -> str:
        """none, auto, required, or named."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice
