"""One request's state inside the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from replica.engine.drafts import DraftState
from replica.messages import EngineTimes, RequestOutput, Retention
from replica.sampling.grammar import GrammarState
from replica.sampling.params import SamplingParams, TokenLogprob
from replica.sampling.sampler import SampleRow, token_logprobs


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Tokens, blocks and timing of one request.

    ``token_ids`` is the prompt followed by the generated tokens. The KV of the first
    ``num_computed_tokens`` tokens is in the blocks of ``block_table``; the first
    ``num_published_blocks`` of those are in the prefix cache. ``block_hashes`` holds the hash
    of every full block of ``token_ids`` computed so far (extended lazily).
    """

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    arrival_time: float
    num_prompt_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_published_blocks: int = 0
    num_cached_prompt_tokens: int | None = None  # served from the cache at first admission
    index: int = 0  # which choice of its request (n > 1)
    parent_id: str = ""  # the request's id (a choice i > 0 has its own, "<id>#i")
    prompt_logprobs: list[Any] | None = None  # collected chunk by chunk, when asked for
    grammar: GrammarState | None = None  # for a request held to a format
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_reason: str | None = None
    retention: Retention | None = None  # keep its blocks for its session (choice 0 only)
    tenant: str = ""  # its blocks, released, count in this tenant's share of the pool
    priority: int = 0  # its prompt is computed before those of lower priorities
    drafts: DraftState | None = None  # it speculates (``replica.engine.drafts``)
    num_restored_tokens: int = 0  # restored from the node store when it was added
    restore_s: float = 0.0  # how long that took
    preemptions: int = 0
    # traced requests only (None: nothing timed): each prompt chunk's (start, end, tokens)
    chunk_times: list[tuple[float, float, int]] | None = None

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)
        self.parent_id = self.parent_id or self.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def commit(self, token: int, eos_token_ids: frozenset[int]) -> str | None:
        """Append ``token`` (to the grammar too); why the sequence ends there, if it does:
        its grammar complete, a stop token, EOS (unless ignored), or ``max_tokens``."""
        self.token_ids.append(token)
        params = self.params
        if self.grammar is not None:
            self.grammar.accept(token)
            if self.grammar.complete:
                return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if token in eos_token_ids and not params.ignore_eos:
            return "stop"
        return "length" if self.num_output_tokens >= params.max_tokens else None

    def output(
        self,
        new: list[int],
        logprobs: list[TokenLogprob] | None = None,
        error: str | None = None,
    ) -> RequestOutput:
        """This sequence's output after a step (its prompt logprobs go with its first)."""
        prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
        return RequestOutput(
            request_id=self.parent_id,
            new_token_ids=new,
            token_ids=self.output_token_ids,
            finished=self.is_finished,
            finish_reason=self.finish_reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_prompt_tokens or 0,
            index=self.index,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            error=error,
            num_restored_tokens=self.num_restored_tokens,
            times=self.times() if self.is_finished else None,
        )

    def times(self) -> EngineTimes | None:
        """Where its time went (a traced sequence, finished), for its replica's spans."""
        chunks = self.chunk_times
        if chunks is None:
            return None
        return EngineTimes(
            arrival=self.arrival_time,
            restore_s=self.restore_s,
            scheduled=chunks[0][0] if chunks else None,
            chunks=tuple(chunks),
            first_token=self.first_token_time,
            finished=self.last_token_time or self.arrival_time,
            preemptions=self.preemptions,
        )

    def sample_row(self) -> SampleRow:
        """What the sampler reads of this sequence for its next token."""
        return SampleRow(
            self.request_id, self.params, self.token_ids, self.num_prompt_tokens, self.grammar
        )

    def record_prompt_logprobs(self, rows: torch.Tensor, num_new: int) -> None:
        """Keep the log-probabilities of the prompt tokens that a chunk's logits rows
        predict (row j predicts token ``first + j + 1``), when the request asked for them."""
        top = self.params.prompt_logprobs
        first = self.num_computed_tokens
        if top is None or first >= self.num_prompt_tokens:
            return
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None]  # the first prompt token has no context to predict
        targets = self.token_ids[first + 1 : min(first + num_new + 1, self.num_prompt_tokens)]
        self.prompt_logprobs += token_logprobs(rows[: len(targets)], targets, top)
