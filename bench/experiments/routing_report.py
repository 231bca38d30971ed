"""A kept ``routing`` run as the README's table (``python -m bench.tables``): for each trace
section, each policy's prompt tokens served from the engines' cache, TTFT p50 and p99 with
their range over the repeats, inter-token latency, output rate and decision time."""

from __future__ import annotations

from typing import Any

HEADER = (
    "| policy | prompt tokens from cache | TTFT p50 s | TTFT p99 s | ITL p50 s | "
    "output tok/s | route p50 ms |"
)


def _spread(m: dict[str, Any], key: str, digits: int) -> str:
    low, high = m.get("spread", {}).get(key, [m[key], m[key]])
    return f"{m[key]:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def _row(policy: str, m: dict[str, Any]) -> str:
    if "error" in m:
        return f"| `{policy}` | failed: {m['error'][:80]} | | | | | |"
    route = m.get("decision_p50_ms")
    cells = [
        f"`{policy}`",
        _spread(m, "hit_rate_engine", 3),
        _spread(m, "ttft_p50_s", 2),
        _spread(m, "ttft_p99_s", 2),
        f"{m['itl_p50_s']:.3f}",
        f"{m['output_tokens_per_s']:.0f}",
        "not timed" if route is None else f"{route:.2f}",
    ]
    return "| " + " | ".join(cells) + " |"


def routing_table(run: dict[str, Any]) -> str:
    """One table per section (arrival rate), its oracle's hit rate and run count under it."""
    blocks = []
    for section, policies in run["runs"].items():
        lines = [HEADER, "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [_row(policy, m) for policy, m in policies.items()]
        runs = max(int(m.get("runs", 1)) for m in policies.values())
        lines.append(
            f"\n{section}: oracle {run['oracle'][section]:.3f} from cache; median of {runs} "
            "runs per policy (range), ABBA"
        )
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
