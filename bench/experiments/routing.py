"""``routing``: policies compared on the real cluster, one trace, one cluster per policy.

For each arrival rate and policy: start ``serve run`` (Ray Serve, engine replicas, the Redis
index) with that policy in the experiment's own private Ray, warm it up, replay the trace
over HTTP as an outside client (streaming), read the engines' own counters from the index,
stop the cluster (its application; the Ray goes when the experiment ends). Writes
``results.json``, ``results.md`` and PNG plots to ``--out``. The node store is on, as by
default; a policy named with ``+nostore`` (``prefill_cost+nostore``) runs without it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from bench.experiments.routing_args import (
    add_workload_arguments,
    check_variants,
    experiment_engine,
    our_routing,
    run_knobs,
    section_name,
    split_mirror,
    split_pull,
    split_store,
    traces,
)
from bench.experiments.routing_ray_llm import (
    check_ray_llm_policies,
    is_ray_llm,
    run_ray_llm_policy,
)
from bench.harness.launcher import ServeCluster, cluster_env
from bench.harness.private_ray import PrivateRay
from bench.harness.redis_server import LocalRedis
from bench.loadgen import drive, progress_printer, warm_up
from bench.peers.host import provenance
from bench.report import combine, slug, summarize, write_report
from bench.workloads import TraceRequest, oracle_hit_rate, save_trace
from cluster.config import ClusterArgs
from kvindex.config import IndexConfig
from kvindex.reader import IndexReader
from replica.checkpoints import checkpoint_for
from replica.config import EngineConfig
from replica.pull_config import PullConfig
from replica.store.config import StoreConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    parser.add_argument("--redis-url", help="use this Redis (default: start a local one)")
    parser.add_argument("--ingress-replicas", type=int, default=1)
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs per policy, in ABBA order (spread reported)"
    )
    parser.add_argument("--knobs", help="RoutingConfig overrides, JSON")
    parser.add_argument("--index", help='IndexConfig overrides, JSON, e.g. {"mirror": false}')


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = args.out or Path(f"results/routing-{args.workload}")
    policies = [p for p in args.policies.split(",") if p]
    check_ray_llm_policies(args, policies)
    check_variants(args, policies, peer=is_ray_llm)
    engine = experiment_engine(args)
    python = args.vllm_python.absolute() if engine.backend == "vllm" else None
    hasher, tokenizer = engine.block_hasher(), checkpoint_for(engine.model).tokenizer()
    payload: dict[str, Any] = {
        "provenance": provenance(),  # the commit and CPU, read before the runs
        "title": f"Routing policies on the real cluster: {args.workload}, {args.replicas} replicas",
        "workload": vars(args) | {"out": str(out), "trace": str(args.trace)},
        "runs": {},
        "oracle": {},
    }
    with contextlib.ExitStack() as stack:
        url = args.redis_url or stack.enter_context(LocalRedis()).url
        # one private Ray for every run: each run's ``serve run`` deploys into it and shuts
        # its application down (Serve's replicas, the index's namespace, the node stores are
        # the run's own), and ~7 s of ``ray start`` and stop per run are saved
        ray = PrivateRay(out / "ray.log", dashboard=False)
        out.mkdir(parents=True, exist_ok=True)
        stack.callback(ray.stop)
        ray.start(cluster_env(), python)
        for rate, trace in traces(args).items():
            section = section_name(rate)
            save_trace(out / f"trace-{slug(section)}.jsonl", trace)
            oracle = oracle_hit_rate(trace, hasher, tokenizer)
            payload["oracle"][section] = oracle
            runs: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
            for rep in range(args.repeats):  # ABBA: drift over the session hits all alike
                for policy in policies if rep % 2 == 0 else policies[::-1]:
                    label = f"{section} {policy} ({rep + 1}/{args.repeats})"
                    if is_ray_llm(policy):  # Ray Serve LLM's own app, its own Ray
                        peer_dir = out / "ray-llm" / slug(policy)
                        result = run_ray_llm_policy(args, policy, trace, engine, label, peer_dir)
                    else:
                        result = run_policy(args, policy, trace, url, engine, label, ray)
                    runs[policy].append(result)
            payload["runs"][section] = {
                p: combine(r) | {"oracle_hit_rate": oracle} for p, r in runs.items()
            }
    payload["conditions"] = (
        f"{args.replicas} {engine.backend} engine replicas x {args.num_blocks} blocks of "
        f"{engine.block_size} "
        f"tokens; {args.ingress_replicas} ingress replica(s); {args.requests} requests; seed "
        f"{args.seed}; {args.repeats} run(s) per policy (median, min-max); measured "
        f"{time.strftime('%F')}"
    )
    payload["sweeps"] = [s for s in (_rate_sweep(payload),) if s is not None]
    return write_report(out, payload)


def run_policy(
    args: argparse.Namespace,
    policy: str,
    trace: list[TraceRequest],
    redis_url: str,
    engine: EngineConfig,
    label: str,
    ray: PrivateRay | None = None,
) -> dict[str, Any]:
    namespace = f"exp-{os.getpid()}-{time.monotonic_ns()}"
    cluster_args, pull, store = _cluster_args(args, policy, redis_url, engine, namespace)
    name = policy.partition("@")[0].partition("+")[0]
    python = args.vllm_python.absolute() if engine.backend == "vllm" else None
    cluster = ServeCluster(cluster_args, ray=ray, python=python)
    try:
        cluster.start()
    except Exception as exc:  # a peer that cannot run is reported, not dropped
        return {"error": f"cluster did not start ({type(exc).__name__}: {exc})"}
    metrics: dict[str, Any] = {"error": "the run did not finish"}
    try:
        replicas = int(args.replicas)
        warm_up(cluster.base_url, engine.model_id, replicas, timeout_s=60)
        index = IndexReader(cluster_args.index, engine.model_id)
        before = _fresh_stats(index, replicas)
        results, makespan = drive(
            cluster.base_url, engine.model_id, trace, 120.0, progress_printer(label)
        )
        after = _fresh_stats(index, replicas, newer_than=time.time())
        metrics = summarize(results, makespan, sorted(after))

        def delta(key: str) -> int:  # what the engines counted during the run
            return sum(after[r][key] - before.get(r, {}).get(key, 0) for r in after)

        prompt, cached = delta("prompt_tokens"), delta("cached_prompt_tokens")
        metrics["hit_rate_engine"] = cached / prompt if prompt else 0.0
        keys = PULL_KEYS if pull is not None else ()  # a pulled block is a hit there
        keys += STORE_KEYS if store.enabled else ()  # and so is a restored one
        metrics |= {key: delta(key) for key in keys}
        if name != "ray_prefix":  # Ray's prefix router is not timed
            metrics |= _router_metrics(cluster.stats())
        if metrics["requests_ok"] == 0:
            metrics["error"] = f"no request succeeded: {metrics['errors']}"
        return metrics
    finally:
        cluster.stop(keep_logs="error" in metrics)


def _cluster_args(
    args: argparse.Namespace, policy: str, redis_url: str, engine: EngineConfig, namespace: str
) -> tuple[ClusterArgs, PullConfig | None, StoreConfig]:
    """The run's cluster: ``policy`` with its ``+mirror`` / ``+nostore`` / ``+pull`` and
    its ``@variant``'s knobs."""
    name, knobs = run_knobs(args, policy)
    name, mirror = split_mirror(name)
    name, store = split_store(name)
    name, pull = split_pull(name, args.pull)
    if engine.backend == "vllm":  # vLLM's blocks stay in vLLM
        if pull is not None:
            raise ValueError(f"{policy}: pulls move the native engine's blocks only")
        store = StoreConfig(enabled=False)
    cluster_args = ClusterArgs(
        num_replicas=int(args.replicas),
        ingress_replicas=args.ingress_replicas,
        engine=engine,
        max_queued_requests=-1,  # an experiment measures queueing; it does not shed
        routing=our_routing(name, args.epsilon, knobs),
        index=_index_config(args, redis_url, namespace, mirror),
        pull=pull or PullConfig(),
        store=store,
    )
    return cluster_args, pull, store


PULL_KEYS = (
    "pulls",
    "pulled_blocks",
    "pulls_failed",
    "pull_blocks_refused",
    "pull_lookups_failed",
)
STORE_KEYS = ("store_spilled_blocks", "store_restored_blocks", "store_restore_rejected")


def _router_metrics(stats: dict[str, Any]) -> dict[str, Any]:
    """Decision times, and the decisions made without the index (routed blind), that the
    mirror could not answer or that raised, from the ingress's ``/cluster/stats``."""
    counters = stats.get("index") or {}
    mirror = stats.get("mirror") or {}
    return {
        "decision_p50_ms": (stats["decision_p50_s"] or 0) * 1e3,
        "decision_p99_ms": (stats["decision_p99_s"] or 0) * 1e3,
        "index_unknown": counters.get("query_failures", 0) + counters.get("queries_skipped", 0),
        "mirror_unknown": mirror.get("unknown_answers"),
        "mirror_events": mirror.get("events"),  # the log's events its follower applied
        "routing_errors": stats.get("routing_errors", 0),  # decisions that raised
    }


def _index_config(
    args: argparse.Namespace, url: str, namespace: str, mirror: bool | None = None
) -> IndexConfig:
    """The run's own namespace on the experiment's Redis, with ``--index`` overrides (and
    the policy's ``+mirror`` or ``+nomirror`` over those)."""
    overrides = json.loads(args.index) if args.index else {}
    if mirror is not None:
        overrides["mirror"] = mirror
    return IndexConfig(url=url, cluster=namespace, **overrides)


def _fresh_stats(
    index: IndexReader, replicas: int, newer_than: float = 0.0, timeout_s: float = 15.0
) -> dict[str, dict[str, Any]]:
    """Every replica's counters, reported after ``newer_than`` (a wall-clock time)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = index.replica_stats()
        fresh = {r: s for r, s in stats.items() if s.get("time", 0) >= newer_than}
        if len(fresh) >= replicas or time.monotonic() > deadline:
            return fresh
        time.sleep(0.2)


def _rate_sweep(payload: dict[str, Any]) -> dict[str, Any] | None:
    """TTFT p50 against arrival rate, when several rates were run."""
    sections = [s for s in payload["runs"] if s.startswith("rate ")]
    if len(sections) < 2:
        return None
    series: dict[str, list[tuple[float, float]]] = {}
    for section in sections:
        rate = float(section.split()[1].removesuffix("/s"))
        for policy, m in payload["runs"][section].items():
            if "error" not in m and m.get("ttft_p50_s") is not None:
                series.setdefault(policy, []).append((rate, m["ttft_p50_s"]))
    return {
        "series": series,
        "x": "arrival rate (requests/s)",
        "y": "TTFT p50 (s)",
        "title": "TTFT vs load",
        "file": "ttft_vs_rate.png",
    }
