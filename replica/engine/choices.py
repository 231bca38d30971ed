"""``n`` > 1: a request's other choices, forked from its one prefill.

When a request with ``n`` choices samples its first token, its prompt is computed once; each
other choice ``i`` samples its first token from the same logits (with its own seed, ``seed +
i``), then continues as a sequence of its own: it shares every full block of the prompt and
gets a copy of the partial last one (copy-on-write: every choice writes its next token
there). Where no block is free for that copy, or the running sequences are already at
``max_num_seqs``, the choice waits and recomputes its prompt, whose full blocks the prefix
cache then serves.
"""

from __future__ import annotations

import torch

from replica.engine.scheduler import Scheduler
from replica.engine.sequence import Sequence
from replica.sampling.sampler import Sample, Sampler


def fork_choices(
    parent: Sequence, row: torch.Tensor, sampler: Sampler, scheduler: Scheduler
) -> list[tuple[Sequence, Sample]]:
    """Choices 1..n-1 of ``parent`` (running, or waiting without blocks), each with its
    first token sampled from ``row``, the logits ``parent`` sampled its own from."""
    forked = []
    for index in range(1, parent.params.n):
        child = Sequence(
            f"{parent.request_id}#{index}",
            parent.token_ids[: parent.num_prompt_tokens],
            parent.params.for_choice(index),
            parent.cache_salt,
            parent.arrival_time,
        )
        child.index, child.parent_id = index, parent.request_id
        child.tenant, child.priority = parent.tenant, parent.priority
        child.first_token_time = parent.first_token_time
        child.num_cached_prompt_tokens = parent.num_cached_prompt_tokens
        child.num_computed_tokens = parent.num_prompt_tokens
        child.grammar = parent.grammar.fresh() if parent.grammar is not None else None
        if parent.drafts is not None and scheduler.drafter is not None:  # an index of its own
            child.drafts = scheduler.drafter.new_state()
        sample = sampler.sample_one(row, child.sample_row())
        room = len(scheduler.running) < scheduler.max_num_seqs  # the step's sequence cap
        if room and scheduler.block_manager.fork(parent, child):
            scheduler.add_running(child)
        else:
            child.num_computed_tokens = 0
            scheduler.add(child)
        forked.append((child, sample))
    return forked
