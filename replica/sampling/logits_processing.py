"""What the OpenAI parameters do to a request's next-token logits, before sampling.

In vLLM's order: ``min_tokens`` (no end before that many tokens), ``logit_bias`` (added),
then the penalties: ``repetition_penalty`` (vLLM's extension, Hugging Face's rule: a logit
of a token seen in the prompt or the output is divided by it when positive, multiplied when
negative), ``frequency_penalty`` (minus the penalty times how often the token was generated)
and ``presence_penalty`` (minus the penalty once if it was generated at all). Temperature
and top-p come after, in the sampler. Logprobs are reported from the raw logits, before any
of this (the model's own distribution, as OpenAI and vLLM report them).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from replica.sampling.params import SamplingParams

LOGIT_BOUND = 1e30


def needs_processing(params: SamplingParams) -> bool:
    return bool(
        params.min_tokens
        or params.logit_bias
        or params.repetition_penalty != 1.0
        or params.frequency_penalty
        or params.presence_penalty
    )


def process_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: list[int],
    output_ids: list[int],
    end_ids: Iterable[int],
) -> torch.Tensor:
    """``logits`` ([vocab], float32) of one request after its parameters (a new tensor)."""
    out = logits.clone()
    vocab = out.shape[0]
    if len(output_ids) < params.min_tokens:
        ends = [t for t in {*end_ids, *params.stop_token_ids} if 0 <= t < vocab]
        out[ends] = -torch.inf
    if params.logit_bias:
        ids = torch.tensor([int(t) for t in params.logit_bias], dtype=torch.long)
        out.index_add_(0, ids, torch.tensor(list(params.logit_bias.values()), dtype=out.dtype))
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        chosen = out[seen]
        # a penalty below float32's smallest normal would round to 0 in float32, and a
        # banned or masked token's -inf times 0 is NaN: such a penalty acts as that normal
        penalty = max(params.repetition_penalty, torch.finfo(out.dtype).tiny)
        out[seen] = torch.where(chosen > 0, chosen / penalty, chosen * penalty)
    if (params.frequency_penalty or params.presence_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=vocab)
        counts = counts[:vocab].to(out.dtype)
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    # a tiny repetition penalty can push logits to infinity, and several infinite logits
    # make softmax NaN; within +-1e30 every temperature (>= 1e-5) still divides finitely,
    # and a banned token (-inf, now -1e30) still gets probability exactly 0
    return out.clamp_(-LOGIT_BOUND, LOGIT_BOUND)
