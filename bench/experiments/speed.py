"""``speed``: prefill and decode throughput of our engine next to its peers, alternated.

Same checkpoint, same token ids, same dtype and torch threads, one run. Prefill: one
``--prefill-tokens`` prompt, one token out (tokens/s = prompt tokens / seconds). Decode at
batch B: B chat prompts (the support system prompt and B distinct questions) submitted
together, N tokens each, timed inside that one run: decode tokens/s = the output tokens made
after every prompt had its first token, over the seconds after that moment (so the prefill
is left out, and no difference of two runs' times can make it negative); output tokens/s =
B x N / T_N. Every engine's prefix cache is emptied before every timed run.

Every engine stays loaded for the whole run (vLLM in its own process, answering one job at a
time), and each timed job runs on every engine in turn, the order reversed on every repeat
(A B B A ...), so a slow minute of this shared machine falls on all of them. Each cell
reports the median over repeats and the spread (min and max); a ratio between two engines
is taken repeat by repeat (each pair ran back to back) and reported the same way.

Peers: ``ours`` (the engine as deployed: ``deterministic: true``), ``ours-nondet``
(``deterministic: false``: what invariance costs), ``transformers``, ``vllm``, and
``rev:<git revision>`` (this project's engine as it was then, from a worktree of that
revision, in a process of its own). vLLM gets what its CPU documentation asks for
(``bench.peers.host``: TCMalloc and Intel OpenMP preloaded, ``--threads`` OpenMP threads
bound one per physical core); the result records what it was given and what its process
loaded (``peer_processes``), the commit measured and the host's CPU (``provenance``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from bench.assistant_prompts import (
    LONG_DOCUMENT,
    SUPPORT_QUESTIONS,
    SUPPORT_SYSTEM_PROMPT,
)
from bench.experiments.speed_peers import PEERS, Peer, Timing, VllmPeer, start_peer
from bench.peers.engines import DEFAULT_VLLM_VENV
from bench.peers.host import PRELOADS, provenance
from bench.report import spread
from bench.roofline import of_speed_run
from bench.workloads import TraceRequest
from replica.checkpoints import SMOLLM2, checkpoint_for
from replica.checkpoints.tokenizer import Tokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=SMOLLM2)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peers", default="ours,vllm", help=f"some of {','.join(PEERS)}")
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--decode-tokens", type=int, default=64, help="N: tokens per request")
    parser.add_argument("--repeats", type=int, default=4, help="per engine and job (ABBA)")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=512, help="our engines' step budget"
    )
    parser.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV)
    parser.add_argument(
        "--vllm-preload", default=",".join(PRELOADS), help="LD_PRELOAD of vLLM ('' for none)"
    )
    parser.add_argument(
        "--vllm-bind",
        default="cores",
        choices=["cores", "none"],
        help="vLLM's OpenMP threads bound one per core (its multiprocess executor), or not "
        "(its model in the worker's own process, unbound)",
    )


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
    measured = provenance()  # at the start: the tree as it was imported
    torch.set_num_threads(args.threads)
    checkpoint = checkpoint_for(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = workload(checkpoint.tokenizer(), args.prefill_tokens, batches)
    names = args.peers.split(",")
    peers = {name: start_peer(name, args, prompts, batches) for name in names}
    try:
        times = _alternate(peers, _jobs(prompts, batches, args.decode_tokens), args.repeats)
    finally:
        for peer in peers.values():
            peer.close()
    processes = {name: p.process for name, p in peers.items() if isinstance(p, VllmPeer)}
    rates = {name: _rates(times[name], prompts, batches, args.decode_tokens) for name in names}
    result: dict[str, Any] = {"model": args.model, "dtype": args.dtype, "threads": args.threads}
    for name in names:
        result[name] = {cell: spread(values) for cell, values in rates[name].items()}
    for name in names[1:]:
        result[f"{names[0]}_over_{name}"] = {
            cell: spread([a / b for a, b in zip(rates[names[0]][cell], values, strict=True)])
            for cell, values in rates[name].items()
        }
    result["conditions"] = {
        "torch": torch.__version__,
        "repeats": args.repeats,
        "prefill_tokens": len(prompts["prefill"]),
        "batches": batches,
        "decode_tokens": args.decode_tokens,
        "order": "ABBA: each job on every engine in turn, the order reversed every repeat",
    }
    if "ours" in names:
        chat = len(prompts["chats"][0]) + args.decode_tokens // 2  # batch 1's mean context
        prefill = len(prompts["prefill"])
        result["machine"] = of_speed_run(
            checkpoint.shape, args.dtype, args.threads, prefill, chat, result["ours"]
        )
    result["peer_processes"] = processes
    result["provenance"] = measured
    return result


def _jobs(
    prompts: dict[str, Any], batches: list[int], n: int
) -> list[tuple[str, list[list[int]], int]]:
    """(name, prompts, max_tokens) of every timed run, the same for every engine."""
    jobs = [("prefill", [prompts["prefill"]], 1)]
    return jobs + [(f"b{b}", prompts["chats"][:b], n) for b in batches]


def _alternate(
    peers: dict[str, Peer], jobs: list[tuple[str, list[list[int]], int]], repeats: int
) -> dict[str, dict[str, list[Timing]]]:
    """Timings of every job on every engine, repeat by repeat, in ABBA order."""
    times: dict[str, dict[str, list[Timing]]] = {name: {} for name in peers}
    order = list(peers)
    for job, batch, n in jobs:
        for rep in range(repeats):
            for name in order if rep % 2 == 0 else order[::-1]:
                times[name].setdefault(job, []).append(peers[name].time(batch, n))
    return times


def _rates(
    times: dict[str, list[Timing]], prompts: dict[str, Any], batches: list[int], n: int
) -> dict[str, list[float]]:
    """Each cell's rate per repeat."""
    prefill = len(prompts["prefill"])
    rates = {"prefill_tokens_per_s": [prefill / t.total_s for t in times["prefill"]]}
    for b in batches:
        runs = times[f"b{b}"]
        rates[f"decode_tokens_per_s_b{b}"] = [t.decode_rate(b * n) for t in runs]
        rates[f"output_tokens_per_s_b{b}"] = [b * n / t.total_s for t in runs]
    return rates
