"""Continuous batching: who runs in the next step, and who gives way when memory runs out."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from replica.block_manager import BlockManager
from replica.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """One step's work: each sequence with the number of tokens it computes this step."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)

    @property
    def num_decodes(self) -> int:
        """Sequences computing one token (a decode; the model runs them as one batch)."""
        return sum(1 for n in self.num_new_tokens if n == 1)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens of the sequences computing several (prefills of an uncached suffix)."""
        return sum(n for n in self.num_new_tokens if n > 1)


class Scheduler:
    """FIFO admission between decode steps, preemption by recompute, newest first.

    Each step, running sequences (oldest first) get one decode slot. If a slot cannot be
    found even after evicting every cached prefix (the allocator evicts them first), the
    newest running sequence is preempted: its blocks are released and it waits at the front
    of the queue to be recomputed from its prompt and the tokens it already produced. Only
    in a step without preemption are waiting requests admitted (FIFO, within
    ``max_num_seqs`` and ``max_num_batched_tokens``; a lone prefill may exceed the token
    budget), so the oldest request always makes progress and none is dropped.
    """

    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues (finished or aborted) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.release(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        running = list(self.running)
        while running:
            seq = running.pop(0)
            while not self.block_manager.append_slot(seq):
                victim = running.pop() if running else seq
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.add(seq, 1)
        if batch.preempted:
            return batch

        budget = self.max_num_batched_tokens - len(batch)
        admitted_prefill = False
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_new = self.block_manager.admit(
                seq, budget if admitted_prefill else max(budget, seq.num_tokens)
            )
            if num_new is None:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, num_new)
            budget -= num_new
            admitted_prefill = True
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
