"""``speed``: prefill and decode throughput of our engine next to transformers and vLLM.

Same checkpoint, same token ids, same dtype and torch threads, one run. Prefill: one
``--prefill-tokens`` prompt, one token out (tokens/s = prompt tokens / seconds). Decode at
batch B: B chat prompts (the support system prompt and B distinct questions) submitted
together; decode tokens/s = B x (N - 1) / (T_N - T_1), where T_k is the time to generate k
tokens each, so the prefill cancels out; output tokens/s = B x N / T_N. Every engine's
prefix cache is emptied before every timed run; the median of ``--repeats`` runs counts.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from cluster.experiments.assistant_prompts import (
    LONG_DOCUMENT,
    SUPPORT_QUESTIONS,
    SUPPORT_SYSTEM_PROMPT,
)
from cluster.experiments.peers import (
    DEFAULT_VLLM_VENV,
    TransformersPeer,
    ensure_hf_folder,
    ensure_vllm_venv,
    run_vllm,
)
from cluster.experiments.workloads import TraceRequest
from replica.checkpoints import SMOLLM2, checkpoint_for
from replica.engine import Engine, EngineConfig, SamplingParams
from replica.tokenizer import Tokenizer

PEERS = ("ours", "transformers", "vllm")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=SMOLLM2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--decode-tokens", type=int, default=64, help="N: tokens per request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV)


def workload(tokenizer: Tokenizer, prefill_tokens: int, batches: list[int]) -> dict[str, Any]:
    """The prompts every engine gets: one long prompt, and up to max(batches) chats."""
    document = tokenizer.encode(LONG_DOCUMENT * (prefill_tokens // 100 + 1))[:prefill_tokens]
    chats = [
        TraceRequest(
            f"q{i}",
            0.0,
            f"{SUPPORT_QUESTIONS[i % 16]} (ticket {i})",
            0,
            system=SUPPORT_SYSTEM_PROMPT,
        ).token_ids(tokenizer)
        for i in range(max(batches))
    ]
    return {"prefill": document, "chats": chats}


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    checkpoint = checkpoint_for(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = workload(checkpoint.tokenizer(), args.prefill_tokens, batches)
    peers = args.peers.split(",")
    result: dict[str, Any] = {"model": args.model, "dtype": args.dtype, "threads": args.threads}
    timers = {"ours": _ours, "transformers": _transformers, "vllm": _vllm}
    for peer in peers:
        times = timers[peer](args, prompts, batches)
        result[peer] = _rates(times, prompts, batches, args.decode_tokens)
    if "ours" in result:
        for peer in peers:
            if peer != "ours":
                result[f"ours_over_{peer}"] = {
                    k: result["ours"][k] / result[peer][k]
                    for k in result["ours"]
                    if result[peer].get(k)
                }
    result["conditions"] = {
        "torch": torch.__version__,
        "repeats": args.repeats,
        "decode_tokens": args.decode_tokens,
    }
    return result


def _jobs(
    prompts: dict[str, Any], batches: list[int], n: int
) -> list[tuple[str, list[list[int]], int]]:
    """(name, prompts, max_tokens) of every timed run, the same for every engine."""
    jobs = [("prefill", [prompts["prefill"]], 1)]
    for b in batches:
        jobs += [(f"b{b}_t1", prompts["chats"][:b], 1), (f"b{b}_t{n}", prompts["chats"][:b], n)]
    return jobs


def _ours(
    args: argparse.Namespace, prompts: dict[str, Any], batches: list[int]
) -> dict[str, float]:
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        num_threads=args.threads,
        num_blocks=2048,
        max_num_seqs=max(batches),
    )
    engine = Engine(config)
    engine.generate([prompts["chats"][0]], SamplingParams(max_tokens=4))  # warm up
    times = {}
    for name, batch, n in _jobs(prompts, batches, args.decode_tokens):
        runs = []
        for _ in range(args.repeats):
            engine.reset_prefix_cache()
            start = time.perf_counter()
            engine.generate(batch, SamplingParams(max_tokens=n, ignore_eos=True))
            runs.append(time.perf_counter() - start)
        times[name] = statistics.median(runs)
    return times


def _transformers(
    args: argparse.Namespace, prompts: dict[str, Any], batches: list[int]
) -> dict[str, float]:
    peer = TransformersPeer(checkpoint_for(args.model), getattr(torch, args.dtype))
    peer.generate([prompts["chats"][0]], 4)  # warm up
    return {
        name: statistics.median(peer.generate(batch, n) for _ in range(args.repeats))
        for name, batch, n in _jobs(prompts, batches, args.decode_tokens)
    }


def _vllm(
    args: argparse.Namespace, prompts: dict[str, Any], batches: list[int]
) -> dict[str, float]:
    checkpoint = checkpoint_for(args.model)
    folder = ensure_hf_folder(checkpoint, Path("results") / f"{args.model}-hf")
    jobs = [
        {
            "kind": "generate",
            "name": name,
            "prompts": batch,
            "max_tokens": n,
            "repeats": args.repeats,
        }
        for name, batch, n in _jobs(prompts, batches, args.decode_tokens)
    ]
    spec = {
        "model": str(folder),
        "dtype": args.dtype,
        "threads": args.threads,
        "max_model_len": 4096,
        "max_num_seqs": max(batches),
        "jobs": [
            {"kind": "generate", "name": "warm", "prompts": [prompts["chats"][0]], "max_tokens": 4},
            *jobs,
        ],
    }
    out = run_vllm(ensure_vllm_venv(args.vllm_venv), spec)
    return {
        name: statistics.median(job["seconds"])
        for name, job in out["jobs"].items()
        if name != "warm"
    }


def _rates(
    times: dict[str, float], prompts: dict[str, Any], batches: list[int], n: int
) -> dict[str, float]:
    rates = {"prefill_tokens_per_s": len(prompts["prefill"]) / times["prefill"]}
    for b in batches:
        t1, tn = times[f"b{b}_t1"], times[f"b{b}_t{n}"]
        rates[f"decode_tokens_per_s_b{b}"] = b * (n - 1) / (tn - t1)
        rates[f"output_tokens_per_s_b{b}"] = b * n / tn
    return rates
