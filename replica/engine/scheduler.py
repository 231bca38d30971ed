"""Continuous batching with chunked prefill: who runs in the next step, how many tokens each,
and who gives way when memory runs out.

Like vLLM's v1 scheduler, every step has a token budget (``max_num_batched_tokens``) shared
by decodes and prefill chunks, and it is never exceeded: running decodes are scheduled
first (one token each), then the next chunks of prompts already being computed, then new
requests, each taking what budget is left, so a long prompt spreads over several steps
instead of stalling every running stream. Where we differ from vLLM, and why:

* Admission reserves room for the running requests to grow, as SGLang does with its
  new-token ratio: a waiting request is admitted only if its prompt's blocks leave
  ``ratio x (tokens the running requests may still generate)`` available. vLLM admits until
  memory runs out and preempts; on a CPU a recompute costs seconds, so we would rather
  wait. The ratio starts at 0.5, decays by 0.002 per step to 0.1 while no one is preempted,
  and returns to 1.0 (reserve every token) after a preemption.
* A request gets blocks for its whole prompt at admission (vLLM allocates per chunk), so a
  prompt being chunked never stalls mid-way for memory.
* Preemption is the last resort, newest first, by recompute; a preempted request's full
  blocks stay in the prefix cache, so it resumes from whatever of them survived.
* Priorities (``Sequence.priority``, the tenant's: ``replica.messages.Owner``): while a
  prompt of a higher priority is still to be computed (running or waiting), only prompts
  of that priority get prefill budget and admission; every running decode still runs. So
  an urgent request's prefill shares its steps with decodes only, not with the chunks of
  the prompts that saturate the engine (vLLM's priority scheduling orders the waiting
  queue and preempts; on a CPU the step's length is the cost, so we keep the steps short
  instead). With one priority nothing changes.
* Drafts (prompt lookup, ``replica.engine.drafts``) come last: a decode of a speculating
  sequence may also compute drafted tokens, out of the budget that decodes, prompt chunks
  and admissions left, and in blocks that are free (never evicting a cached prefix), so a
  draft never displaces a prefill this step would otherwise run.
"""

from __future__ import annotations

import math
from collections import deque

from replica.engine.blocks.manager import BlockManager
from replica.engine.drafts import Drafter
from replica.engine.sequence import Sequence, SequenceStatus
from replica.engine.step import ScheduledBatch

_RATIO_START, _RATIO_MIN, _RATIO_DECAY = 0.5, 0.1, 0.002


class Scheduler:
    """Decodes first, then prompt chunks, within one token budget per step (module doc).

    With ``chunked_prefill`` off, a prompt runs in one step (a lone prefill may exceed the
    budget); with ``decode_reserve`` off, admission keeps no room for running requests to
    grow (vLLM's way: preempt when memory runs out). Both off is the scheduler as it was
    before chunking, kept for comparison.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        chunked_prefill: bool = True,
        decode_reserve: bool = True,
        priorities: bool = True,
        drafter: Drafter | None = None,
    ) -> None:
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError("max_num_batched_tokens must be at least max_num_seqs")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.decode_reserve = decode_reserve
        self.priorities = priorities
        self.drafter = drafter
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.reserve_ratio = _RATIO_START

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence that already holds its blocks (a forked choice) joins the running."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues (finished or aborted) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.release(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch(block_copies=self.block_manager.take_copies())
        # once a step: admitting a prompt of this priority keeps it among those to compute
        top = self.prefill_priority()
        budget = self._schedule_running(batch, self.max_num_batched_tokens, top)
        if batch.preempted:
            self.reserve_ratio = 1.0
            return batch
        self.reserve_ratio = max(_RATIO_MIN, self.reserve_ratio - _RATIO_DECAY)
        budget = self._admit_waiting(batch, budget, top)
        self._add_drafts(batch, budget)
        return batch

    def reserve_blocks(self) -> int:
        """Blocks kept free for the running requests' next tokens (``reserve_ratio`` of the
        tokens they may still generate)."""
        if not self.decode_reserve:
            return 0
        growth = sum(s.params.max_tokens - s.num_output_tokens for s in self.running)
        return math.ceil(self.reserve_ratio * growth / self.block_manager.block_size)

    def _schedule_running(self, batch: ScheduledBatch, budget: int, top: int) -> int:
        """Decodes (oldest first), then the next chunk of each prompt being computed.

        A decode that finds no block, even after the allocator evicted every cached prefix,
        releases a session's pin (``replica.engine.blocks.retention``) or, with none left,
        preempts the newest running request not yet scheduled (itself, if it is the
        newest)."""
        order = {id(s): i for i, s in enumerate(self.running)}
        # decodes first, then prompts by priority; stable: oldest first within each
        pending = sorted(self.running, key=lambda s: (not _decoding(s), -self._priority(s)))
        while pending:
            seq = pending.pop(0)
            if not _decoding(seq):
                if budget > 0 and self._priority(seq) >= top:
                    n = self.block_manager.schedule_chunk(seq, budget)
                    batch.add(seq, n)
                    budget -= n
                continue
            while not self.block_manager.append_slot(seq):
                if self.block_manager.pins.yield_one():  # a pin before a running request
                    continue
                victim = max([seq, *pending], key=lambda s: order[id(s)])
                if victim is not seq:
                    pending.remove(victim)
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.add(seq, 1)
                budget -= 1
        return budget

    def prefill_priority(self) -> int:
        """The highest priority of the prompts still to compute, running or waiting: only
        prompts of that priority get prefill budget this step (the module docstring)."""
        if not self.priorities:
            return 0
        prefilling = [s.priority for s in self.running if not _decoding(s)]
        return max([*prefilling, *(s.priority for s in self.waiting)], default=0)

    def _admit_waiting(self, batch: ScheduledBatch, budget: int, top: int) -> int:
        """Admission in arrival order within the highest priority waiting (no lower one
        while a higher prompt is still being computed), while budget, sequence slots and
        the reserve allow. Returns the budget left."""
        first = True
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            # the first waiting of priority ``top``; none: a higher prompt is being computed
            seq = next((s for s in self.waiting if self._priority(s) == top), None)
            if seq is None:
                break
            allowed = budget
            if not self.chunked_prefill:  # whole prompts only; the step's first may overrun
                remaining = seq.num_tokens - self.block_manager.cached_prefix_tokens(seq)
                if remaining > budget and not first:
                    break
                allowed = max(budget, remaining)
            num_new = self.block_manager.admit(seq, allowed, self.reserve_blocks())
            if num_new is None:
                if not self.running and self.block_manager.pins.yield_one():
                    continue  # nothing runs that would free blocks: the pins make room
                break
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, num_new)
            budget -= num_new
            first = False
        return budget

    def _add_drafts(self, batch: ScheduledBatch, budget: int) -> None:
        """Each speculating decode, oldest first, drafts what the budget left allows, at
        most its own draft length and one fewer than its ``max_tokens`` left (the step's
        sampled token is the last one counted), in free blocks, and only drafts likely
        enough to be kept to pay for their place in a step this size
        (``replica.engine.step_cost``)."""
        if self.drafter is None:
            return
        # what a drafted token must be likely to be kept to pay, in a step this size
        threshold = self.drafter.cost.draft_threshold(sum(batch.samples), batch.num_tokens)
        for i, seq in enumerate(batch.seqs):
            if budget <= 0:
                return
            if seq.drafts is None or batch.num_new_tokens[i] != 1 or not batch.samples[i]:
                continue
            if not seq.num_output_tokens:  # its first token: choices may fork from it
                continue
            room = min(budget, seq.params.max_tokens - seq.num_output_tokens - 1)
            drafts = self.drafter.propose(seq.drafts, seq.token_ids, room, threshold)
            drafts = drafts[: self.block_manager.draft_slots(seq, len(drafts))]
            if drafts:
                batch.add_drafts(i, drafts)
                budget -= len(drafts)

    def _priority(self, seq: Sequence) -> int:
        return seq.priority if self.priorities else 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)


def _decoding(seq: Sequence) -> bool:
    """Whether a running sequence has one token left to compute (the last one sampled)."""
    return seq.num_tokens - seq.num_computed_tokens == 1
