"""The README's result tables, rendered from the JSON a run kept under ``docs/results/``.

``python -m bench.tables docs/results/<run>.json`` prints the table of a ``speed`` run
(ours next to vLLM, or without peers how close ours came to the machine), a ``stack`` run
(our cluster next to Ray Serve LLM), a ``speculation`` run (drafts on and off, one engine
next to vLLM's ``ngram``, or the whole cluster), a ``tracing`` run (tracing off and on)
a ``tenants`` run (each mode, phase and tenant) or a ``routing`` run (each policy on one trace),
with the commit and CPU it measured. The README places each table after a marker naming its file
(``<!-- table: docs/results/<run>.json -->``), and ``tests/test_results_tables.py`` checks
that every such table is exactly what this prints: a table cannot drift from its run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

SPEED_ROWS = (
    ("prefill_tokens_per_s", "prefill ({prefill} tokens)"),
    ("decode_tokens_per_s_b1", "decode, batch 1"),
    ("decode_tokens_per_s_b8", "decode, batch 8"),
    ("decode_tokens_per_s_b32", "decode, batch 32"),
    ("output_tokens_per_s_b1", "output, batch 1"),
    ("output_tokens_per_s_b8", "output, batch 8"),
    ("output_tokens_per_s_b32", "output, batch 32"),
)


def _num(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _ratio(s: dict[str, float]) -> str:
    return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"


def provenance_line(run: dict[str, Any]) -> str:
    p = run["provenance"]
    cpu = p["cpu"]
    isa = next((k for k in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if cpu.get(k)), "none")
    dirty = ", uncommitted changes" if p.get("dirty") else ""
    return f"commit {p['commit'][:7]}{dirty}; {cpu['model']}, best ISA {isa}"


def speed_table(run: dict[str, Any]) -> str:
    """Ours next to vLLM, tokens/s: medians, and the per-repeat ratio's median (range)."""
    prefill = run["conditions"].get("prefill_tokens", 1024)  # 1,024 before it was recorded
    lines = [
        f"| tokens/s, {run['dtype']} | ours | vLLM CPU 0.32 | ours / vLLM |",
        "| --- | --- | --- | --- |",
    ]
    for key, label in SPEED_ROWS:
        if key not in run["ours"]:  # a batch this run did not measure
            continue
        ours, peer, ratio = run["ours"][key], run["vllm"][key], run["ours_over_vllm"][key]
        name = label.format(prefill=f"{prefill:,}")
        lines.append(
            f"| {name} | {_num(ours['median'])} | {_num(peer['median'])} | {_ratio(ratio)} |"
        )
    return "\n".join(lines)


def _median(summary: dict[str, Any], key: str) -> float:
    return summary[key]["median"]


def _range(s: dict[str, float]) -> str:
    return f"{s['min']:,.0f}-{s['max']:,.0f}"


def stack_table(run: dict[str, Any]) -> str:
    """Our cluster next to Ray Serve LLM: medians over the rounds (range for the ratios)."""
    ours, peer, ratio = run["ours"], run["ray-llm"], run["ours_over_ray-llm"]
    rounds = {name: len(rows) for name, rows in run["rounds"].items()}
    rows = [
        ("requests/s", "request_throughput", ".2f"),
        ("output tokens/s", "output_throughput", ".0f"),
        ("TTFT p50 ms", "ttft_p50_ms", ",.0f"),
        ("TTFT p99 ms", "ttft_p99_ms", ",.0f"),
        ("ITL p50 ms", "itl_p50_ms", ".1f"),
        ("ITL p99 ms", "itl_p99_ms", ",.0f"),
        ("end-to-end p99 ms", "e2el_p99_ms", ",.0f"),
    ]
    lines = [
        f"| {rounds['ours']} + {rounds['ray-llm']} rounds | ours | Ray Serve LLM + vLLM "
        "| ours / Ray LLM |",
        "| --- | --- | --- | --- |",
    ]
    for label, key, fmt in rows:
        a, b = format(_median(ours, key), fmt), format(_median(peer, key), fmt)
        lines.append(f"| {label} | {a} | {b} | {_ratio(ratio[key])} |")
    cached = [f"{_median(s, 'cached_fraction'):.3f}" for s in (ours, peer)]
    lines.append(f"| prompt tokens from cache | {cached[0]} | {cached[1]} | |")
    failed = [sum(r["failed"] for r in run["rounds"][n]) for n in ("ours", "ray-llm")]
    lines.append(f"| failed requests, all rounds | {failed[0]} | {failed[1]} | |")
    starts = [_starts(s) for s in (ours, peer)]
    lines.append(f"| start, cold / warm median s | {starts[0]} | {starts[1]} | |")
    for label, key in (("RSS", "replica_rss_mib"), ("PSS", "replica_pss_mib")):
        lines.append(
            f"| {label} per engine replica MiB | {_range(ours[key])} | {_range(peer[key])} | |"
        )
    return "\n".join(lines)


def _starts(summary: dict[str, Any]) -> str:
    cold, warm = summary["startup_cold_s"], sorted(summary["startup_warm_s"])
    warm_median = warm[len(warm) // 2] if warm else float("nan")
    return f"{cold[0]:.0f} / {warm_median:.0f}"


def machine_table(run: dict[str, Any]) -> str:
    """How close our engine's medians came to the machine (a ``speed`` run's ``machine``)."""
    m, prefill = run["machine"], run["conditions"]["prefill_tokens"]
    return "\n".join(
        [
            f"| {run['dtype']}, {m['path']} path | ours | the machine's | fraction |",
            "| --- | --- | --- | --- |",
            f"| prefill ({prefill:,} tokens), GFLOP/s | {m['prefill_gflops']:.0f} "
            f"| {m['peak_gflops']:.0f} (peak at {m['clock_ghz']:.2f} GHz) "
            f"| {m['prefill_of_peak']:.2f} |",
            f"| decode at batch 1, GB/s read | {m['decode_b1_gb_s']:.1f} "
            f"| {m['bandwidth_gb_s']:.1f} (measured) | {m['decode_b1_of_bandwidth']:.2f} |",
        ]
    )


def speculation_table(run: dict[str, Any]) -> str:
    """Drafts on and off on one engine, per trace and batch, and vLLM's plain and ``ngram``
    tokens/s beside them (a ``speculation`` run's ``summary``)."""
    lines = [
        "| trace | batch | off tok/s | on tok/s | on / off (spread) | drafts kept "
        "| vLLM plain | vLLM `ngram` | ours on / vLLM `ngram` |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key, row in run["summary"].items():
        trace, batch = key.split("/b")
        plain, ngram = row.get("vllm_plain_tokens_per_s"), row.get("vllm_ngram_tokens_per_s")
        peer = (
            f"{plain:.1f} | {ngram:.1f} | {row['on_tokens_per_s'] / ngram:.2f}x"
            if ngram
            else "- | - | -"
        )
        lines.append(
            f"| {trace} | {batch} | {row['off_tokens_per_s']:.1f} | {row['on_tokens_per_s']:.1f} "
            f"| {row['speedup']:.2f}x ({row['speedup_min']:.2f}-{row['speedup_max']:.2f}) "
            f"| {row['acceptance']:.0%} | {peer} |"
        )
    return "\n".join(lines)


def speculation_cluster_table(run: dict[str, Any]) -> str:
    """The whole cluster with drafts on and off (a ``speculation --parts cluster`` run)."""
    summary = run["cluster"]["summary"]
    off = summary["off"]
    lines = [
        "| mode | requests | output tokens | e2e p50 | time per output token p50 "
        "| gap between chunks p50 | TTFT p50 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, label in (("off", "drafts off"), ("on", "drafts on")):
        m = summary[mode]
        e2e, tpot = m["e2e_p50_s"], m["time_per_output_token_p50_s"]
        ratio = "" if mode == "off" else f" ({e2e / off['e2e_p50_s']:.2f}x)"
        tpot_ratio = "" if mode == "off" else f" ({tpot / off['time_per_output_token_p50_s']:.2f}x)"
        lines.append(
            f"| {label} | {m['requests']} | {m['output_tokens']:,} | {e2e:.2f} s{ratio} "
            f"| {tpot * 1000:.1f} ms{tpot_ratio} | {m['itl_p50_s'] * 1000:.1f} ms "
            f"| {m['ttft_p50_s']:.3f} s |"
        )
    return "\n".join(lines)


def tracing_table(run: dict[str, Any]) -> str:
    """Tracing off and on (sampling ratio 1.0): each mode's mean over its rounds, on / off
    as the mean of the ABBA pairs' ratios (min-max), and the 3% target as measured."""
    summary, target = run["summary"], run["target"]
    off, on, ratio, met = (summary[k] for k in ("off", "on", "on_over_off", "target_met"))
    bound = {"requests_per_s": f">= {1 - target:.2f}", "ttft_p50_s": f"<= {1 + target:.2f}"}
    lines = [
        f"| {off['rounds']} + {on['rounds']} rounds, ABBA | tracing off "
        f"| tracing on, ratio {run.get('conditions', {}).get('ratio', 1.0)} "
        "| on / off (spread) | target |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label, key, scale, fmt in (
        ("requests/s", "requests_per_s", 1, ".2f"),
        ("output tokens/s", "output_tokens_per_s", 1, ".0f"),
        ("TTFT p50 ms", "ttft_p50_s", 1000, ".0f"),
        ("TTFT p99 ms", "ttft_p99_s", 1000, ".0f"),
    ):
        verdict = f" {bound[key]}: {'met' if met[key] else 'not met'} " if key in met else " "
        lines.append(
            f"| {label} | {format(off[key] * scale, fmt)} | {format(on[key] * scale, fmt)} "
            f"| {ratio[key]['mean']:.3f} ({ratio[key]['min']:.3f}-{ratio[key]['max']:.3f}) "
            f"|{verdict}|"
        )
    spans = (f"{summary[m]['spans_per_request']:.1f}" for m in ("off", "on"))
    lines.append(f"| spans received per request | {' | '.join(spans)} | | |")
    lines.append(f"| failed requests, all rounds | {off['failed']} | {on['failed']} | | |")
    return "\n".join(lines)


def render(path: Path, name: str | None = None) -> str:
    """The table of the run kept at ``path`` (cited as ``name``, else the path as given),
    and the line naming what it measured."""
    run = json.loads(path.read_text())
    if run.get("workload", {}).get("experiment") == "routing":
        from bench.experiments.routing_report import routing_table

        table = routing_table(run)
    elif run.get("experiment") == "moves":
        from bench.experiments.moves_report import moves_table

        table = moves_table(run)
    elif run.get("arguments", {}).get("experiment") == "tenants":
        from bench.experiments.tenants_report import phases_table, spans_table, traced

        table = phases_table(run)
        if traced(run):  # where the traced tenants' TTFT went
            table += "\n\n" + spans_table(run)
    elif run.get("experiment") == "tracing":
        table = tracing_table(run)
    elif run.get("experiment") == "speculation":
        table = speculation_table(run) if "summary" in run else speculation_cluster_table(run)
    elif "rounds" in run:
        table = stack_table(run)
    else:
        table = speed_table(run) if "vllm" in run else machine_table(run)
    return f"{table}\n\n({provenance_line(run)}; `{name or path.as_posix()}`)"


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(render(Path(arg)), end="\n\n")
