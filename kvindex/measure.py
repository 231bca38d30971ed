"""How a series of measurements is summarised, one way for every package: the engine's
latencies (``replica.engine.stats``), a router's decision times (``router.routing_stats``)
and the benchmarks' reports. Here because ``kvindex`` is the one package both stand on."""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100, linear interpolation); None for no values."""
    data = sorted(values)
    if not data:
        return None
    pos = (len(data) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)
