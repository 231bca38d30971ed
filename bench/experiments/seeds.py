"""One policy's simulated runs over the traces of several seeds (``simulate --seeds``)."""

from __future__ import annotations

import statistics
from typing import Any

from bench.report import combine

SEED_MEANS = ("hit_rate_usage", "hit_rate_engine", "ttft_p99_s", "work_imbalance")


def parse_seeds(text: str) -> list[int]:
    """``1-8`` or ``1,3,5`` (or both: ``1-4,9``) -> the seeds, in order."""
    seeds: list[int] = []
    for part in text.split(","):
        first, dash, last = part.partition("-")
        seeds += range(int(first), int(last) + 1) if dash else [int(first)]
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds {text!r}: no seed, or one twice")
    return seeds


def over_seeds(seeds: list[int], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One policy's runs on the traces of several seeds as one (``report.combine``: the
    median of each number, min-max spreads, TTFT pooled), with each headline's mean over
    the seeds (``seed_means``: what a seed-to-seed comparison of policies is judged by)
    and the hit rate of every seed (``hit_rate_by_seed``)."""
    if len(runs) == 1:
        return runs[0]
    merged = combine(runs)
    ok = {s: r for s, r in zip(seeds, runs, strict=True) if "error" not in r}
    if not ok:
        return merged
    merged["seed_means"] = {
        key: statistics.mean(r[key] for r in ok.values()) for key in SEED_MEANS if key in merged
    }
    merged["hit_rate_by_seed"] = {str(s): r["hit_rate_usage"] for s, r in ok.items()}
    return merged
