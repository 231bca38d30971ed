"""Engine counters. Hit rate is token-weighted (cached prompt tokens / prompt tokens)."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from kvindex.measure import percentile

if TYPE_CHECKING:
    from replica.engine.scheduler import Scheduler

_MAX_SAMPLES = 100_000


@dataclass
class EngineMetrics:
    """Cumulative counters plus the most recent latency samples."""

    num_finished: int = 0
    num_aborted: int = 0
    failed_requests: int = 0  # dropped after a failure of their own (``Engine._fail``)
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    computed_tokens: int = 0  # tokens run through the model (prefill suffixes and decodes)
    generation_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    draft_tokens: int = 0  # prompt-lookup drafts verified (``replica.engine.speculation``)
    accepted_draft_tokens: int = 0  # of them, equal to the token decoding picked
    draft_steps_saved: int = 0  # tokens beyond one that a sequence's step yielded
    ttft_s: deque[float] = field(default_factory=lambda: deque(maxlen=_MAX_SAMPLES))
    itl_s: deque[float] = field(default_factory=lambda: deque(maxlen=_MAX_SAMPLES))

    @property
    def hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of one engine: counters, block accounting and latency percentiles."""

    num_running: int
    num_waiting: int
    num_finished: int
    num_aborted: int
    failed_requests: int
    prompt_tokens: int
    cached_prompt_tokens: int
    hit_rate: float
    computed_tokens: int
    generation_tokens: int
    preemptions: int
    evictions: int
    hash_mismatches: int
    steps: int
    draft_tokens: int
    accepted_draft_tokens: int
    draft_steps_saved: int
    blocks_total: int
    blocks_free: int
    blocks_cached: int
    blocks_in_use: int
    blocks_pinned: int  # held for sessions (``replica.engine.blocks.retention``)
    sessions_retained: int
    retention_pinned: int  # pins made; renewed by the next turn, expired, released for room
    retention_renewed: int
    retention_expired: int
    retention_released_for_room: int
    blocks_cached_by_tenant: dict[str, int]  # each tenant's cached blocks (its pool share)
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None

    def to_dict(self) -> dict[str, float | int | None]:
        return asdict(self)

    @classmethod
    def collect(cls, m: EngineMetrics, scheduler: Scheduler, latencies: bool) -> EngineStats:
        """A snapshot of an engine's counters, queues and blocks; latency percentiles only
        with ``latencies`` (sorting up to 100k samples: leave them out where this runs
        often, e.g. every heartbeat)."""
        blocks = scheduler.block_manager.usage()
        pins = scheduler.block_manager.pins.counters
        return cls(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_finished=m.num_finished,
            num_aborted=m.num_aborted,
            failed_requests=m.failed_requests,
            prompt_tokens=m.prompt_tokens,
            cached_prompt_tokens=m.cached_prompt_tokens,
            hit_rate=m.hit_rate,
            computed_tokens=m.computed_tokens,
            generation_tokens=m.generation_tokens,
            preemptions=m.preemptions,
            evictions=blocks.evictions,
            hash_mismatches=blocks.hash_mismatches,
            steps=m.steps,
            draft_tokens=m.draft_tokens,
            accepted_draft_tokens=m.accepted_draft_tokens,
            draft_steps_saved=m.draft_steps_saved,
            blocks_total=blocks.total,
            blocks_free=blocks.free,
            blocks_cached=blocks.cached,
            blocks_in_use=blocks.in_use,
            blocks_pinned=blocks.pinned,
            sessions_retained=blocks.sessions,
            retention_pinned=pins.pinned,
            retention_renewed=pins.renewed,
            retention_expired=pins.expired,
            retention_released_for_room=pins.released_for_room,
            blocks_cached_by_tenant=scheduler.block_manager.allocator.cached.held_by(),
            ttft_p50_s=percentile(m.ttft_s, 50) if latencies else None,
            ttft_p99_s=percentile(m.ttft_s, 99) if latencies else None,
            itl_p50_s=percentile(m.itl_s, 50) if latencies else None,
        )
