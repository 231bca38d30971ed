"""``speculation --cluster``: the copy trace through ``make serve``'s cluster, drafts on and off.

One cluster (``deploy/config.yaml`` as it is, a private redis-server), one run: the same
requests go with ``"speculation": true`` and ``false`` in their bodies (the per-request
opt-out), ABBA over ``--repeats`` rounds, each round the eight copy prompts sent
``--concurrency`` at a time, streamed, greedy, EOS ending the reply. Reported per mode:
ITL p50 (the gaps between streamed chunks: with drafts a chunk may carry several tokens),
time per output token p50 (a request's seconds after its first chunk over its tokens after
the first) and e2e p50, over every request of the mode's rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from typing import Any

import httpx

from bench.copy_prompts import COPY_TASKS
from bench.harness.stacks import ours
from bench.loadgen import RequestResult, send
from bench.workloads import TraceRequest
from kvindex.measure import percentile


def run_cluster(args: argparse.Namespace) -> dict[str, Any]:
    """The cluster part of the experiment (module docstring)."""
    trace = [
        TraceRequest(f"copy-{i}", 0.0, user, args.max_tokens, "copy", system)
        for i, (system, user) in enumerate(COPY_TASKS)
    ]
    order = [
        m for i in range(args.repeats) for m in (("off", "on") if i % 2 == 0 else ("on", "off"))
    ]
    results: dict[str, list[RequestResult]] = {"off": [], "on": []}
    with ours("ours", cold=False) as stack:
        model = httpx.get(f"{stack.base_url}/v1/models").json()["data"][0]["id"]
        asyncio.run(_round(stack.base_url, model, trace, "off", args.concurrency))  # warm
        for mode in order:
            results[mode] += asyncio.run(
                _round(stack.base_url, model, trace, mode, args.concurrency)
            )
    return {"order": order, "summary": {m: _summary(r) for m, r in results.items()}}


async def _round(
    base_url: str, model: str, trace: list[TraceRequest], mode: str, concurrency: int
) -> list[RequestResult]:
    extra = {"ignore_eos": False, "speculation": mode == "on"}
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:

        async def one(req: TraceRequest) -> RequestResult:
            async with gate:
                return await send(client, model, req, extra=extra)

        return list(await asyncio.gather(*(one(r) for r in trace)))


def _summary(results: list[RequestResult]) -> dict[str, Any]:
    ok = [r for r in results if r.status == 200 and not r.error]
    per_token = [
        sum(r.itl_s) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1 and r.itl_s
    ]
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "itl_p50_s": percentile([g for r in ok for g in r.itl_s], 50),
        "time_per_output_token_p50_s": statistics.median(per_token) if per_token else None,
        "e2e_p50_s": percentile([r.latency_s for r in ok], 50),
        "ttft_p50_s": percentile([r.ttft_s for r in ok if r.ttft_s is not None], 50),
        "output_tokens": sum(r.completion_tokens for r in ok),
    }
