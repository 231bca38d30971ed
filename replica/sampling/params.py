"""Per-request sampling parameters (no torch: the ingress builds these)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_LOGPROBS = 20  # alternatives per position, as OpenAI allows
MAX_N = 16


class StructuredOutput(BaseModel):
    """The format decoding is held to (``replica.sampling.grammar``): any JSON object, or
    JSON that a schema (as JSON text) accepts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["json_object", "json_schema"]
    schema_text: str | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> StructuredOutput:
        if (self.kind == "json_schema") != (self.schema_text is not None):
            raise ValueError("schema_text: required for json_schema, and only for it")
        return self


class SamplingParams(BaseModel):
    """How to pick each next token and when to stop.

    ``temperature == 0`` (or below 1e-5) is greedy. A request stops at ``max_tokens``
    generated tokens, or at EOS or one of ``stop_token_ids`` (EOS not before ``min_tokens``,
    nor at all with ``ignore_eos``; stop ids always apply after ``min_tokens``). ``seed``
    makes a sampled request reproducible on its own, whatever else is in the batch; with
    ``n`` > 1, choice ``i`` samples as a request with seed ``seed + i`` would, and all
    choices share one prefill of the prompt. ``logit_bias``, the penalties and
    ``min_tokens`` act on the logits as ``replica.sampling.logits_processing`` says; ``logprobs``
    (0-20 alternatives) reports the raw log-probability of each sampled token, and
    ``prompt_logprobs`` those of the prompt's tokens (the prompt is then computed whole,
    never served from the prefix cache, whose blocks hold no logits). ``structured`` holds
    the output to a JSON format; the request ends when its grammar does. ``speculate``
    false opts the request out of the engine's drafts (``replica.engine.drafts``), which
    never change its tokens, only how many come per step.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(16, gt=0)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    n: int = Field(1, ge=1, le=MAX_N)
    min_tokens: int = Field(0, ge=0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    logit_bias: dict[int, float] = Field(default_factory=dict)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    structured: StructuredOutput | None = None
    speculate: bool = True  # prompt-lookup drafts where the engine drafts (same tokens)

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice ``index`` of an ``n`` > 1 request, as a request of its
        own: one choice, seed ``seed + index``, no prompt logprobs (reported once)."""
        seed = None if self.seed is None else self.seed + index
        return self.model_copy(update={"n": 1, "seed": seed, "prompt_logprobs": None})


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model, and the most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
