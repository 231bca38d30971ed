"""What one request may ask of an engine: checked before it is queued, so an engine never
holds a request it can never serve (the error says why; nothing is changed)."""

from __future__ import annotations

from replica.config import EngineConfig
from replica.errors import InvalidRequestError
from replica.sampling.params import SamplingParams


def check_request(
    config: EngineConfig,
    tokens: list[int],
    params: SamplingParams,
    outputs: list[int] | None = None,
) -> None:
    """Raise ``InvalidRequestError`` for an empty prompt, a token id outside the vocabulary,
    a prompt plus ``max_tokens`` over the context, more KV blocks than the engine has, or
    (resuming) as many tokens already produced as ``max_tokens`` allows."""
    if not tokens:
        raise InvalidRequestError("the prompt is empty")
    outputs = outputs or []
    vocab = config.shape.vocab_size
    if any(not isinstance(t, int) or not 0 <= t < vocab for t in tokens + outputs):
        raise InvalidRequestError(f"token ids must be integers in [0, {vocab})")
    if len(outputs) >= params.max_tokens:
        raise InvalidRequestError("nothing left to resume: max_tokens are already produced")
    if len(tokens) + params.max_tokens > config.context_len:
        raise InvalidRequestError(
            f"prompt ({len(tokens)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
            f"the model's context of {config.context_len} tokens"
        )
    # the last generated token is never written to the cache
    needed = -(-(len(tokens) + params.max_tokens - 1) // config.block_size)
    if needed > config.num_blocks:
        raise InvalidRequestError(
            f"prompt plus max_tokens needs more KV blocks than the engine has "
            f"({config.num_blocks} x {config.block_size} tokens)"
        )
