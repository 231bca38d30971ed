"""Per-request sampling parameters (no torch: the ingress builds these)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    """How to pick each next token and when to stop.

    ``temperature == 0`` (or below 1e-5) is greedy. A request stops at ``max_tokens``
    generated tokens, or at EOS or one of ``stop_token_ids`` (unless ``ignore_eos``; stop ids
    always apply). ``seed`` makes a sampled request reproducible on its own, whatever else is
    in the batch.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(16, gt=0)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
