"""One step's record and what runs it: ``ScheduledBatch`` (the scheduler's choice of work,
what the runner reads) and ``Runner`` (the model, or the simulator's cost model). The
engine is handed its runner; the runner's room (``replica.model``) stands on this one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from replica.engine.sequence import Sequence


@dataclass
class ScheduledBatch:
    """One step's work: each sequence with the number of tokens it computes this step, and
    whether that reaches its last known token (then the step samples its next one).

    A decoding sequence may also compute ``drafts[i]``, tokens guessed after its last one
    (``replica.engine.drafts``): they are counted in ``num_new_tokens[i]``, follow its
    known tokens in the step's input, and every one of its rows' logits comes back (the
    engine verifies them in order, ``replica.engine.speculation``)."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)  # last rows whose logits it needs
    preempted: list[Sequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) first
    drafts: list[list[int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        sample = seq.num_computed_tokens + num_new_tokens == seq.num_tokens
        in_prompt = seq.num_computed_tokens < seq.num_prompt_tokens
        wants_prompt = seq.params.prompt_logprobs is not None and in_prompt
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)
        self.samples.append(sample)
        # every row of a prompt whose logprobs are asked for; else the sampled row only
        self.logit_rows.append(num_new_tokens if wants_prompt else int(sample))
        self.drafts.append([])

    def add_drafts(self, i: int, drafts: list[int]) -> None:
        """Entry ``i`` (a decode: one token, sampled) also computes ``drafts``."""
        if self.num_new_tokens[i] != 1 or not self.samples[i] or self.drafts[i]:
            raise ValueError("drafts follow a decode's one token, once")
        self.drafts[i] = list(drafts)
        self.num_new_tokens[i] += len(drafts)
        self.logit_rows[i] += len(drafts)

    def input_tokens(self, i: int) -> list[int]:
        """The tokens entry ``i`` computes: its next known ones, then its drafts."""
        seq, drafts = self.seqs[i], self.drafts[i]
        first = seq.num_computed_tokens
        return seq.token_ids[first : first + self.num_new_tokens[i] - len(drafts)] + drafts

    @property
    def num_decodes(self) -> int:
        """Sequences computing one known token (a decode, with or without drafts)."""
        return sum(
            1 for n, d in zip(self.num_new_tokens, self.drafts, strict=True) if n - len(d) == 1
        )

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens of the sequences computing several known ones (chunks of prompts)."""
        return sum(
            n for n, d in zip(self.num_new_tokens, self.drafts, strict=True) if n - len(d) > 1
        )

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(d) for d in self.drafts)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Runner(Protocol):
    """Runs a scheduled batch: the logits ([rows, vocab], float32) of the last
    ``batch.logit_rows[i]`` tokens of each sequence i, in batch order (its sampled token's
    row last)."""

    def execute(self, batch: ScheduledBatch) -> torch.Tensor: ...
