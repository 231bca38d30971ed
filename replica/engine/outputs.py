"""What an engine step gives back, and what runs a step's forward pass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from replica.engine.scheduler import ScheduledBatch
from replica.messages import TokenLogprob


@dataclass(frozen=True)
class RequestOutput:
    """One request's progress after a step: the tokens new in this step and all so far.

    ``finish_reason`` is ``"stop"`` (EOS or a stop token), ``"length"`` (``max_tokens``) or
    ``"abort"``. ``num_cached_tokens`` counts prompt tokens served from the prefix cache.
    """

    request_id: str
    new_token_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    index: int = 0  # which of the request's n choices (choice i > 0 has id "<id>#i")
    logprobs: list[TokenLogprob] | None = None  # of ``new_token_ids``, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first output only, if asked


class Runner(Protocol):
    """Runs a scheduled batch: the logits ([rows, vocab], float32) of the last
    ``batch.logit_rows[i]`` tokens of each sequence i, in batch order (its sampled token's
    row last)."""

    def execute(self, batch: ScheduledBatch) -> torch.Tensor: ...
