"""``sessions``: agent sessions whose blocks outlive the tool call (issue 49).

On the real cluster (2 engine replicas of the model, Redis, the ingress, over HTTP), 16
agent sessions (``bench.tenant_workloads.agent_sessions``): each turn resends the whole session
so far plus a tool result, then waits 10-60 s for "the tool" before the next turn. Meanwhile
another tenant sends one-off prompts (nothing cached, ``--background`` requests/s) that
fill the pools (``--num-blocks`` per replica), so a session's blocks left unreferenced
during its tool call are evicted before its next turn, unless kept. Modes, one cluster
each, ABBA over ``--repeats``:

* ``none``: no retention, no node store: the pool's LRU alone (what an engine without a
  retention API does);
* ``retention``: every turn asks ``cache_retention: {ttl_s: --retention-s}`` under its
  ``x-session-id``, its last turn sends ``x-session-final: true``; no node store;
* ``store``: no retention, the node store on (the default cluster): evicted blocks are
  restored from shared memory instead.

Reported per mode: the sessions' later turns' hit rate (prompt tokens served from cache,
as each answer's usage says) and TTFT p50/p99, the first turns' TTFT, the one-off tenant's
TTFT (what holding blocks costs the others), and the blocks held for sessions (sampled
from ``/cluster/stats`` every 2 s: mean and max over both replicas) with the replicas'
retention counters.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from bench.experiments.sessions_report import markdown, summary
from bench.harness.launcher import ServeCluster
from bench.harness.rounds import abba, chosen_modes, redis_and_ray
from bench.loadgen import RequestResult, send
from bench.peers.host import provenance
from bench.tenant_workloads import AgentTurn, agent_sessions, tenant_trace
from bench.workloads import fast_engine
from cluster.config import ClusterArgs
from kvindex.config import IndexConfig

MODES = ("none", "retention", "store")
COUNTERS = (
    "retention_pinned",
    "retention_renewed",
    "retention_expired",
    "retention_released_for_room",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--tool-wait", default="10,60", help="seconds between turns: lo,hi")
    parser.add_argument("--num-blocks", type=int, default=512, help="KV blocks per replica")
    parser.add_argument("--pinned", type=float, default=0.6, help="engine.max_pinned_fraction")
    parser.add_argument("--background", type=float, default=0.8, help="one-off requests/s")
    parser.add_argument("--retention-s", type=float, default=90.0, help="ttl_s asked")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = args.out or Path("results/sessions")
    out.mkdir(parents=True, exist_ok=True)
    modes = chosen_modes(args.modes, MODES)
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    with redis_and_ray(out) as (url, ray):
        for rep in range(args.repeats):
            for mode in abba(modes, rep):
                print(f"sessions: {mode} (repeat {rep + 1})", flush=True)
                with ServeCluster(cluster_args(args, mode, url), ray=ray) as cluster:
                    runs[mode].append(asyncio.run(run_mode(args, mode, cluster)))
    payload = {
        "title": "Agent sessions: retention of a session's blocks across tool calls",
        "provenance": provenance(),
        "arguments": {k: str(v) for k, v in vars(args).items()},
        "runs": runs,
        "summary": summary(runs),
        "measured": time.strftime("%F"),
    }
    (out / "results.json").write_text(json.dumps(payload, indent=2) + "\n")
    (out / "results.md").write_text(markdown(payload))
    return payload


def cluster_args(args: argparse.Namespace, mode: str, url: str) -> ClusterArgs:
    engine = fast_engine(args.model, num_blocks=args.num_blocks, max_pinned_fraction=args.pinned)
    return ClusterArgs(
        num_replicas=2,
        engine=engine,
        max_ongoing_requests=8,
        store={"enabled": mode == "store"},
        sessions={"max_retention_s": max(args.retention_s, 1.0)},
        index=IndexConfig(url=url, cluster=f"sessions-{os.getpid()}-{time.monotonic_ns()}"),
    )


async def run_mode(args: argparse.Namespace, mode: str, cluster: ServeCluster) -> dict[str, Any]:
    """Every session to its last turn while the one-off tenant runs; then the metrics."""
    lo, hi = (float(x) for x in args.tool_wait.split(","))
    sessions = agent_sessions(args.sessions, args.turns, (lo, hi), args.seed, args.max_tokens)
    model = cluster.args.engine.model_id
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=300, limits=limits) as client:
        done = asyncio.Event()
        samples: list[dict[str, Any]] = []
        sampler = asyncio.create_task(_sample(client, samples, done))
        background = asyncio.create_task(_background(client, model, args, done))
        turns = await asyncio.gather(
            *(_session(client, model, i, s, mode, args) for i, s in enumerate(sessions))
        )
        done.set()
        others = await background
        await sampler
    return _metrics([r for session in turns for r in session], others, samples)


async def _session(
    client: httpx.AsyncClient,
    model: str,
    index: int,
    turns: list[AgentTurn],
    mode: str,
    args: argparse.Namespace,
) -> list[RequestResult]:
    results = []
    for t, turn in enumerate(turns):
        await asyncio.sleep(turn.wait_s)
        headers = {"x-session-id": f"agent-{index}"}
        extra: dict[str, object] = {}
        if mode == "retention":
            extra["cache_retention"] = {"ttl_s": args.retention_s}
            if t == len(turns) - 1:
                headers["x-session-final"] = "true"
        result = await send(client, model, turn.request, headers=headers, extra=extra)
        result.group = "first" if t == 0 else "later"
        results.append(result)
    return results


async def _background(
    client: httpx.AsyncClient, model: str, args: argparse.Namespace, done: asyncio.Event
) -> list[RequestResult]:
    """One-off prompts (nothing cached) at ``--background`` requests/s until ``done``."""
    trace = tenant_trace("one-off", args.background, 3600.0, args.seed, False, 8)
    start, sent = time.monotonic(), []
    for req in trace:
        wait = start + req.arrival_s - time.monotonic()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), max(wait, 0.0))
        if done.is_set():
            break
        sent.append(asyncio.create_task(send(client, model, req)))
    return list(await asyncio.gather(*sent))


async def _sample(
    client: httpx.AsyncClient, samples: list[dict[str, Any]], done: asyncio.Event
) -> None:
    """Every 2 s: the blocks each replica holds for sessions, and its retention counters;
    once more 3 s after ``done`` (the last turns' releases, pushed every second)."""
    while True:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            stats = (await client.get("/cluster/stats")).json()
            samples.append({rid: dict(r) for rid, r in stats.get("replicas", {}).items()})
        if done.is_set():
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), 2.0)
        if done.is_set():
            await asyncio.sleep(3.0)


def _metrics(
    turns: list[RequestResult], others: list[RequestResult], samples: list[dict[str, Any]]
) -> dict[str, Any]:
    later = [r for r in turns if r.group == "later"]
    ok = [r for r in later if r.status == 200 and r.error is None]
    pinned = [sum(r.get("blocks_pinned") or 0 for r in s.values()) for s in samples]
    last = samples[-1] if samples else {}
    return {
        "turns": len(turns),
        "failed": sum(1 for r in [*turns, *others] if r.status != 200 or r.error is not None),
        "later_hit_rate": sum(r.cached_tokens for r in ok)
        / max(sum(r.prompt_tokens for r in ok), 1),
        "later_ttft_s": _ttfts(later),
        "first_ttft_s": _ttfts([r for r in turns if r.group == "first"]),
        "others_ttft_s": _ttfts(others),
        "others_sent": len(others),
        "pinned_blocks_mean": statistics.mean(pinned) if pinned else 0.0,
        "pinned_blocks_max": max(pinned, default=0),
        "counters": {k: sum(r.get(k) or 0 for r in last.values()) for k in COUNTERS},
        "later_prompt_tokens_mean": statistics.mean([r.prompt_tokens for r in ok]) if ok else 0,
    }


def _ttfts(results: list[RequestResult]) -> list[float]:
    return sorted(r.ttft_s for r in results if r.ttft_s is not None and r.error is None)
