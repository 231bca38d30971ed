"""The ``moves`` experiment's measures and its README table (``python -m bench.tables``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.loadgen import RequestResult
from bench.workloads import TraceRequest


def window_hit_rate(
    trace: Sequence[TraceRequest], results: Sequence[RequestResult], lo: float, hi: float
) -> float | None:
    """Cached prompt tokens over prompt tokens, of the answered requests that arrived in
    [lo, hi) seconds of the trace."""
    ok = [
        r
        for q, r in zip(trace, results, strict=True)
        if lo <= q.arrival_s < hi and r.status == 200 and r.error is None
    ]
    prompt = sum(r.prompt_tokens for r in ok)
    return sum(r.cached_tokens for r in ok) / prompt if prompt else None


def _f(value: float | None, fmt: str = ".2f") -> str:
    return "-" if value is None else format(value, fmt)


def _ratio(after: float | None, before: float | None) -> str:
    return "-" if not after or not before else f"{after / before:.2f}x"


def _spread(ratios: list[float]) -> str:
    return ", ".join(f"{r:.2f}x" for r in ratios)


def _moved(moved: dict[str, float], reason: str) -> str:
    pushed, recomputed = moved.get(f"{reason}:pushed", 0), moved.get(f"{reason}:recomputed", 0)
    return f"{pushed:.0f} pushed, {recomputed:.0f} recomputed"


def event_rows(run: dict[str, Any], scenario: str, label: str, reason: str) -> list[str]:
    rows = []
    for mode in ("drain", "moves"):
        r = run.get(scenario, {}).get(mode)
        if r is None:
            continue
        before, after = r["hit_before"], r["hit_after"]
        rows.append(
            f"| {label}, {'today: drain' if mode == 'drain' else 'moves'} "
            f"| {r['in_flight_at_event']} | {_f(r['event_s'], '.1f')} s "
            f"| {r['requests']['failed']} of {r['requests']['requests']} "
            f"| {_f(before)} | {_f(after)} ({_ratio(after, before)}) "
            f"| {_moved(r['moved'], reason)} |"
        )
    return rows


def moves_table(run: dict[str, Any]) -> str:
    events = [
        *event_rows(run, "scale_in", "scale-in 3 -> 1, multi_turn", "leaving"),
        *event_rows(run, "redeploy", "rolling redeploy of 2, multi_tenant", "leaving"),
    ]
    lines = []
    if events:
        lines = [
            "| scenario | streams in flight | event to settled | failed | hit rate before "
            "| hit rate after | streams moved |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            *events,
        ]
    balance = run.get("balance")
    if balance:
        lines += [""] if lines else []
        lines += [
            "| hot tenant, long outputs | TTFT p50 s | TTFT p99 s | e2e p50 s | e2e p99 s "
            "| hit rate | failed | streams moved |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        pairs = len(balance["ratios"]["e2e_p99_s"])
        for mode, label in (("drain", "no migration"), ("moves", "live migration")):
            label = f"{label}, median of {pairs}"
            r = balance[mode]
            lines.append(
                f"| {label} | {_f(r['ttft_p50_s'])} | {_f(r['ttft_p99_s'])} "
                f"| {_f(r['e2e_p50_s'])} | {_f(r['e2e_p99_s'])} | {_f(r['hit_rate'], '.3f')} "
                f"| {r['failed']:.0f} | {_moved(r['moved'], 'balance')} |"
            )
        ratios = balance["ratios"]
        lines.append(
            f"| on / off, each ABBA pair | | {_spread(ratios['ttft_p99_s'])} | "
            f"| {_spread(ratios['e2e_p99_s'])} | | | |"
        )
    return "\n".join(lines)


def markdown(run: dict[str, Any]) -> str:
    return moves_table(run) + "\n"
