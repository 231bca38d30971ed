"""``stack``: the whole cluster next to the stack a user would pick instead, on one machine.

``ours`` is ``make serve``'s cluster (``deploy/config.yaml``: 2 engine replicas of
SmolLM2-135M-Instruct, bfloat16, prefix-aware routing over Redis) on a private Ray and a
private redis-server; ``ours-vllm`` is ``make serve-vllm``'s (``deploy/vllm.yaml``: the same
router and index over 2 vLLM CPU engines, in vLLM's virtualenv); ``ray-llm`` is Ray Serve
LLM with vLLM CPU engines, 2 replicas of one CPU each behind Ray's
``PrefixCacheAffinityRouter`` (``bench/peers/ray_serve_llm.py``, in vLLM's virtualenv, which
this command makes; ``ray-llm:<router>`` names another router); ``rev:<git rev>`` is this
project's cluster as it was at that revision (its own ``deploy/config.yaml``, from a
worktree).

Both are driven by vLLM's own load generator, ``vllm bench serve``, with shared-prefix chat
traffic (its ``prefix_repetition`` dataset: ``--prefixes`` prompts of ``--prefix-len``
tokens, each request one of them and a ``--suffix-len`` unique part, ``--output-len``
tokens out, EOS ignored, greedy), Poisson arrivals at ``--rate`` with at most
``--concurrency`` in flight. Each round starts its stack, runs the trace once on empty
caches, reads the prompt tokens served from cache (our ingress's ``/metrics``; vLLM's
prefix-cache counters through Ray's metrics agent) and the memory of every engine replica,
and stops the stack. Rounds alternate the stacks, the order reversed every repeat (A B B A);
each stack's first start is cold (no compiled kernels, no compile cache), later ones warm.

vLLM's engines get what its CPU documentation asks for (TCMalloc and Intel OpenMP preloaded,
``--vllm-preload``; each replica's OpenMP threads on a physical core of its own), recorded in
each round's ``peer_given``; what a stack left in ``/dev/shm`` once stopped is removed and
counted (``shm_removed``). The result records the commit measured, whether the tree had
uncommitted changes, and the host's CPU (``provenance``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any

from bench.harness.launcher import REPO
from bench.harness.memory import replica_memory
from bench.harness.stacks import Running, ours
from bench.peers.engines import DEFAULT_VLLM_VENV, ensure_hf_folder, ensure_vllm_venv
from bench.peers.host import PRELOADS, provenance
from bench.peers.ray_llm_stack import ray_llm
from bench.report import spread
from replica.checkpoints import SMOLLM2, checkpoint_for

PEERS = Path(__file__).resolve().parents[1] / "peers"
METRICS = ("request_throughput", "output_throughput", "completed")
LATENCIES = ("ttft", "itl", "e2el")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--stacks",
        default="ours,ray-llm",
        help="ours, ours-vllm (make serve-vllm's cluster: our router over vLLM engines), "
        "ray-llm (Ray's prefix router), ray-llm:<prefix|kv|ours|pow2> (Ray Serve LLM with "
        "that router: kv is Ray's KVAwareRouter, ours cluster.ray_llm's), rev:<git rev>",
    )
    parser.add_argument("--repeats", type=int, default=2, help="rounds per stack (ABBA)")
    parser.add_argument("--prompts", type=int, default=120)
    parser.add_argument("--prefixes", type=int, default=6)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rate", type=float, default=4.0, help="requests/s (Poisson)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV)
    parser.add_argument(
        "--vllm-preload", default=",".join(PRELOADS), help="LD_PRELOAD of vLLM ('' for none)"
    )
    parser.add_argument("--work-dir", type=Path, default=REPO / "results" / "stack")


def run(args: argparse.Namespace) -> dict[str, Any]:
    measured = provenance()  # at the start: the tree as it was imported
    python = ensure_vllm_venv(args.vllm_venv, stack=True)
    hf = ensure_hf_folder(checkpoint_for(SMOLLM2), REPO / "results" / f"{SMOLLM2}-hf")
    names = args.stacks.split(",")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for rep in range(args.repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            cold = not rounds[name]
            with _start(name, args, python, hf, cold) as stack:
                row = _round(stack, args, python, hf, name, rep, cold)
            rounds[name].append(row | stack.stopped)  # what stopping it left, removed
    result: dict[str, Any] = {"trace": _trace_flags(args), "rounds": rounds}
    result["provenance"] = measured
    for name in names:
        result[name] = _summarise(rounds[name])
    for name in names[1:]:
        result[f"{names[0]}_over_{name}"] = _ratios(rounds[names[0]], rounds[name])
    return result


def _round(
    stack: Running,
    args: argparse.Namespace,
    python: Path,
    hf: Path,
    name: str,
    rep: int,
    cold: bool,
) -> dict[str, Any]:
    before = stack.cache_counters()
    out = args.work_dir / f"{name.replace(':', '-')}-{rep}.json"
    bench = _bench_serve(python, hf, stack.base_url, args, out)
    after = stack.cache_counters()
    prompt, cached = (a - b for a, b in zip(after, before, strict=True))
    row = {key: bench[key] for key in METRICS}
    for what in LATENCIES:
        for q in ("p50", "p99"):
            row[f"{what}_{q}_ms"] = bench[f"{q}_{what}_ms"]
    row["failed"] = bench.get("failed", args.prompts - bench["completed"])
    row["prompt_tokens"], row["cached_prompt_tokens"] = prompt, cached
    row["cached_fraction"] = cached / prompt if prompt else None
    row["startup_s"], row["cold"] = stack.startup_s, cold
    row["replicas"] = replica_memory(stack.replica_title)
    return row | stack.notes


def _trace_flags(args: argparse.Namespace) -> list[str]:
    """vLLM ``bench serve``'s flags for the trace (the same for every stack)."""
    return [
        "--backend=openai-chat",
        "--endpoint=/v1/chat/completions",
        f"--model={SMOLLM2}",
        "--dataset-name=prefix_repetition",
        f"--prefix-repetition-num-prefixes={args.prefixes}",
        f"--prefix-repetition-prefix-len={args.prefix_len}",
        f"--prefix-repetition-suffix-len={args.suffix_len}",
        f"--prefix-repetition-output-len={args.output_len}",
        f"--num-prompts={args.prompts}",
        f"--request-rate={args.rate}",
        f"--max-concurrency={args.concurrency}",
        f"--seed={args.seed}",
        "--ignore-eos",
        "--temperature=0",
        "--percentile-metrics=ttft,tpot,itl,e2el",
        "--metric-percentiles=50,99",
    ]


def _bench_serve(
    python: Path, hf: Path, base_url: str, args: argparse.Namespace, out: Path
) -> dict[str, Any]:
    command = [
        str(python),
        str(PEERS / "vllm_bench.py"),
        "bench",
        "serve",
        f"--base-url={base_url}",
        f"--tokenizer={hf}",
        *_trace_flags(args),
        "--save-result",
        f"--result-dir={out.parent}",
        f"--result-filename={out.name}",
    ]
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        done = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed; see {log}")
    return json.loads(out.read_text())


def _start(name: str, args: argparse.Namespace, python: Path, hf: Path, cold: bool) -> Any:
    if name == "ray-llm" or name.startswith("ray-llm:"):  # ray-llm:<router>
        preload = [lib for lib in args.vllm_preload.split(",") if lib]
        router = name.partition(":")[2] or "prefix"
        return ray_llm(python, hf, args.work_dir, cold, preload, router)
    if name == "ours" or name.startswith("rev:"):
        return ours(name, cold)
    if name == "ours-vllm":
        return ours(name, cold, vllm=(python, hf))
    raise SystemExit(f"unknown stack {name!r}: ours, ours-vllm, ray-llm[:router] or rev:<git rev>")


def _summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median, min and max of every number over the rounds; startup cold and warm apart."""
    keys = [k for k, v in rows[0].items() if isinstance(v, int | float) and k != "cold"]
    out = {k: spread([r[k] for r in rows if r[k] is not None]) for k in keys}
    out.pop("startup_s", None)
    out["startup_cold_s"] = [r["startup_s"] for r in rows if r["cold"]]
    out["startup_warm_s"] = [r["startup_s"] for r in rows if not r["cold"]]
    out["replica_rss_mib"] = spread([m["rss_mib"] for r in rows for m in r["replicas"]])
    out["replica_pss_mib"] = spread([m["pss_mib"] for r in rows for m in r["replicas"]])
    return out


def _ratios(ours: list[dict[str, Any]], peer: list[dict[str, Any]]) -> dict[str, Any]:
    """Round by round (the pairs that ran back to back): ours over the peer's."""
    keys = ["request_throughput", "output_throughput"] + [
        f"{w}_{q}_ms" for w in LATENCIES for q in ("p50", "p99")
    ]
    return {k: spread([a[k] / b[k] for a, b in zip(ours, peer, strict=True)]) for k in keys}
