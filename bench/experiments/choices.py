"""``choices``: ``n`` samples of one prompt share its prefill. One 600-token chat prompt, run
with ``n = 1`` and ``n = N`` on fresh engines (cold cache) in ABBA order; per run, the
prompt tokens the engine computed before the first token of every choice, the time to that
point (TTFT as a streaming client of all choices sees it), and the whole request's time.
With ``--vllm``, the same prompt and ``n`` through vLLM's CPU build, same machine, same run.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from bench.assistant_prompts import LONG_DOCUMENT, SUPPORT_SYSTEM_PROMPT
from bench.peers.engines import (
    DEFAULT_VLLM_VENV,
    ensure_hf_folder,
    ensure_vllm_venv,
    run_vllm,
)
from kvindex.measure import percentile
from replica.checkpoints import SMOLLM2, checkpoint_for
from replica.config import EngineConfig
from replica.engine.engine import Engine
from replica.model.cpu import resolve_dtype
from replica.model.runner import ModelRunner
from replica.sampling.params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=SMOLLM2, help="EngineConfig.model")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2, help="torch threads (every engine)")
    parser.add_argument("--prompt-tokens", type=int, default=600)
    parser.add_argument("--n", type=int, default=8, help="choices, compared with n = 1")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per choice")
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=4, help="runs per n, ABBA order")
    parser.add_argument("--vllm", action="store_true", help="also run vLLM")
    parser.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV)


def chat_prompt(model: str, num_tokens: int) -> list[int]:
    """A chat prompt of exactly ``num_tokens`` tokens: the support system prompt and a
    document to summarise, cut to length."""
    tok = checkpoint_for(model).tokenizer()
    messages = [
        {"role": "system", "content": SUPPORT_SYSTEM_PROMPT},
        {"role": "user", "content": "Summarise this report:\n" + LONG_DOCUMENT * 4},
    ]
    ids = tok.encode_chat(tok.render_chat(messages))
    if len(ids) < num_tokens:
        raise ValueError(f"--prompt-tokens: at most {len(ids)}")
    return ids[:num_tokens]


def run(args: argparse.Namespace) -> dict[str, Any]:
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        num_threads=args.threads,
        num_blocks=1024,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    prompt = chat_prompt(config.model, args.prompt_tokens)
    runner = ModelRunner(config)
    Engine(config, runner=runner).generate([prompt], SamplingParams(max_tokens=4))  # warm-up
    runs: dict[int, list[dict[str, float]]] = {1: [], args.n: []}
    for rep in range(args.repeats):
        order = [1, args.n] if rep % 2 == 0 else [args.n, 1]
        for n in order:  # ABBA: drift over the run hits both alike
            runs[n].append(one_run(Engine(config, runner=runner), prompt, n, args, seed=rep))
    dtype = str(resolve_dtype(config.dtype)).removeprefix("torch.")
    result: dict[str, Any] = {"model": config.model_id, "dtype": dtype}
    result["ours"] = {f"n={n}": summarize(r) for n, r in runs.items()}
    one, many = result["ours"]["n=1"], result["ours"][f"n={args.n}"]
    result["ours"]["ttft_ratio"] = many["ttft_p50_s"] / one["ttft_p50_s"]
    result["ours"]["ttft_ratio_per_repeat"] = [
        b["ttft_s"] / a["ttft_s"] for a, b in zip(runs[1], runs[args.n], strict=True)
    ]
    if args.vllm:
        result["vllm"] = _vllm(args, dtype, config, prompt)
    result["conditions"] = {
        "prompt_tokens": len(prompt),
        "n": args.n,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "threads": args.threads,
    }
    return result


def one_run(
    engine: Engine, prompt: list[int], n: int, args: argparse.Namespace, seed: int
) -> dict[str, float]:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=seed, n=n)
    started = time.perf_counter()
    engine.add_request("bench", prompt, params)
    first: set[int] = set()
    ttft, prompt_computed = 0.0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids:
                first.add(out.index)
        if len(first) == n and not ttft:
            ttft = time.perf_counter() - started
            # every token run through the model so far was a prompt token: the choices'
            # first tokens come from the prompt's last position, run once
            prompt_computed = engine.stats(latencies=False).computed_tokens
    stats = engine.stats(latencies=False)
    engine.check_invariants()
    return {
        "ttft_s": ttft,
        "total_s": time.perf_counter() - started,
        "prompt_tokens_computed": prompt_computed,
        "computed_tokens": stats.computed_tokens,
        "output_tokens": stats.generation_tokens,
    }


def summarize(runs: list[dict[str, float]]) -> dict[str, Any]:
    ttft = [r["ttft_s"] for r in runs]
    return {
        "runs": len(runs),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_min_s": min(ttft),
        "ttft_max_s": max(ttft),
        "total_p50_s": percentile([r["total_s"] for r in runs], 50),
        "prompt_tokens_computed": runs[0]["prompt_tokens_computed"],
        "computed_tokens": runs[0]["computed_tokens"],
        "output_tokens": runs[0]["output_tokens"],
    }


def _vllm(args: argparse.Namespace, dtype: str, config: EngineConfig, prompt: list[int]) -> dict:
    folder = ensure_hf_folder(
        checkpoint_for(config.model), Path("results") / f"{config.model_id}-hf"
    )
    job = {
        "kind": "choices",
        "name": "choices",
        "prompt_token_ids": prompt,
        "n": [1, args.n],
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
    }
    spec = {
        "model": str(folder),
        "dtype": dtype,
        "threads": args.threads,
        "max_model_len": config.context_len,
        "jobs": [job],
    }
    out = run_vllm(ensure_vllm_venv(args.vllm_venv), spec)
    runs = out["jobs"]["choices"]
    result: dict[str, Any] = {"vllm_version": out["vllm"]}
    result["vllm_process"] = {"given": out["given"], **out["process"]}  # preloads, binding
    for n, ttft in runs["ttft_s"].items():
        result[f"n={n}"] = {
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_min_s": min(ttft),
            "ttft_max_s": max(ttft),
            "cached_prompt_tokens_seen": sorted(set(runs["cached"][n])),
        }
    result["ttft_ratio"] = result[f"n={args.n}"]["ttft_p50_s"] / result["n=1"]["ttft_p50_s"]
    return result
