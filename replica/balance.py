"""Live migration: a busy replica hands running decodes to a replica that could run them
sooner (``moves.balance``), when the move pays.

Every ``balance_period_s`` a replica compares itself with the others' latest stats (their
heartbeats in the index, ``IndexReader.replica_stats``). It acts when some replica has no
prompt waiting and runs at least two sequences fewer than this one (prompts queued here, or
decodes that a hot prefix's affinity piled up here, wait on each step's length, which grows
with what runs in it); it moves the decodes with the most output left first, at most
half the difference in running sequences (so the two end no further apart than one, and no
move is undone by the next look), and only decodes with at least ``min_remaining_tokens``
left.

A move pays when what the decode saves exceeds what it costs, both in seconds. It costs
this replica's mean move so far (stop, export, push: ``MoveCounters``; 50 ms before the
first) and the recompute of its last partial block at the target, neglected. It saves, for
each of its remaining tokens, the difference between a step here and a step there, with a
decode step taken to grow linearly with the sequences in it (a small model's CPU decode
reads its weights once a step and each sequence's KV: ``step = s1 * running``, with ``s1``
this replica's measured step time over its running sequences). The target's stats are at
most a heartbeat old; a replica that was just given decodes is left alone until its stats
are newer than the move, so two replicas never both fill the same idle one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from replica.moves import Mover

FIRST_MOVE_S = 0.05  # what a move is taken to cost before this replica has made one
MAX_PER_LOOK = 4  # decodes moved at most per look (each push's copy holds up a step)


@dataclass(frozen=True)
class Peer:
    replica_id: str
    running: int
    waiting: int
    reported: float  # its stats' wall-clock time


def plan(
    running: int,
    remaining: list[int],
    peers: list[Peer],
    step_s: float,
    move_s: float,
    min_remaining: int,
) -> tuple[str, int] | None:
    """Which peer takes how many of this replica's decodes (``remaining``: output tokens
    left of each, most first), or None: see the module. Pure: what the tests drive."""
    if running <= 1 or step_s <= 0:
        return None
    idle = [p for p in peers if p.waiting == 0 and p.running + 1 < running]
    if not idle:
        return None
    peer = min(idle, key=lambda p: p.running)
    count = min((running - peer.running) // 2, MAX_PER_LOOK)
    per_seq = step_s / running
    paying = 0
    for left in remaining[:count]:
        saved = left * per_seq * (running - paying - (peer.running + paying + 1))
        if left < min_remaining or saved <= move_s:
            break
        paying += 1
    return (peer.replica_id, paying) if paying else None


class Balancer:
    """One replica's look, every ``balance_period_s`` (``Mover.watch`` calls it)."""

    def __init__(self, mover: Mover, replica_stats: Callable[[], dict[str, dict[str, Any]]]):
        self.mover = mover
        self.replica_stats = replica_stats  # the index's latest stats of every live replica
        self._steps = (mover.engine.metrics.steps, time.monotonic())
        self._given: dict[str, float] = {}  # peer -> when it was last given decodes (wall)

    async def __call__(self) -> None:
        engine, mover = self.mover.engine, self.mover
        steps, now = engine.metrics.steps, time.monotonic()
        (before, then), self._steps = self._steps, (steps, now)
        scheduler = engine.scheduler
        running = len(scheduler.running)
        if running <= 1 or steps == before:  # nothing to share, or no step to time
            return
        stats = await asyncio.to_thread(self.replica_stats)
        peers = [
            Peer(rid, s.get("num_running", 0), s.get("num_waiting", 0), s.get("time", 0.0))
            for rid, s in stats.items()
            if rid != mover.replica_id and s.get("time", 0.0) > self._given.get(rid, 0.0)
        ]
        counters = mover.counters
        move_s = counters.move_seconds / counters.moves if counters.moves else FIRST_MOVE_S
        remaining = [left for _, left in await mover.run_on_engine(engine.movable, True)]
        step_s = (now - then) / (steps - before)
        chosen = plan(running, remaining, peers, step_s, move_s, mover.config.min_remaining_tokens)
        if chosen is None:
            return
        peer, count = chosen
        self._given[peer] = time.time()
        await mover.move_many(peer, count, "balance", decoding=True)
