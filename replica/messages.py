"""What the ingress sends an engine replica and what it streams back (no torch, no Ray)."""

from __future__ import annotations

from dataclasses import dataclass, field

from replica.sampling.params import SamplingParams


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model, and the most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class InvalidRequestError(ValueError):
    """A request the engine can never serve (the message says why); nothing was changed."""


@dataclass(frozen=True)
class EngineRequest:
    """One tokenized request. The ingress hashes the prompt once; the request router reads
    ``block_hashes`` and ``affinity_key`` (and Ray's own prefix router reads ``prompt``). A
    request resumed after its replica died carries the tokens it already delivered in
    ``output_token_ids`` (then ``block_hashes`` cover prompt and those tokens)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_hashes: list[bytes]
    affinity_key: bytes
    cache_salt: str | None = None
    prompt: str = ""
    output_token_ids: list[int] = field(default_factory=list)  # resuming: already delivered


@dataclass(frozen=True)
class EngineChunk:
    """Tokens new since the last chunk; the last chunk has ``finished`` set."""

    request_id: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    replica_id: str
    index: int = 0  # the choice (n > 1); ``finished`` is that choice's
    logprobs: list[TokenLogprob] | None = None  # of ``token_ids``, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # the first chunk, when asked
