"""``kv_shares``: one tenant's flood against another tenant's cached prefixes, on one engine,
with each tenant's share of the cached pool (``engine.tenant_kv_shares``) and without.

The trace (``--requests``, seeded): tenant ``light`` (``--light-fraction`` of the requests)
asks short questions under one of its ``--light-prompts`` system prompts, so after its
first requests everything but the question is cached; tenant ``flood`` sends the rest:
half of them reuse one of its ``--flood-prompts`` system prompts (hit, so protected in the
segmented LRU), half are one-off texts of the same length (nothing cached). The pool
(``--num-blocks``) holds less than both tenants' prompts, so something is evicted all the
time. Requests run closed-loop, ``--concurrency`` at a time, in the trace's order: both
modes see the same requests in the same order, and the hit rates depend on nothing else.
Modes ``shares`` and ``lru`` alternate ABBA over ``--repeats``, each on a fresh engine.

Reported per mode and tenant: hit rate (prompt tokens served from cache over prompt
tokens, requests after each prompt's first) next to its ceiling (every full block a
request shares with an earlier one of its system prompt served from cache), TTFT p50/p99,
and the blocks each tenant holds in the pool at the end; and the flood's output tokens/s
(what the light tenant's share costs it).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from bench.peers.host import provenance
from bench.workloads import TraceRequest, filler_text, system_prompt
from kvindex.measure import percentile
from replica.checkpoints import SMOLLM2, checkpoint_for
from replica.config import EngineConfig
from replica.engine.engine import Engine
from replica.messages import Owner
from replica.model.runner import ModelRunner
from replica.sampling.params import SamplingParams

MODES = {"shares": True, "lru": False}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=SMOLLM2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--light-fraction", type=float, default=0.25)
    parser.add_argument("--light-prompts", type=int, default=3)
    parser.add_argument("--flood-prompts", type=int, default=8)
    parser.add_argument("--prompt-chars", type=int, default=1500)
    parser.add_argument("--num-blocks", type=int, default=192)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=7)


def trace(args: argparse.Namespace) -> list[TraceRequest]:
    """The requests, in order (the module docstring); ``group`` names the tenant."""
    rng = random.Random(args.seed)
    light = [
        system_prompt(args.seed, f"light-{i}", args.prompt_chars) for i in range(args.light_prompts)
    ]
    flood = [
        system_prompt(args.seed, f"flood-{i}", args.prompt_chars) for i in range(args.flood_prompts)
    ]
    out = []
    for i in range(args.requests):
        question = filler_text(rng, rng.randint(40, 80)) + "?"
        if rng.random() < args.light_fraction:
            out.append(
                TraceRequest(f"light-{i}", 0, question, args.max_tokens, "light", rng.choice(light))
            )
        elif rng.random() < 0.5:
            out.append(
                TraceRequest(f"flood-{i}", 0, question, args.max_tokens, "flood", rng.choice(flood))
            )
        else:
            text = filler_text(rng, args.prompt_chars)
            out.append(TraceRequest(f"flood-{i}", 0, text, args.max_tokens, "flood"))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    base = EngineConfig(
        model=args.model, dtype=args.dtype, num_threads=args.threads, num_blocks=args.num_blocks
    )
    tokenizer = checkpoint_for(base.model).tokenizer()
    runner = ModelRunner(base)
    requests = [(r, r.token_ids(tokenizer)) for r in trace(args)]
    order = [
        m for i in range(args.repeats) for m in (list(MODES) if i % 2 == 0 else list(MODES)[::-1])
    ]
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for mode in order:
        config = base.model_copy(update={"tenant_kv_shares": MODES[mode]})
        runs[mode].append(replay(Engine(config, runner=runner), requests, args.concurrency))
    return {
        "experiment": "kv_shares",
        "ceiling_hit_rate": ceiling(requests, base.block_size),
        "conditions": {k: v for k, v in vars(args).items() if k != "out"},
        "provenance": provenance(),
        "order": order,
        "summary": summarize(runs),
        "runs": runs,
    }


def ceiling(requests: list[tuple[TraceRequest, list[int]]], block_size: int) -> dict[str, float]:
    """Each tenant's best hit rate on the requests ``replay`` counts: every full block a
    request shares with the first one of its system prompt (never its last token)."""
    first: dict[str, list[int]] = {}
    tokens = {"light": [0, 0], "flood": [0, 0]}
    for r, ids in requests:
        if not r.system:
            continue
        if r.system not in first:
            first[r.system] = ids
            continue
        same = next(
            (i for i, (a, b) in enumerate(zip(ids, first[r.system], strict=False)) if a != b),
            len(ids),
        )
        tokens[r.group][0] += min(same, len(ids) - 1) // block_size * block_size
        tokens[r.group][1] += len(ids)
    return {tenant: cached / max(total, 1) for tenant, (cached, total) in tokens.items()}


def replay(
    engine: Engine, requests: list[tuple[TraceRequest, list[int]]], concurrency: int
) -> dict[str, Any]:
    """Closed loop, ``concurrency`` at a time, in order; per tenant: tokens and TTFTs of
    the requests after each prompt's first, and the flood's output rate."""
    engine.generate([[1] * 32], SamplingParams(max_tokens=2))  # warm up
    later, seen = set(), set()  # requests whose system prompt came before
    for r, _ in requests:
        if r.system in seen:
            later.add(r.request_id)
        seen.add(r.system or r.request_id)
    stats = {t: {"prompt": 0, "cached": 0, "ttft": []} for t in ("light", "flood")}
    tenant = {r.request_id: r.group for r, _ in requests}
    sent: dict[str, float] = {}
    pending, start, flood_tokens = list(reversed(requests)), time.monotonic(), 0
    while pending or engine.has_unfinished_requests():
        while pending and len(sent) < concurrency:
            r, ids = pending.pop()
            params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)
            engine.add_request(r.request_id, ids, params, owner=Owner(r.group))
            sent[r.request_id] = time.monotonic()
        for out in engine.step():
            rid, t = out.request_id, stats[tenant[out.request_id]]
            if out.token_ids and len(out.token_ids) == len(out.new_token_ids) and rid in later:
                t["ttft"].append(time.monotonic() - sent[rid])
            if out.finished:
                sent.pop(rid)
                flood_tokens += len(out.token_ids) if tenant[rid] == "flood" else 0
                if rid in later:
                    t["prompt"] += out.num_prompt_tokens
                    t["cached"] += out.num_cached_tokens
    engine.check_invariants(idle=True)
    cached = engine.block_manager.allocator.cached
    held = cached.held_by() if cached.by_tenant else None  # without shares: no owners
    return {
        **{f"{name}_hit_rate": s["cached"] / max(s["prompt"], 1) for name, s in stats.items()},
        **{f"{name}_ttft_s": s["ttft"] for name, s in stats.items()},
        "held_blocks": held,
        "flood_output_tokens_per_s": flood_tokens / (time.monotonic() - start),
    }


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians over the repeats, with min-max."""
    out: dict[str, Any] = {}
    for mode, mode_runs in runs.items():
        row: dict[str, Any] = {}
        for name in ("light", "flood"):
            row[f"{name}_hit_rate"] = _spread([r[f"{name}_hit_rate"] for r in mode_runs])
            for q in (50, 99):
                row[f"{name}_ttft_p{q}_s"] = _spread(
                    [percentile(r[f"{name}_ttft_s"], q) for r in mode_runs]
                )
            if mode_runs[0]["held_blocks"] is not None:
                held = [r["held_blocks"].get(name, 0) for r in mode_runs]
                row[f"{name}_held_blocks"] = _spread(held)
        row["flood_output_tokens_per_s"] = _spread(
            [r["flood_output_tokens_per_s"] for r in mode_runs]
        )
        out[mode] = row
    return out
