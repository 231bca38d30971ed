"""Per-policy metrics from request results, and the report files (JSON, Markdown, PNG).

Shared by the real routing experiment and the simulator, so their numbers mean the same.
"""

from __future__ import annotations

import json
import re
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from bench.loadgen import RequestResult
from kvindex.measure import percentile


def spread(values: list[float]) -> dict[str, float] | None:
    """Median, min and max of repeated measurements (None for none): how every ABBA
    experiment reports a number and its range."""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(
    results: list[RequestResult], makespan_s: float, replica_ids: list[str]
) -> dict[str, Any]:
    """Client-side metrics of one policy's run (token-weighted hit rate from usage)."""
    ok = [r for r in results if r.status == 200 and r.error is None]
    failed = [r for r in results if not (r.status == 200 and r.error is None)]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [t for r in ok for t in r.itl_s]
    per_replica = Counter(r.replica for r in ok if r.replica)
    counts = [per_replica.get(rid, 0) for rid in replica_ids] or [0]
    mean = sum(counts) / len(counts)
    # the tokens each replica ran (uncached prompt and output): cache hits make requests
    # unequal, so a prefix router's fair share is in work, not in requests
    work = Counter()
    for r in ok:
        if r.replica:
            work[r.replica] += r.prompt_tokens - r.cached_tokens + r.completion_tokens
    works = [work.get(rid, 0) for rid in replica_ids] or [0]
    mean_work = sum(works) / len(works)
    return {
        "requests_ok": len(ok),
        "requests_failed": len(results) - len(ok),
        "errors": sorted({(r.error or str(r.status))[:120] for r in failed})[:5],
        "hit_rate_usage": cached / prompt if prompt else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50),
        "output_tokens_per_s": sum(r.completion_tokens for r in ok) / makespan_s,
        "makespan_s": makespan_s,
        "requests_per_replica": counts,
        "load_imbalance": max(counts) / mean if mean else None,
        "work_imbalance": max(works) / mean_work if mean_work else None,
        "ttft_samples": sorted(ttft),
        "requests": [  # every request, for whoever compares runs after (``requests.json``)
            [r.request_id, r.replica, r.status, r.ttft_s, r.prompt_tokens, r.cached_tokens]
            for r in results
        ],
    }


SPREAD = ("hit_rate_engine", "ttft_p50_s", "ttft_p99_s")


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Repeated runs of one policy as one: the median of every number, the pooled TTFT
    samples, and the min-max ``spread`` of the headline metrics (a win must beat it)."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    merged = dict(ok[0])
    for key, value in ok[0].items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            values = [r[key] for r in ok if isinstance(r.get(key), int | float)]
            merged[key] = statistics.median(values) if values else value
    merged["ttft_samples"] = pooled = sorted(t for r in ok for t in r.get("ttft_samples", []))
    merged["requests_by_run"] = [r.get("requests", []) for r in ok]
    merged["runs"] = len(ok)
    if len(ok) > 1 and pooled:  # one p99 of every run's requests, not a median of p99s
        for q in (50, 90, 99):
            merged[f"ttft_pooled_p{q}_s"] = percentile(pooled, q)
    merged["spread"] = {
        key: [min(r[key] for r in ok), max(r[key] for r in ok)]
        for key in SPREAD
        if all(r.get(key) is not None for r in ok)
    }
    if len(ok) < len(runs):
        merged["failed_runs"] = [r["error"] for r in runs if "error" in r]
    return merged


_COLUMNS = [
    ("policy", "policy"),
    ("ok/failed", None),
    ("hit rate (engine)", "hit_rate_engine"),
    ("hit rate (usage)", "hit_rate_usage"),
    ("oracle", "oracle_hit_rate"),
    ("TTFT p50 s", "ttft_p50_s"),
    ("TTFT p90 s", "ttft_p90_s"),
    ("TTFT p99 s", "ttft_p99_s"),
    ("pooled p99 s", "ttft_pooled_p99_s"),
    ("ITL p50 s", "itl_p50_s"),
    ("out tok/s", "output_tokens_per_s"),
    ("req/replica", "requests_per_replica"),
    ("max/mean", "load_imbalance"),
    ("max/mean work", "work_imbalance"),
    ("route p50 ms", "decision_p50_ms"),
    ("route p99 ms", "decision_p99_ms"),
]


def markdown(payload: dict[str, Any]) -> str:
    lines = [f"# {payload['title']}", "", payload.get("conditions", ""), ""]
    for section, runs in payload["runs"].items():
        lines += [f"## {section}", ""]
        lines.append("| " + " | ".join(name for name, _ in _COLUMNS) + " |")
        lines.append("|" + " --- |" * len(_COLUMNS))
        for policy, m in runs.items():
            if "error" in m:
                lines.append(f"| {policy} | could not run: {m['error']} |")
                continue
            cells = []
            for _, key in _COLUMNS:
                if key is None:
                    cells.append(f"{m['requests_ok']}/{m['requests_failed']}")
                elif key in m.get("spread", {}) and m.get("runs", 1) > 1:
                    lo, hi = m["spread"][key]
                    cells.append(f"{_fmt(m[key])} ({_fmt(lo)}-{_fmt(hi)})")
                else:
                    cells.append(_fmt(policy if key == "policy" else m.get(key)))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def write_report(out: Path, payload: dict[str, Any]) -> dict[str, Any]:
    """``results.json`` (without raw samples), ``requests.json`` (each run's requests: id,
    replica, status, TTFT, prompt and cached tokens; where the runs kept them),
    ``results.md`` and the plots; returns what ``results.json`` holds."""
    out.mkdir(parents=True, exist_ok=True)
    plot(out, payload)
    slim = json.loads(json.dumps(payload, default=str))
    requests: dict[str, dict[str, Any]] = {}  # each run's requests (``summarize``'s rows)
    for section, runs in slim["runs"].items():
        requests[section] = {}
        for policy, m in runs.items():
            m.pop("ttft_samples", None)
            rows = m.pop("requests", None) or []
            requests[section][policy] = m.pop("requests_by_run", None) or [rows]
    if any(rows for runs in requests.values() for by_run in runs.values() for rows in by_run):
        (out / "requests.json").write_text(json.dumps(requests) + "\n")
    (out / "results.json").write_text(json.dumps(slim, indent=2) + "\n")
    (out / "results.md").write_text(markdown(payload) + "\n")
    return slim


def plot(out: Path, payload: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for section, runs in payload["runs"].items():
        ok = {p: m for p, m in runs.items() if "error" not in m}
        if not ok:
            continue
        tag = slug(section)
        fig, ax = plt.subplots(figsize=(6, 4))
        for policy, m in ok.items():
            xs = m["ttft_samples"]
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=policy)
        ax.set_xscale("log")
        ax.set(xlabel="TTFT (s)", ylabel="fraction of requests", title=f"TTFT CDF, {section}")
        ax.legend()
        fig.savefig(out / f"ttft_cdf_{tag}.png", dpi=110, bbox_inches="tight")
        plt.close(fig)

        fig, ax = plt.subplots(figsize=(6, 4))
        names = list(ok)
        rates = [ok[p].get("hit_rate_engine", ok[p]["hit_rate_usage"]) for p in names]
        ax.bar(names, rates, color="tab:blue", label="hit rate")
        oracle = next(iter(ok.values())).get("oracle_hit_rate")
        if oracle is not None:
            ax.axhline(oracle, color="tab:red", linestyle="--", label="oracle")
        ax.set(ylabel="prompt tokens from cache", ylim=(0, 1), title=f"Hit rate, {section}")
        ax.legend()
        fig.savefig(out / f"hit_rate_{tag}.png", dpi=110, bbox_inches="tight")
        plt.close(fig)

        fig, ax = plt.subplots(figsize=(6, 4))
        width = 0.8 / max(len(names), 1)
        for i, policy in enumerate(names):
            counts = ok[policy]["requests_per_replica"]
            ax.bar([j + i * width for j in range(len(counts))], counts, width, label=policy)
        ax.set(xlabel="replica", ylabel="requests", title=f"Load per replica, {section}")
        ax.legend()
        fig.savefig(out / f"load_{tag}.png", dpi=110, bbox_inches="tight")
        plt.close(fig)

    for sweep in payload.get("sweeps") or []:
        fig, ax = plt.subplots(figsize=(6, 4))
        for policy, points in sweep["series"].items():
            xs = [p[0] for p in points]
            ax.plot(xs, [p[1] for p in points], marker="o", label=f"{policy}")
        ax.set(xlabel=sweep["x"], ylabel=sweep["y"], title=sweep["title"])
        if sweep.get("log_x"):
            ax.set_xscale("log", base=2)
        ax.legend()
        fig.savefig(out / sweep["file"], dpi=110, bbox_inches="tight")
        plt.close(fig)


def faults_markdown(report: dict[str, Any]) -> str:
    lines = ["# Faults, overload and soak on the real cluster", ""]
    lines += ["| scenario | ok | failed | lost | recovery | accounting | notes |"]
    lines += ["| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in report.items():
        if "error" in r and "ok" not in r:
            lines.append(f"| {name} | - | - | - | - | - | could not run: {r['error']} |")
            continue
        recovery = _recovery(name, r)
        lines.append(
            f"| {name} | {r['ok']} | {r['failed']} | {r['lost']} | {recovery} | "
            f"{'ok' if r.get('accounting_ok') else 'NOT OK'} | "
            f"{'; '.join(r.get('failure_kinds', []))[:200]} |"
        )
    return "\n".join(lines)


def _recovery(name: str, r: dict[str, Any]) -> str:
    if name == "redis_kill":
        return f"index rebuilt {_s(r.get('index_rebuilt_s'))} after restart"
    if name == "replica_kill":
        return (
            f"{r.get('resumed_requests', 0):.0f} resumed (stall p50 "
            f"{_s(r.get('resume_stall_p50_s'))}, p99 {_s(r.get('resume_stall_p99_s'))}); out of "
            f"index answers {_s(r.get('left_index_answers_s'))}, replacement registered "
            f"{_s(r.get('replacement_registered_s'))}"
        )
    if name == "repeated_kills":
        return f"{r.get('kills')} kills, {r.get('resumed_requests', 0):.0f} resumed"
    if name == "scale_down":
        kept = r.get("replicas_kept")
        return f"3 -> 2 replicas, drained in {_s(r.get('drained_s'))}, {kept} kept"
    if name == "redis_slow":
        return f"route p99 {r.get('route_p99_ms', 0):.1f} ms"
    if name == "overload":
        return f"{r.get('shed_503')} shed, shed p99 {_s(r.get('shed_latency_p99_s'))}"
    if name == "events_lost":
        return f"gap seen and mirror resynced in {_s(r.get('gap_seen_and_resynced_s'))}"
    if name in ("router_restart", "router_rolling_restart"):
        return (
            f"ingress replaced in {_s(r.get('ingress_replaced_s'))}, new mirror synced "
            f"{_s(r.get('new_mirror_synced_s'))} after; new routers' decisions from the mirror: "
            f"{r.get('new_router_mirror_decisions', 0):.0f}"
        )
    return f"{r.get('duration_s', 0):.0f} s of mixed load"


def _s(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:.1f} s"


def slug(section: str) -> str:
    """A section name as a file name part: ``rate 4/s`` -> ``rate_4_s``."""
    return re.sub(r"[^0-9a-z]+", "_", section.lower()).strip("_")


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    if isinstance(value, list):
        return "/".join(str(v) for v in value) if len(value) <= 8 else f"{len(value)} replicas"
    return str(value)
