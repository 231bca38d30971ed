"""Where a routing run's TTFT tail comes from: ``python -m bench.tails results/<run>``.

A TTFT p99 over 120 requests is, within a hair, the run's second-slowest request, so one
burst decides it. This splits every run of every policy (``bench routing --out``: its
``requests.json`` and ``trace-<section>.jsonl``) at ``--head-s`` seconds of the trace:
the requests that arrived before (a trace's start, where every tenant or conversation is
new and every prompt a full prefill) and those after: the TTFT p99 and maximum of the
first part, the p50, p99 and maximum of the second, and the arrival of the run's slowest
request. Prints a Markdown table per
section, and with ``--json`` the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.report import percentile, slug
from bench.workloads import load_trace


@dataclass(frozen=True)
class RunTails:
    """One run of one policy, split at ``head_s`` of its trace."""

    policy: str
    run: int
    head: int  # requests that arrived before head_s (with a TTFT)
    head_p99_s: float
    head_max_s: float
    rest_p50_s: float
    rest_p99_s: float
    rest_max_s: float
    slowest_arrival_s: float  # when the run's slowest request arrived in the trace


def split_run(
    policy: str, run: int, rows: list[list], arrivals: dict[str, float], head_s: float
) -> RunTails:
    """``rows``: the run's requests as ``requests.json`` keeps them (id, replica, status,
    TTFT, prompt tokens, cached tokens); a request without a TTFT (failed) is left out."""
    timed = [(arrivals[row[0]], row[3]) for row in rows if row[3] is not None]
    head = [ttft for at, ttft in timed if at < head_s]
    rest = [ttft for at, ttft in timed if at >= head_s]
    if not head or not rest:
        raise ValueError(f"{policy} run {run}: --head-s {head_s} leaves a part empty")
    return RunTails(
        policy,
        run,
        len(head),
        percentile(head, 99),
        max(head),
        percentile(rest, 50),
        percentile(rest, 99),
        max(rest),
        max(timed, key=lambda t: t[1])[0],
    )


def tails(out: Path, head_s: float) -> dict[str, list[RunTails]]:
    """Every section's runs, split (see ``split_run``)."""
    requests = json.loads((out / "requests.json").read_text())
    found: dict[str, list[RunTails]] = {}
    for section, policies in requests.items():
        trace = load_trace(out / f"trace-{slug(section)}.jsonl")
        arrivals = {r.request_id: r.arrival_s for r in trace}
        found[section] = [
            split_run(policy, i, rows, arrivals, head_s)
            for policy, runs in policies.items()
            for i, rows in enumerate(runs)
        ]
    return found


def markdown(section: str, runs: list[RunTails], head_s: float) -> str:
    """Per policy: the median over its runs, and the runs' range, of each part's numbers."""
    head = f"first {head_s:g} s"
    lines = [
        f"| {section}: policy | requests in the {head} | their TTFT max s | after: TTFT p50 s "
        "| after: TTFT p99 s | slowest request arrived at s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for policy in dict.fromkeys(r.policy for r in runs):
        mine = [r for r in runs if r.policy == policy]

        def cell(key: str, mine: list[RunTails] = mine) -> str:
            values = [getattr(r, key) for r in mine]
            mid = statistics.median(values)
            return f"{mid:.2f} ({min(values):.2f}-{max(values):.2f})"

        arrivals = " / ".join(f"{r.slowest_arrival_s:.1f}" for r in mine)
        lines.append(
            f"| `{policy}` | {mine[0].head} | {cell('head_max_s')} | {cell('rest_p50_s')} "
            f"| {cell('rest_p99_s')} | {arrivals} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.tails", description=__doc__)
    parser.add_argument("run", type=Path, help="a routing run's --out folder")
    parser.add_argument("--head-s", type=float, default=3.0, help="where the trace is split")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = parser.parse_args(argv)
    found = tails(args.run, args.head_s)
    if args.json:
        payload = {s: [asdict(r) for r in runs] for s, runs in found.items()}
        sys.stdout.write(json.dumps(payload, indent=2) + "\n")
        return
    for section, runs in found.items():
        sys.stdout.write(markdown(section, runs, args.head_s) + "\n\n")


if __name__ == "__main__":
    main()
