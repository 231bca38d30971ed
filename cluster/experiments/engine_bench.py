"""``engine``: the same trace through one engine with the prefix cache off, then on."""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from cluster.experiments.workloads import TraceRequest, WorkloadSpec, make_trace
from replica.checkpoints import checkpoint_for
from replica.engine import Engine, EngineConfig, SamplingParams
from replica.hashing import BlockHasher
from replica.model_runner import ModelRunner
from replica.stats import EngineMetrics, percentile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", choices=["chat", "random"], default="chat")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals per second")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs per mode, in ABBA order (off on on off)"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = WorkloadSpec(args.trace, num_requests=args.requests, rate=args.rate, seed=args.seed)
    trace = make_trace(spec)
    config = EngineConfig(num_blocks=args.num_blocks, block_size=args.block_size)
    _warm_up(config)
    runs: dict[str, list[Run]] = {"cache_off": [], "cache_on": []}
    for rep in range(args.repeats):
        order = ["cache_off", "cache_on"] if rep % 2 == 0 else ["cache_on", "cache_off"]
        for name in order:  # ABBA: a drift over the run (warming caches) hits both alike
            engine = Engine(config.model_copy(update={"enable_prefix_cache": name == "cache_on"}))
            runs[name].append(replay(engine, trace))
    result: dict[str, Any] = {"trace": args.trace}
    for name, mode_runs in runs.items():
        result[name] = summarize(mode_runs)
    result["conditions"] = {
        "requests": args.requests,
        "rate_per_s": args.rate,
        "seed": args.seed,
        "block_size": args.block_size,
        "num_blocks": args.num_blocks,
        "model_parameters": ModelRunner(config).num_parameters,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "hash_4096_tokens_ms": hash_cost_ms(args.block_size),
    }
    return result


@dataclass
class Run:
    metrics: EngineMetrics
    duration_s: float


def replay(engine: Engine, trace: list[TraceRequest]) -> Run:
    """Drive the engine open-loop: each request is added when its arrival time has passed."""
    tokenizer = checkpoint_for(engine.config.model).tokenizer()
    pending = sorted(trace, key=lambda r: r.arrival_s)
    start = time.monotonic()
    i = 0
    while i < len(pending) or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while i < len(pending) and pending[i].arrival_s <= now:
            req = pending[i]
            engine.add_request(
                req.request_id,
                tokenizer.encode(req.prompt),
                SamplingParams(max_tokens=req.max_tokens, ignore_eos=True),
                arrival_time=start + req.arrival_s,
            )
            i += 1
        if engine.has_unfinished_requests():
            engine.step()
        elif i < len(pending):
            time.sleep(max(0.0, pending[i].arrival_s - (time.monotonic() - start)))
    return Run(engine.metrics, time.monotonic() - start)


def summarize(runs: list[Run]) -> dict[str, Any]:
    """Counters summed and latency samples pooled over the runs of one mode."""
    ms = [r.metrics for r in runs]
    prompt = sum(m.prompt_tokens for m in ms)
    cached = sum(m.cached_prompt_tokens for m in ms)
    ttft = [t for m in ms for t in m.ttft_s]
    itl = [t for m in ms for t in m.itl_s]
    duration = sum(r.duration_s for r in runs)
    return {
        "runs": len(runs),
        "requests": sum(m.num_finished for m in ms),
        "prompt_tokens": prompt,
        "cached_prompt_tokens": cached,
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50),
        "output_tokens_per_s": sum(m.generation_tokens for m in ms) / duration,
        "duration_s": duration / len(runs),
        "ttft_p50_s_per_run": [percentile(m.ttft_s, 50) for m in ms],
        "preemptions": sum(m.preemptions for m in ms),
    }


def hash_cost_ms(block_size: int, num_tokens: int = 4096, repeats: int = 200) -> float:
    """Median wall time to hash one prompt's full block chain."""
    hasher = BlockHasher(block_size, "bench")
    tokens = [(i * 7919) % 50_000 for i in range(num_tokens)]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        hasher.chain(tokens)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _warm_up(config: EngineConfig) -> None:
    """Let torch pick and cache its kernels before anything is timed."""
    Engine(config).generate([[1] * 300, [2] * 40], SamplingParams(max_tokens=4))
