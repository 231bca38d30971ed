"""Engine counters. Hit rate is token-weighted (cached prompt tokens / prompt tokens)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

_MAX_SAMPLES = 100_000


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100, linear interpolation); None for no values."""
    data = sorted(values)
    if not data:
        return None
    pos = (len(data) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


@dataclass
class EngineMetrics:
    """Cumulative counters plus the most recent latency samples."""

    num_finished: int = 0
    num_aborted: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    computed_tokens: int = 0  # tokens run through the model (prefill suffixes and decodes)
    generation_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
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
    prompt_tokens: int
    cached_prompt_tokens: int
    hit_rate: float
    computed_tokens: int
    generation_tokens: int
    preemptions: int
    evictions: int
    hash_mismatches: int
    steps: int
    blocks_total: int
    blocks_free: int
    blocks_cached: int
    blocks_in_use: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None

    def to_dict(self) -> dict[str, float | int | None]:
        return asdict(self)
