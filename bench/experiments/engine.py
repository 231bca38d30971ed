"""``engine``: one trace through one engine with the prefix cache off and on (ABBA), and,
with ``--vllm``, through vLLM's CPU build with its prefix cache on: same token ids, same
arrival times, same machine, one run."""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.peers.engines import (
    DEFAULT_VLLM_VENV,
    ensure_hf_folder,
    ensure_vllm_venv,
    run_vllm,
)
from bench.workloads import WORKLOADS, WorkloadSpec, make_trace
from kvindex.hashing import BlockHasher
from replica.checkpoints import TINY_MODEL, checkpoint_for
from replica.config import EngineConfig
from replica.engine.engine import Engine
from replica.engine.stats import EngineMetrics, percentile
from replica.model.runner import ModelRunner
from replica.sampling.params import SamplingParams


@dataclass(frozen=True)
class TimedRequest:
    """A trace request as every engine gets it: token ids and an arrival time."""

    request_id: str
    arrival_s: float
    token_ids: list[int]
    max_tokens: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=TINY_MODEL, help="EngineConfig.model")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2, help="torch threads (every engine)")
    parser.add_argument("--trace", choices=WORKLOADS, default="chat")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals per second")
    parser.add_argument("--output-tokens", default="16,48", help="min,max tokens per request")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs per mode, in ABBA order (off on on off)"
    )
    parser.add_argument("--vllm", action="store_true", help="also run vLLM (cache on)")
    parser.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        num_threads=args.threads,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    low, high = (int(x) for x in args.output_tokens.split(","))
    spec = WorkloadSpec(
        args.trace,
        num_requests=args.requests,
        rate=args.rate,
        seed=args.seed,
        output_tokens=(low, high),
    )
    config = engine_config(args)
    tokenizer = checkpoint_for(config.model).tokenizer()
    trace = [
        TimedRequest(r.request_id, r.arrival_s, r.token_ids(tokenizer), r.max_tokens)
        for r in make_trace(spec)
    ]
    runner = ModelRunner(config)
    runs: dict[str, list[Run]] = {"cache_off": [], "cache_on": []}
    for rep in range(args.repeats):
        order = ["cache_off", "cache_on"] if rep % 2 == 0 else ["cache_on", "cache_off"]
        for name in order:  # ABBA: a drift over the run (warming caches) hits both alike
            mode = config.model_copy(update={"enable_prefix_cache": name == "cache_on"})
            engine = Engine(mode, runner=runner)
            _warm_up(engine)
            runs[name].append(replay(engine, trace))
    result: dict[str, Any] = {"trace": args.trace, "model": config.model_id}
    for name, mode_runs in runs.items():
        result[name] = summarize(mode_runs)
    result["ttft_p50_on_over_off"] = result["cache_on"]["ttft_p50_s"] / max(
        result["cache_off"]["ttft_p50_s"], 1e-9
    )
    if args.vllm:
        result["vllm"] = _vllm(args, config, trace)
        result["ttft_p50_ours_over_vllm"] = result["cache_on"]["ttft_p50_s"] / max(
            result["vllm"]["ttft_p50_s"], 1e-9
        )
    result["conditions"] = _conditions(args, config, runner)
    return result


@dataclass
class Run:
    metrics: EngineMetrics
    duration_s: float


def replay(engine: Engine, trace: list[TimedRequest]) -> Run:
    """Drive the engine open-loop: each request is added when its arrival time has passed."""
    pending = sorted(trace, key=lambda r: r.arrival_s)
    start = time.monotonic()
    i = 0
    while i < len(pending) or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while i < len(pending) and pending[i].arrival_s <= now:
            req = pending[i]
            engine.add_request(
                req.request_id,
                req.token_ids,
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


def _vllm(args: argparse.Namespace, config: EngineConfig, trace: list[TimedRequest]) -> dict:
    """The same trace through vLLM with its prefix cache on (one run, after a warm-up)."""
    folder = ensure_hf_folder(
        checkpoint_for(config.model), Path("results") / f"{config.model_id}-hf"
    )
    requests = [
        {
            "id": r.request_id,
            "arrival_s": r.arrival_s,
            "prompt_token_ids": r.token_ids,
            "max_tokens": r.max_tokens,
        }
        for r in trace
    ]
    spec = {
        "model": str(folder),
        "dtype": config.dtype,
        "threads": args.threads,
        "max_model_len": config.context_len,
        "jobs": [
            {"kind": "trace", "name": "trace", "requests": requests, "warm_prompts": [[1] * 40]}
        ],
    }
    out = run_vllm(ensure_vllm_venv(args.vllm_venv), spec)
    job = out["jobs"]["trace"]
    prompt, cached = job["prompt_tokens"], job["cached_prompt_tokens"]
    return {
        "vllm_version": out["vllm"],
        "startup_s": out["startup_s"],
        "requests": len(job["ttft_s"]),
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "ttft_p50_s": percentile(job["ttft_s"], 50),
        "ttft_p99_s": percentile(job["ttft_s"], 99),
        "itl_p50_s": percentile(job["itl_s"], 50),
        "output_tokens_per_s": job["output_tokens"] / job["duration_s"],
        "duration_s": job["duration_s"],
        # what vLLM was given (preloads, binding) and what its processes ran with
        "vllm_process": {"given": out["given"], **out["process"]},
    }


def _conditions(args: argparse.Namespace, config: EngineConfig, runner: ModelRunner) -> dict:
    return {
        "requests": args.requests,
        "rate_per_s": args.rate,
        "output_tokens": args.output_tokens,
        "seed": args.seed,
        "block_size": args.block_size,
        "num_blocks": args.num_blocks,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "dtype": config.dtype,
        "model_parameters": runner.num_parameters,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "hash_4096_tokens_ms": hash_cost_ms(args.block_size),
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


def _warm_up(engine: Engine) -> None:
    """Let torch pick and cache its kernels before anything is timed; then start clean."""
    engine.generate([[1] * 300, [2] * 40], SamplingParams(max_tokens=4))
    engine.reset_prefix_cache()
    engine.metrics = EngineMetrics()
