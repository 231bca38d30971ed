"""``tracing``: what OpenTelemetry tracing costs the cluster (issue 52's target: throughput
and TTFT p50 with every request traced within 3% of tracing off).

The same cluster (``--replicas`` engine replicas of ``--model``, float32, one thread each,
the default prefix-aware routing and node store, Redis) runs with tracing off (no
``OTEL_*`` variable: every hook is one ``None`` check) and on at sampling ratio 1.0
(``OTEL_TRACES_EXPORTER=otlp`` to an OTLP/HTTP receiver in a process of its own, as a
collector runs beside a cluster: ``ReceiverProcess``; ``parentbased_traceidratio`` at
``--ratio``, 1.0 by default; the batch processor's default delays). Modes alternate
ABBA over ``--repeats`` (off, on, on, off, ...), each round a fresh cluster with its own
private Ray (the variables reach the ingress and the replicas through the Ray it starts).

Every round replays the same closed-loop trace: chat requests under ``--system-prompts``
shared system prompts, ``--concurrency`` in flight, streamed (``bench.loadgen.send``: TTFT
to the first chunk with text), after ``--warmup`` requests that are not counted. Per
round: requests/s and output tokens/s over the measured requests' makespan, TTFT p50/p99,
and the spans the receiver got (warm-up included, read after they stop arriving and again
after the cluster stopped) per request sent. The summary: each mode's mean over its rounds,
and on/off per ABBA pair (a repeat's two rounds): the mean of the pairs' ratios with their
min-max, and whether the target was met on those means.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from bench.harness.launcher import ServeCluster
from bench.harness.otlp_receiver import ReceiverProcess, tracing_env
from bench.harness.redis_server import LocalRedis
from bench.harness.rounds import abba
from bench.loadgen import RequestResult, send
from bench.peers.host import provenance
from bench.workloads import TraceRequest, fast_engine, filler_text, system_prompt
from cluster.config import ClusterArgs
from kvindex.config import IndexConfig
from kvindex.measure import percentile

MODES = ["off", "on"]
TARGET = 0.03  # on within 3% of off: requests/s and TTFT p50
METRICS = ("requests_per_s", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny-llama-6m")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--requests", type=int, default=200, help="measured, per round")
    parser.add_argument("--warmup", type=int, default=20, help="sent first, not counted")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--system-prompts", type=int, default=4)
    parser.add_argument("--system-chars", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=2, help="ABBA pairs")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--ratio", type=float, default=1.0, help="on: the sampling ratio")


def trace(args: argparse.Namespace) -> list[TraceRequest]:
    """``--warmup`` + ``--requests`` chat requests, each under one of the shared prompts."""
    rng = random.Random(args.seed)
    systems = [
        system_prompt(args.seed, f"tracing-{i}", args.system_chars)
        for i in range(args.system_prompts)
    ]
    out = []
    for i in range(args.warmup + args.requests):
        k = rng.randrange(len(systems))
        question = filler_text(rng, rng.randint(40, 120)) + "?"
        out.append(
            TraceRequest(f"chat-{i}", 0.0, question, args.max_tokens, f"system-{k}", systems[k])
        )
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    set_before = sorted(k for k in os.environ if k.startswith("OTEL_"))
    if set_before:  # they would reach the "off" rounds' processes too
        raise SystemExit(f"unset {', '.join(set_before)} first: tracing off must be off")
    out = args.out or Path("results/tracing.json")
    out = out / "tracing.json" if out.suffix != ".json" else out
    origin = provenance()  # the commit as the rounds start (a later one may land meanwhile)
    requests = trace(args)
    order = [mode for rep in range(args.repeats) for mode in abba(MODES, rep)]
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    receiver = ReceiverProcess()
    try:
        with LocalRedis() as redis:
            for i, mode in enumerate(order):
                print(f"tracing: {mode} (round {i + 1} of {len(order)})", flush=True)
                runs[mode].append(run_round(args, mode, requests, redis.url, receiver))
    finally:
        receiver.stop()
    payload = {
        "experiment": "tracing",
        "title": f"Tracing off vs on (sampling ratio {args.ratio}): throughput and TTFT",
        "provenance": origin,
        "conditions": {k: v for k, v in vars(args).items() if k != "out"},
        "target": TARGET,
        "order": order,
        "summary": summary(runs),
        "runs": runs,
        "measured": time.strftime("%F"),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    return payload


def cluster_args(args: argparse.Namespace, redis_url: str) -> ClusterArgs:
    return ClusterArgs(
        num_replicas=args.replicas,
        engine=fast_engine(args.model),
        index=IndexConfig(url=redis_url, cluster=f"tracing-{os.getpid()}-{time.monotonic_ns()}"),
    )


def run_round(
    args: argparse.Namespace,
    mode: str,
    requests: list[TraceRequest],
    redis_url: str,
    receiver: ReceiverProcess,
) -> dict[str, Any]:
    """One fresh cluster: the warm-up, the measured requests, then the spans received."""
    receiver.clear()
    env = tracing_env(receiver.endpoint, args.ratio) if mode == "on" else {}
    started = time.monotonic()
    with ServeCluster(cluster_args(args, redis_url), env=env) as cluster:
        start_s = time.monotonic() - started
        model = cluster.args.engine.model_id
        asyncio.run(closed_loop(cluster.base_url, model, requests[: args.warmup], args))
        measured = requests[args.warmup :]
        results, makespan = asyncio.run(closed_loop(cluster.base_url, model, measured, args))
        spans_running = receiver.settled()
    spans = receiver.count()
    metrics = round_metrics(results, makespan)
    return metrics | {
        "start_s": start_s,
        "spans_while_running": spans_running,
        "spans": spans,
        "spans_per_request": spans / len(requests),
    }


async def closed_loop(
    base_url: str, model: str, requests: list[TraceRequest], args: argparse.Namespace
) -> tuple[list[RequestResult], float]:
    """``--concurrency`` workers, each sending the trace's next request when its last one
    finished; the results in trace order and the makespan."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    results: list[RequestResult | None] = [None] * len(requests)
    pending = iter(enumerate(requests))
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:

        async def worker() -> None:
            for i, req in pending:
                results[i] = await send(client, model, req)

        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        makespan = time.monotonic() - start
    return [r for r in results if r is not None], makespan


def round_metrics(results: list[RequestResult], makespan: float) -> dict[str, Any]:
    ok = [r for r in results if r.status == 200 and r.error is None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    prompt = max(sum(r.prompt_tokens for r in ok), 1)
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "duration_s": makespan,
        "requests_per_s": len(ok) / makespan,
        "output_tokens_per_s": sum(r.completion_tokens for r in ok) / makespan,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "cached_fraction": sum(r.cached_tokens for r in ok) / prompt,
    }


def summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Each mode's means; on/off per ABBA pair (mean, min, max); the target's verdict."""
    out: dict[str, Any] = {
        mode: {
            key: statistics.mean(r[key] for r in rounds)
            for key in (*METRICS, "spans_per_request", "cached_fraction")
        }
        | {"rounds": len(rounds), "failed": sum(r["failed"] for r in rounds)}
        for mode, rounds in runs.items()
    }
    pairs = list(zip(runs["off"], runs["on"], strict=True))
    ratios = {}
    for key in METRICS:
        each = [on[key] / off[key] for off, on in pairs]
        ratios[key] = {"mean": statistics.mean(each), "min": min(each), "max": max(each)}
    out["on_over_off"] = ratios
    out["target_met"] = {
        "requests_per_s": ratios["requests_per_s"]["mean"] >= 1 - TARGET,
        "ttft_p50_s": ratios["ttft_p50_s"]["mean"] <= 1 + TARGET,
    }
    return out
