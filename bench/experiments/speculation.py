"""``speculation``: decode speed with prompt-lookup drafts on and off, one engine, same prompts
(and vLLM CPU with its own ``ngram`` drafts beside it, with ``--vllm``).

Two traces of eight prompts, both from the project's prompt sets (``bench.assistant_prompts``
and ``bench.copy_prompts``): ``copy`` asks to repeat, correct, quote, extract from or edit a
given text (what agents, editors and RAG answers do), ``chat`` asks the support questions and
general ones with little to copy. Each runs at every ``--batches`` size: batch 1 is each
prompt alone, batch B the prompts B at a time (above eight, the eight repeated to fill it).
Greedy, ``--max-tokens`` at most, EOS ends a reply (a reply's length is the model's, the
same with drafts or without, since the tokens are). Decode speed is measured inside each
run: output tokens after the moment every prompt of the batch had its first token, over the
seconds after that moment (prefill excluded).

Modes ``off`` and ``on`` (the engine's defaults) alternate ABBA over ``--repeats`` on fresh
engines sharing one model; every run's tokens are compared with the first ``off`` run's
(``identical``). Reported per trace and batch: tokens/s of each mode (median of runs), the
ratio on/off of each adjacent pair (median, min, max: the spread), and the drafts verified,
kept and steps saved. vLLM runs after ours in the same process tree, plain and with
``speculative_config={"method": "ngram", ...}`` at the same draft length and n-gram range.
``--parts cluster`` measures the whole cluster (``bench.experiments.speculation_cluster``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from bench.copy_prompts import chat_trace, copy_trace
from bench.experiments.speculation_cluster import run_cluster
from bench.peers.engines import ensure_hf_folder, ensure_vllm_venv, vllm_session
from bench.peers.host import provenance, vllm_env
from replica.checkpoints import SMOLLM2, checkpoint_for
from replica.config import EngineConfig, SpeculationOptions
from replica.engine.engine import Engine
from replica.model.runner import ModelRunner
from replica.sampling.params import SamplingParams

MODES = ("off", "on")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=SMOLLM2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--traces", default="copy,chat")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=2, help="ABBA pairs per trace and batch")
    parser.add_argument("--max-draft-tokens", type=int, default=4)
    parser.add_argument("--vllm", action="store_true", help="vLLM CPU plain and with ngram")
    parser.add_argument("--vllm-venv", type=Path, default=Path(".venv-vllm"))
    parser.add_argument(
        "--parts", default="engine", help="engine (one engine, and vLLM), cluster (make serve's)"
    )
    parser.add_argument("--concurrency", type=int, default=4, help="cluster: requests at once")


def run(args: argparse.Namespace) -> dict[str, Any]:
    parts = args.parts.split(",")
    result: dict[str, Any] = {
        "experiment": "speculation",
        "conditions": {k: str(v) for k, v in vars(args).items() if k != "out"},
        "provenance": provenance(),
    }
    if "engine" in parts:
        result |= run_engine(args)
    if "cluster" in parts:
        result["cluster"] = run_cluster(args)
    return result


def run_engine(args: argparse.Namespace) -> dict[str, Any]:
    base = EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads)
    tokenizer = checkpoint_for(base.model).tokenizer()
    traces = {"copy": copy_trace(tokenizer), "chat": chat_trace(tokenizer)}
    traces = {name: traces[name] for name in args.traces.split(",")}
    batches = [int(b) for b in args.batches.split(",")]
    runner = ModelRunner(base)
    on = SpeculationOptions(max_draft_tokens=args.max_draft_tokens)
    configs = {
        "off": base.model_copy(update={"speculation": SpeculationOptions(enabled=False)}),
        "on": base.model_copy(update={"speculation": on}),
    }
    Engine(configs["off"], runner).generate([[1] * 64], SamplingParams(max_tokens=4))  # warm
    results: dict[str, Any] = {}
    for name, prompts in traces.items():
        for batch in batches:
            results[f"{name}/b{batch}"] = measure(runner, configs, prompts, batch, args)
    vllm = run_vllm(args, traces, batches) if args.vllm else None
    return {
        "summary": summarize(results, vllm),
        "runs": results,
        "vllm": vllm,
    }


def measure(
    runner: ModelRunner,
    configs: dict[str, EngineConfig],
    prompts: list[list[int]],
    batch: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """ABBA runs of one trace at one batch size (module docstring)."""
    order = [m for i in range(args.repeats) for m in (MODES if i % 2 == 0 else MODES[::-1])]
    params = SamplingParams(max_tokens=args.max_tokens)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    reference: list[list[int]] | None = None
    for mode in order:
        engine = Engine(configs[mode], runner)
        timed = [timed_batch(engine, part, params) for part in batches_of(prompts, batch)]
        tokens = [t for part in timed for t in part["tokens"]]
        reference = reference or (tokens if mode == "off" else None)
        stats = engine.stats(latencies=False)
        runs[mode].append(
            {
                "tokens_per_s": sum(p["decode_tokens"] for p in timed)
                / sum(p["decode_s"] for p in timed),
                "output_tokens": sum(len(t) for t in tokens),
                "identical": reference is None or tokens == reference,
                "draft_tokens": stats.draft_tokens,
                "accepted_draft_tokens": stats.accepted_draft_tokens,
                "draft_steps_saved": stats.draft_steps_saved,
                "steps": stats.steps,
            }
        )
    return {"order": order, **runs}


def batches_of(prompts: list[list[int]], batch: int) -> list[list[list[int]]]:
    """The trace in batches of ``batch``; a batch larger than the trace repeats its prompts
    in order to fill it (the copies decode the same tokens, each in its own sequence)."""
    if batch > len(prompts):
        return [[prompts[i % len(prompts)] for i in range(batch)]]
    return [prompts[i : i + batch] for i in range(0, len(prompts), batch)]


def timed_batch(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
    """Run ``prompts`` together; the output tokens and seconds after every prompt had its
    first token (decode only), and each prompt's tokens."""
    ids = [f"p{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    start, first_at, at_first = time.perf_counter(), None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        if first_at is None and all(tokens.values()):
            first_at, at_first = time.perf_counter(), sum(len(t) for t in tokens.values())
    end = time.perf_counter()
    assert first_at is not None
    total = sum(len(t) for t in tokens.values())
    return {
        "tokens": [tokens[rid] for rid in ids],
        "decode_tokens": total - at_first,
        "decode_s": max(end - first_at, 1e-9) if total > at_first else 0.0,
        "prefill_s": first_at - start,
    }


def run_vllm(
    args: argparse.Namespace, traces: dict[str, list[list[int]]], batches: list[int]
) -> dict[str, Any]:
    """vLLM CPU on the same prompts and batches, plain and with its ``ngram`` drafts (one
    process each, one after the other); a mode it cannot start is reported as its error."""
    folder = ensure_hf_folder(checkpoint_for(args.model), Path("results") / f"{args.model}-hf")
    python = ensure_vllm_venv(args.vllm_venv)
    ngram = {
        "method": "ngram",
        "num_speculative_tokens": args.max_draft_tokens,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    }
    out: dict[str, Any] = {}
    for mode, speculative in (("plain", None), ("ngram", ngram)):
        spec = {
            "model": str(folder),
            "dtype": args.dtype if args.dtype != "auto" else "bfloat16",
            "threads": args.threads,
            "max_model_len": 4096,
            "max_num_seqs": max(batches),
            "speculative_config": speculative,
        }
        given = vllm_env(python, args.threads, kv_cache_gib=2)
        try:
            session = vllm_session(python, spec, Path("results") / "speculation-vllm.log", given)
        except RuntimeError as exc:
            out[mode] = {"error": str(exc)[-500:]}
            continue
        try:
            out[mode] = {
                f"{name}/b{b}": vllm_rate(session, prompts, b, args.max_tokens)
                for name, prompts in traces.items()
                for b in batches
            }
        finally:
            session.close()
    return out


def vllm_rate(session: Any, prompts: list[list[int]], batch: int, max_tokens: int) -> float:
    """vLLM's decode tokens/s over the trace at ``batch`` (the worker's ``generate`` job,
    greedy, EOS ending a reply), measured as ours is."""
    tokens = seconds = 0.0
    for part in batches_of(prompts, batch):
        job = {
            "kind": "generate",
            "prompts": part,
            "max_tokens": max_tokens,
            "repeats": 1,
            "ignore_eos": False,
        }
        r = session.run(job)
        tokens += r["output_tokens"] - r["tokens_at_first"]
        seconds += r["seconds"][-1] - r["first_s"]
    return tokens / seconds


def summarize(results: dict[str, Any], vllm: dict[str, Any] | None) -> dict[str, Any]:
    """Per trace and batch: each mode's median tokens/s, the on/off ratio of each ABBA pair
    (median, min, max), the drafts' acceptance, whether every run gave the same tokens."""
    out = {}
    for key, runs in results.items():
        off = [r["tokens_per_s"] for r in runs["off"]]
        on = [r["tokens_per_s"] for r in runs["on"]]
        ratios = [b / a for a, b in zip(off, on, strict=True)]
        last = runs["on"][-1]
        row = {
            "off_tokens_per_s": statistics.median(off),
            "on_tokens_per_s": statistics.median(on),
            "speedup": statistics.median(ratios),
            "speedup_min": min(ratios),
            "speedup_max": max(ratios),
            "acceptance": last["accepted_draft_tokens"] / max(last["draft_tokens"], 1),
            "tokens_per_step_saved": last["draft_steps_saved"] / max(last["output_tokens"], 1),
            "identical": all(r["identical"] for m in MODES for r in runs[m]),
        }
        for mode in ("plain", "ngram"):
            rate = (vllm or {}).get(mode, {}).get(key)
            if isinstance(rate, float):
                row[f"vllm_{mode}_tokens_per_s"] = rate
        out[key] = row
    return out
