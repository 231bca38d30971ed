"""What the ingress sends an engine replica and what it streams back (no torch, no Ray)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvindex.records import RoutingRequest
from replica.sampling.params import SamplingParams


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model, and the most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class InvalidRequestError(ValueError):
    """A request the engine can never serve; nothing was changed. ``message`` is written for
    the client, ``param`` names the field at fault and ``code`` is OpenAI's error code (the
    ingress renders exactly these, never the exception's text, which Ray decorates with a
    traceback when it crosses from a replica)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def __reduce__(self) -> tuple[type, tuple[str, str | None, str | None]]:
        return (InvalidRequestError, (self.message, self.param, self.code))


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (a bug that its own numbers or state hit, say in
    sampling); the engine dropped it and served everything else. The ingress answers 500 and
    never resends it (it would fail on any replica). ``message`` is for the server's log."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return (RequestFailedError, (self.message,))


@dataclass(frozen=True)
class EngineRequest:
    """One tokenized request. The ingress hashes the prompt once; the request router reads
    ``route`` (and Ray's own prefix router reads ``prompt``). A request resumed after its
    replica died carries the tokens it already delivered in ``output_token_ids`` (then the
    route's chain covers prompt and those tokens)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    route: RoutingRequest
    cache_salt: str | None = None
    prompt: str = ""
    output_token_ids: list[int] = field(default_factory=list)  # resuming: already delivered


@dataclass(frozen=True)
class RequestOutput:
    """One choice's progress after an engine step: the tokens new in this step and all so far.

    ``request_id`` and ``index`` name the choice (a request with ``n`` > 1 has choices
    0..n-1). ``finish_reason`` is ``"stop"`` (EOS or a stop token), ``"length"``
    (``max_tokens``), ``"abort"``, or ``"error"`` (the engine dropped it: ``error`` says why,
    ``RequestFailedError``). ``num_cached_tokens`` counts prompt tokens served from
    the prefix cache. A replica streams outputs as they are (``streamed``), with its id.
    """

    request_id: str
    new_token_ids: list[int]
    token_ids: list[int]  # every output token so far (left behind when streamed)
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    index: int = 0  # which of the request's n choices
    logprobs: list[TokenLogprob] | None = None  # of ``new_token_ids``, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first output only, if asked
    replica_id: str = ""  # set by the replica that streamed it
    error: str | None = None  # finish_reason "error": what failed

    def streamed(self, replica_id: str) -> RequestOutput:
        """This output as a replica sends it: with its id, and without the cumulative
        ``token_ids`` (a stream that carried them would grow quadratically; the receiver
        has the new tokens of every output)."""
        return replace(self, token_ids=[], replica_id=replica_id)


@dataclass(frozen=True)
class PullRequest:
    """A replica asking another for the verified cached prefix of a prompt
    (``replica.engine.transfer``); routed to ``target_replica_id`` and nowhere else."""

    target_replica_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None
    node_id: str | None = None  # the requester's Ray node: same node, read the pool itself
