"""``python -m bench <experiment> [--out PATH] ...``"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.experiments import (
    autoscale,
    choices,
    engine,
    faults,
    index,
    kv_shares,
    moves,
    routing,
    scheduling,
    sessions,
    simulate,
    speculation,
    speed,
    stack,
    structured,
    tenants,
    tracing,
)
from bench.experiments.prefix import pull, store

EXPERIMENTS = {
    "engine": (engine, "prefix cache off vs on on one trace, one engine (and vLLM)"),
    "choices": (choices, "n samples of one prompt: one prefill, TTFT next to n = 1"),
    "speculation": (speculation, "prompt-lookup drafts on and off: decode tokens/s, and vLLM's"),
    "speed": (speed, "prefill and decode throughput next to transformers and vLLM"),
    "stack": (stack, "the whole cluster next to Ray Serve LLM with vLLM, vllm bench serve"),
    "structured": (structured, "replies held to a JSON schema: the mask's cost, compile times"),
    "scheduling": (scheduling, "chunked prefill and the admission reserve on one engine"),
    "index": (index, "Redis index query latency, publish throughput, memory"),
    "pull": (pull, "a prefix computed, hit locally, pulled from another replica: TTFT"),
    "store": (store, "a prefix computed, hit locally, restored from the node store: TTFT"),
    "routing": (routing, "routing policies compared on the real cluster: JSON, Markdown, PNG"),
    "simulate": (simulate, "the same policies and cache code on simulated replicas"),
    "autoscale": (autoscale, "replicas follow a rising and falling load: JSON, Markdown, PNG"),
    "tenants": (tenants, "a noisy neighbour: FIFO vs the fair queue, cost after cache, priority"),
    "kv_shares": (kv_shares, "a tenant's flood against another's prefixes: KV shares or not"),
    "sessions": (sessions, "agent sessions: a session's blocks kept across tool calls or not"),
    "tracing": (tracing, "tracing off vs on at ratio 1.0: throughput, TTFT, spans per request"),
    "moves": (moves, "streams moved off leaving or busy replicas against today's drain"),
    "faults": (faults, "fault, overload and soak scenarios with a JSON and Markdown report"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench")
    sub = parser.add_subparsers(dest="experiment", required=True)
    for name, (module, help_text) in EXPERIMENTS.items():
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--out", type=Path, help="where results go (a file, or a folder)")
        module.add_arguments(p)
    return parser


def run(argv: list[str] | None = None) -> dict:
    """Run one experiment from command-line arguments; returns its JSON result (also
    written to ``--out`` when that names a ``.json`` file)."""
    args = build_parser().parse_args(argv)
    result = EXPERIMENTS[args.experiment][0].run(args)
    if args.out is not None and args.out.suffix == ".json":
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result


def main(argv: list[str] | None = None) -> None:
    """The command: the JSON result is the last line on stdout."""
    sys.stdout.write(json.dumps(run(argv), default=str) + "\n")


if __name__ == "__main__":
    main()
