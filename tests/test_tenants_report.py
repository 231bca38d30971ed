"""The tenants benchmark's summary: medians over runs, a percentile beyond the cut-off kept
unknown (never a number), and the ratios the issue sets targets on."""

from __future__ import annotations

import argparse
from typing import Any

from bench.experiments.tenants_report import markdown, summary


def tenant(p99: float | None, served: float, cost: float = 50.0, refused: int = 0) -> dict:
    return {
        "ttft_p50_s": 0.1,
        "ttft_p99_s": p99,
        "served_rps": served,
        "refused": refused,
        "cut_off": 0,
        "mean_cost_tokens": cost,
        "charged_tokens": served * 65 * cost,
    }


def run(noisy_b_p99: float | None, share_b: float) -> dict[str, Any]:
    return {
        "b_alone": {"b": tenant(0.4, 0.5)},
        "noisy": {"a": tenant(9.0, 4.05), "b": tenant(noisy_b_p99, 0.5)},
        "cost_share": {"a": tenant(5.0, 1.0, cost=300), "b": tenant(1.0, share_b, cost=30)},
    }


def test_ratios_use_medians_and_a_cut_off_percentile_stays_unknown() -> None:
    args = argparse.Namespace(light=0.1, duration=45.0, grace=20.0)
    runs = {"fifo": [run(None, 1.0), run(None, 1.2)], "fair": [run(0.5, 6.0), run(0.6, 8.0)]}
    checks = summary(runs, 5.0, args)["checks"]
    assert checks["fifo"]["b_ttft_p99_vs_alone"] is None  # beyond the cut-off in both runs
    assert abs(checks["fair"]["b_ttft_p99_vs_alone"] - 0.55 / 0.4) < 1e-9
    assert abs(checks["fair"]["a_served_vs_rest_of_capacity"] - 4.05 / 4.5) < 1e-9
    assert abs(checks["fair"]["cost_share_b_over_a_requests"] - 7.0) < 1e-9
    # request-count fairness: the charged tokens per second over one A plus one B
    fair_each = checks["fair"]["cost_share_request_fair_rps_each"]
    expected = [(300 * 1.0 * 65 + 30 * s * 65) / 65 / 330 for s in (6.0, 8.0)]
    assert abs(fair_each - sum(expected) / 2) < 1e-9
    text = markdown(
        {"title": "t", "capacity_rps": 5.0, "measured": "today", "summary": summary(runs, 5, args)}
    )
    assert "beyond cut-off" in text and "| fair | noisy | b |" in text
