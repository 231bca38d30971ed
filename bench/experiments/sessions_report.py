"""The ``sessions`` experiment's summary (per mode, medians over the repeats with min-max)
and its Markdown table."""

from __future__ import annotations

import statistics
from typing import Any

from kvindex.measure import percentile


def _spread(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _per_run(runs: list[dict[str, Any]], key: str, q: float | None = None) -> list[float]:
    """``key`` of each run (a percentile ``q`` of it when it is a list of samples)."""
    if q is None:
        return [float(run[key]) for run in runs]
    return [percentile(run[key], q) for run in runs if run[key]]


def summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    table = {}
    for mode, mode_runs in runs.items():
        table[mode] = {
            "later_hit_rate": _spread(_per_run(mode_runs, "later_hit_rate")),
            "later_ttft_p50_s": _spread(_per_run(mode_runs, "later_ttft_s", 50)),
            "later_ttft_p99_s": _spread(_per_run(mode_runs, "later_ttft_s", 99)),
            "first_ttft_p50_s": _spread(_per_run(mode_runs, "first_ttft_s", 50)),
            "others_ttft_p50_s": _spread(_per_run(mode_runs, "others_ttft_s", 50)),
            "others_ttft_p99_s": _spread(_per_run(mode_runs, "others_ttft_s", 99)),
            "pinned_blocks_mean": _spread(_per_run(mode_runs, "pinned_blocks_mean")),
            "pinned_blocks_max": _spread(_per_run(mode_runs, "pinned_blocks_max")),
            "failed": sum(run["failed"] for run in mode_runs),
            "counters": {
                key: sum(run["counters"][key] for run in mode_runs)
                for key in mode_runs[0]["counters"]
            },
        }
    return table


def _fmt(stat: dict[str, float | None], digits: int = 2) -> str:
    if stat["median"] is None:
        return "-"
    return f"{stat['median']:.{digits}f} ({stat['min']:.{digits}f}-{stat['max']:.{digits}f})"


def markdown(payload: dict[str, Any]) -> str:
    lines = [
        f"# {payload['title']}",
        "",
        f"measured {payload['measured']}; {payload['provenance']}",
        "",
        "| mode | later turns' hit rate | their TTFT p50 s | p99 s | first turns' TTFT p50 s "
        "| one-off TTFT p50 s | p99 s | blocks held mean | max | failed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, s in payload["summary"].items():
        lines.append(
            f"| {mode} | {_fmt(s['later_hit_rate'], 3)} | {_fmt(s['later_ttft_p50_s'])} | "
            f"{_fmt(s['later_ttft_p99_s'])} | {_fmt(s['first_ttft_p50_s'])} | "
            f"{_fmt(s['others_ttft_p50_s'])} | {_fmt(s['others_ttft_p99_s'])} | "
            f"{_fmt(s['pinned_blocks_mean'], 0)} | {_fmt(s['pinned_blocks_max'], 0)} | "
            f"{s['failed']} |"
        )
    lines += ["", "Retention counters (summed over runs and replicas):", ""]
    for mode, s in payload["summary"].items():
        lines.append(f"- {mode}: {s['counters']}")
    return "\n".join(lines) + "\n"
