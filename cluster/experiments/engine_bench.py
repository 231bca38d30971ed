"""``engine``: the same trace through one engine with the prefix cache off, then on."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from cluster.workloads import TRACES, TraceRequest
from replica.engine import Engine, EngineConfig, SamplingParams
from replica.metrics import percentile
from router.hashing import BlockHasher


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", choices=sorted(TRACES), default="chat")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals per second")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)


def run(args: argparse.Namespace) -> dict[str, Any]:
    trace = TRACES[args.trace](num_requests=args.requests, rate=args.rate, seed=args.seed)
    config = EngineConfig(num_blocks=args.num_blocks, block_size=args.block_size)
    _warm_up(config)
    result: dict[str, Any] = {"trace": args.trace}
    for name, enabled in (("cache_off", False), ("cache_on", True)):
        engine = Engine(config.model_copy(update={"enable_prefix_cache": enabled}))
        result[name] = replay(engine, trace)
    result["conditions"] = {
        "requests": args.requests,
        "rate_per_s": args.rate,
        "seed": args.seed,
        "block_size": args.block_size,
        "num_blocks": args.num_blocks,
        "model_parameters": Engine(config).runner.num_parameters,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "hash_4096_tokens_ms": hash_cost_ms(args.block_size),
    }
    return result


def replay(engine: Engine, trace: list[TraceRequest]) -> dict[str, Any]:
    """Drive the engine open-loop: each request is added when its arrival time has passed."""
    tokenizer = engine.tokenizer
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
    duration = time.monotonic() - start
    m = engine.metrics
    return {
        "requests": m.num_finished,
        "prompt_tokens": m.prompt_tokens,
        "cached_prompt_tokens": m.cached_prompt_tokens,
        "hit_rate": round(m.hit_rate, 4),
        "ttft_p50_s": percentile(m.ttft_s, 50),
        "ttft_p99_s": percentile(m.ttft_s, 99),
        "itl_p50_s": percentile(m.itl_s, 50),
        "output_tokens_per_s": m.generation_tokens / duration,
        "duration_s": duration,
        "preemptions": m.preemptions,
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
