"""The ``tenants`` experiment's summary (medians over the repeats, with min-max, and the
issue's ratios) and its Markdown table. A TTFT percentile beyond the cut-off is None in a
run (only a bound is known) and counts as infinite in a median."""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Any

from bench.harness.span_breakdown import PARTS

METRICS = ("ttft_p50_s", "ttft_p99_s", "served_rps", "refused", "cut_off", "mean_cost_tokens")


def _values(runs: list[dict[str, Any]], phase: str, tenant: str, key: str) -> list[float]:
    out = []
    for run in runs:
        value = run[phase][tenant][key]
        out.append(math.inf if value is None else float(value))
    return out


def _stat(values: list[float]) -> dict[str, float | None]:
    def finite(v: float) -> float | None:
        return v if math.isfinite(v) else None

    return {
        "median": finite(statistics.median(values)),
        "min": finite(min(values)),
        "max": finite(max(values)),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def summary(
    runs: dict[str, list[dict[str, Any]]], capacity: float, args: argparse.Namespace
) -> dict[str, Any]:
    """Per mode, phase and tenant the medians; then the ratios the issue sets targets on."""
    table: dict[str, Any] = {}
    for mode, mode_runs in runs.items():
        for phase in mode_runs[0]:
            for tenant in (t for t in mode_runs[0][phase] if not t.startswith("_")):
                stats = {k: _stat(_values(mode_runs, phase, tenant, k)) for k in METRICS}
                table.setdefault(mode, {}).setdefault(phase, {})[tenant] = stats
    checks: dict[str, Any] = {}
    for mode, phases in table.items():
        checks[mode] = _checks(runs[mode], phases, capacity, args)
    return {"table": table, "checks": checks}


def _checks(
    mode_runs: list[dict[str, Any]],
    phases: dict[str, Any],
    capacity: float,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The ratios the issue sets targets on, of the phases that ran (``--phases``)."""
    checks: dict[str, Any] = {
        "bookings_left_after_cut_offs": sum(
            phase.get("_after", {}).get("bookings_left", 0)
            for run in mode_runs
            for phase in run.values()
        )
    }
    alone = phases["b_alone"]["b"]["ttft_p99_s"]["median"] if "b_alone" in phases else None
    if "noisy" in phases:
        noisy = phases["noisy"]
        checks["b_ttft_p99_vs_alone"] = _ratio(noisy["b"]["ttft_p99_s"]["median"], alone)
        checks["b_refused"] = sum(run["noisy"]["b"]["refused"] for run in mode_runs)
        checks["a_served_vs_rest_of_capacity"] = _ratio(
            noisy["a"]["served_rps"]["median"], capacity * (1 - args.light)
        )
    if "cost_share" in phases:
        share = phases["cost_share"]
        checks["cost_share_b_over_a_requests"] = _ratio(
            share["b"]["served_rps"]["median"], share["a"]["served_rps"]["median"]
        )
        checks["cost_share_request_fair_rps_each"] = _request_fair(mode_runs, args)
    if "priority" in phases:
        checks["hi_ttft_p99_vs_alone"] = _ratio(
            phases["priority"]["hi"]["ttft_p99_s"]["median"], alone
        )
    return checks


def _request_fair(mode_runs: list[dict[str, Any]], args: argparse.Namespace) -> float | None:
    """Requests/s each tenant would have had under request-count fairness with both
    backlogged: the tokens the engines were charged per second, over one A plus one B."""
    rates = []
    for run in mode_runs:
        a, b = run["cost_share"]["a"], run["cost_share"]["b"]
        if not a["mean_cost_tokens"] or not b["mean_cost_tokens"]:
            continue
        tokens_per_s = (a["charged_tokens"] + b["charged_tokens"]) / (args.duration + args.grace)
        rates.append(tokens_per_s / (a["mean_cost_tokens"] + b["mean_cost_tokens"]))
    return statistics.median(rates) if rates else None


def _fmt(stat: dict[str, float | None], digits: int = 2) -> str:
    med, lo, hi = stat["median"], stat["min"], stat["max"]
    if med is None:
        return "beyond cut-off"

    def n(v: float | None) -> str:
        return "cut-off" if v is None else f"{v:.{digits}f}"

    return f"{n(med)} ({n(lo)}-{n(hi)})"


def phases_table(payload: dict[str, Any]) -> str:
    """Every mode, phase and tenant of a run: medians (min-max) over its repeats (the table
    ``bench.tables`` places in the README for a kept run)."""
    lines = [
        "| mode | phase | tenant | TTFT p50 s | TTFT p99 s | served req/s | refused | cut off |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, phases in payload["summary"]["table"].items():
        for phase, tenants in phases.items():
            for tenant, s in tenants.items():
                lines.append(
                    f"| {mode} | {phase} | {tenant} | {_fmt(s['ttft_p50_s'])} | "
                    f"{_fmt(s['ttft_p99_s'])} | {_fmt(s['served_rps'])} | "
                    f"{_fmt(s['refused'], 0)} | {_fmt(s['cut_off'], 0)} |"
                )
    return "\n".join(lines)


def spans_table(payload: dict[str, Any]) -> str:
    """Where the traced tenants' TTFT went (``--trace``), in ms: each part's p50 (the
    median over the repeats), and the parts of the slowest traced request of all repeats."""
    head = " | ".join(p.replace("_", " ") for p in PARTS)
    lines = [
        f"| mode | phase | tenant | requests | | TTFT | {head} |",
        "| --- | --- | --- | --- | --- | --- |" + " --- |" * len(PARTS),
    ]
    for mode, runs in payload["runs"].items():
        for phase, traced in _traced(runs).items():
            for tenant, found in traced.items():
                rows = [r for r in found if r.get("requests")]
                if not rows:
                    continue
                n = sum(r["requests"] for r in rows)
                p50 = [statistics.median([r["p50_s"][p] for r in rows]) for p in PARTS]
                ttft = statistics.median([r["ttft_p50_s"] or math.inf for r in rows])
                slow = max((r["slowest"] for r in rows), key=lambda x: x["ttft_s"])
                cells = " | ".join(f"{1000 * v:.0f}" for v in p50)
                first = f"| {mode} | {phase} | {tenant} | {n} | p50 | {1000 * ttft:.0f}"
                lines.append(f"{first} | {cells} |")
                cells = " | ".join(f"{1000 * slow[p]:.0f}" for p in PARTS)
                lines.append(f"| | | | | slowest | {1000 * slow['ttft_s']:.0f} | {cells} |")
    return "\n".join(lines)


def traced(payload: dict[str, Any]) -> bool:
    """Whether the run traced some tenants' requests (``--trace``)."""
    runs = [r for mode_runs in payload.get("runs", {}).values() for r in mode_runs]
    return any("_spans" in phase for r in runs for phase in r.values())


def _traced(runs: list[dict[str, Any]]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Per phase and traced tenant, its breakdown in each run, with the run's TTFT p50."""
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for run in runs:
        for phase, result in run.items():
            for tenant, found in result.get("_spans", {}).items():
                row = found | {"ttft_p50_s": result[tenant]["ttft_p50_s"]}
                out.setdefault(phase, {}).setdefault(tenant, []).append(row)
    return out


def markdown(payload: dict[str, Any]) -> str:
    lines = [
        f"# {payload['title']}",
        "",
        f"capacity {payload['capacity_rps']:.2f} requests/s; measured {payload['measured']}",
        "",
        phases_table(payload),
    ]
    if traced(payload):
        lines += ["", "Where the traced tenants' TTFT went (ms):", "", spans_table(payload)]
    lines += ["", "Checks (medians):", ""]
    for mode, checks in payload["summary"]["checks"].items():
        for key, value in checks.items():
            shown = "beyond cut-off" if value is None else f"{value:.3g}"
            lines.append(f"- {mode} {key}: {shown}")
    return "\n".join(lines) + "\n"
