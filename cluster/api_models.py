"""The OpenAI-compatible request bodies (strict: a wrong type is a 400, not a coercion).

Unknown fields are ignored, as clients send optional OpenAI fields we do not model; fields
we model but do not support (``n`` > 1, ``logprobs``, ``echo``, penalties) are refused.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _CommonRequest(BaseModel):
    """The fields both endpoints take: model, sampling, streaming, stop and cache salt."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1, description="only n = 1 is supported")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, description="up to 4 stop strings")
    seed: int | None = None
    ignore_eos: bool = False
    cache_salt: str | None = Field(
        None, min_length=1, max_length=256, description="isolates a tenant's cached blocks"
    )
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0, description="not supported")
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0, description="not supported")

    @model_validator(mode="after")
    def _check_stop(self) -> _CommonRequest:
        stops = self.stop_list
        if len(stops) > 4 or any(not s or len(s) > 256 for s in stops):
            raise ValueError("stop: at most 4 non-empty strings of at most 256 characters")
        return self

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_CommonRequest):
    prompt: str | list[int] | list[str] = Field(
        description="text, token ids, or a list holding one text"
    )
    echo: bool = Field(False, description="not supported")
    logprobs: int | None = Field(None, le=0, description="not supported")

    @model_validator(mode="after")
    def _single_prompt(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str) and len(p) != 1:
            raise ValueError("prompt: only one prompt per request is supported")
        return self


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = Field(False, description="not supported")

    @model_validator(mode="after")
    def _no_logprobs(self) -> ChatCompletionRequest:
        if self.logprobs:
            raise ValueError("logprobs are not supported")
        return self
