"""``moves``: replicas that leave or are too busy hand their streams on (``replica.moves``),
against today's drain, on the real cluster (SmolLM2, Redis, the ingress over HTTP).

Three scenarios, each run once with moves on and once off (``moves.enabled`` false: a
stopping replica finishes its streams, up to ``drain_timeout_s``), on a fresh cluster each:

* ``scale_in``: 3 replicas under the multi_turn trace at ``--rate``; at ``--event-at-s``
  (with the streams then in flight counted) the deployment is scaled to 1 replica; the load
  drops to ``--after-rate``. Measured: how long from the ``serve deploy`` until Serve runs
  one replica and nothing is stopping, failed requests, and the hit rate of the requests
  that arrived in the ``--window-s`` before the event and in the window after it ended.
* ``redeploy``: 2 replicas under the multi_tenant trace; at ``--event-at-s`` every engine
  replica is replaced (a new environment variable: Serve's rolling update). The same
  measures.
* ``balance``: the hot-tenant trace (8 tenants, Zipf 2.0) with long outputs on 2 replicas,
  live migration (``moves.balance``) on against off: TTFT and end-to-end p50/p99, hit rate,
  streams moved.

Every number names the host's CPU and the commit (``bench.peers.host``). JSON, and a Markdown
table per scenario (``bench.experiments.moves_report``).
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.experiments.moves_report import markdown, window_hit_rate
from bench.harness.launcher import ServeCluster
from bench.harness.redis_server import LocalRedis
from bench.harness.scenario import counts, phased_trace
from bench.harness.serve_state import moved_counts, replica_ids, wait_settled
from bench.loadgen import RequestResult, drive, warm_up
from bench.peers.host import provenance
from bench.workloads import TraceRequest, WorkloadSpec, make_trace
from cluster.config import ClusterArgs
from kvindex.config import IndexConfig
from kvindex.measure import percentile
from replica.checkpoints import SMOLLM2
from replica.config import EngineConfig
from replica.move_config import MoveConfig

SCENARIOS = ("scale_in", "redeploy", "balance")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--model", default=SMOLLM2)
    parser.add_argument("--rate", type=float, default=1.0, help="scale_in: arrivals/s before")
    parser.add_argument("--after-rate", type=float, default=0.2, help="scale_in: after it")
    parser.add_argument("--redeploy-rate", type=float, default=0.6)
    parser.add_argument("--event-at-s", type=float, default=60.0)
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--output-tokens", default="256,768", help="min,max per request")
    parser.add_argument("--balance-requests", type=int, default=120)
    parser.add_argument("--balance-rate", type=float, default=1.0)
    parser.add_argument("--balance-repeats", type=int, default=2, help="ABBA pairs")
    parser.add_argument("--seed", type=int, default=7)


def run(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {
        "experiment": "moves",
        "provenance": provenance(),
        "conditions": _args(args),
    }
    with LocalRedis() as redis_server:
        for scenario in args.scenarios.split(","):
            if scenario == "balance":
                result[scenario] = balance_pairs(args, redis_server.url)
                continue
            result[scenario] = {
                mode: SCENARIO_RUNS[scenario](args, redis_server.url, on)
                for mode, on in (("moves", True), ("drain", False))
            }
    out = args.out or Path("results/moves.json")
    if out.suffix == ".json":
        out.with_suffix(".md").write_text(markdown(result))
    return result


def _args(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k != "out"}


def cluster_args(
    args: argparse.Namespace, url: str, replicas: int, moves: MoveConfig, name: str
) -> ClusterArgs:
    return ClusterArgs(
        num_replicas=replicas,
        replica_num_cpus=0.5,
        max_ongoing_requests=32,
        engine=EngineConfig(model=args.model, num_threads=1, num_blocks=1024),
        index=IndexConfig(url=url, cluster=name),
        moves=moves,
        drain_timeout_s=300.0,
    )


def _trace(
    args: argparse.Namespace, workload: str, phases: list[tuple[float, float]], **spec: Any
) -> list[TraceRequest]:
    low, high = (int(x) for x in args.output_tokens.split(","))
    return phased_trace(workload, phases, args.seed, (low, high), **spec)


def scale_in(args: argparse.Namespace, url: str, on: bool) -> dict[str, Any]:
    rest = 2 * args.window_s
    phases = [(args.event_at_s, args.rate), (rest, args.after_rate)]
    trace = _trace(args, "multi_turn", phases, conversations=24)
    config = cluster_args(args, url, 3, MoveConfig(enabled=on), f"scale-in-{on}")
    return _with_event(config, trace, args, lambda c: c.scale(1), expect=1)


def redeploy(args: argparse.Namespace, url: str, on: bool) -> dict[str, Any]:
    phases = [(args.event_at_s + 3 * args.window_s, args.redeploy_rate)]  # the roll takes a while
    trace = _trace(args, "multi_tenant", phases, tenants=12, zipf=0.8)
    config = cluster_args(args, url, 2, MoveConfig(enabled=on), f"redeploy-{on}")

    def roll(cluster: ServeCluster) -> None:
        options = {
            "num_cpus": config.replica_num_cpus,
            "runtime_env": {"env_vars": {"PREFIX_SERVE_ENGINE_GENERATION": "1"}},
        }
        cluster._redeploy([{"name": "EngineReplica", "ray_actor_options": options}], 300)

    return _with_event(config, trace, args, roll, expect=2, replaced=True)


def _with_event(
    config: ClusterArgs,
    trace: list[TraceRequest],
    args: argparse.Namespace,
    event: Callable[[ServeCluster], None],
    expect: int,
    replaced: bool = False,
) -> dict[str, Any]:
    """Drive ``trace``; at ``event_at_s`` run ``event`` and time it until Serve runs
    ``expect`` replicas (all new ones when ``replaced``) and none is stopping."""
    with ServeCluster(config, dashboard=True) as cluster:
        warm_up(cluster.base_url, config.engine.model_id, config.num_replicas, 300)
        before = replica_ids(cluster)
        done = [0]
        results: list[list[RequestResult]] = []
        driver = threading.Thread(
            target=lambda: results.append(
                drive(cluster.base_url, config.engine.model_id, trace, 900, _counter(done))[0]
            )
        )
        start = time.monotonic()
        driver.start()
        time.sleep(max(0.0, start + args.event_at_s - time.monotonic()))
        in_flight = sum(r.arrival_s <= args.event_at_s for r in trace) - done[0]
        t0 = time.monotonic()
        event(cluster)
        deployed = time.monotonic() - t0
        ended = wait_settled(cluster, expect, before if replaced else set())
        seconds = ended - t0
        driver.join()
        moved = moved_counts(cluster)
        taken = [r.get("received_blocks", 0) for r in cluster.stats()["replicas"].values()]
    (res,) = results
    event_s, end_s = t0 - start, ended - start
    return {
        "requests": counts(res, len(trace)),
        "in_flight_at_event": in_flight,
        "event_s": seconds,
        "deploy_call_s": deployed,
        "hit_before": window_hit_rate(trace, res, event_s - args.window_s, event_s),
        "hit_after": window_hit_rate(trace, res, end_s, end_s + args.window_s),
        "moved": moved,
        "received_blocks": sum(taken),  # by the replicas left: moved streams' and prefixes'
    }


def _counter(done: list[int]) -> Callable[[int, int], None]:
    def on_done(n: int, _total: int) -> None:
        done[0] = n

    return on_done


def balance_pairs(args: argparse.Namespace, url: str) -> dict[str, Any]:
    """Live migration on and off, ABBA over ``--balance-repeats`` pairs: every run, the
    medians, and each pair's on / off ratio of the p99s."""
    order = [
        m
        for k in range(args.balance_repeats)
        for m in (("moves", "drain"), ("drain", "moves"))[k % 2]
    ]
    runs: dict[str, list[dict[str, Any]]] = {"moves": [], "drain": []}
    for k, mode in enumerate(order):
        runs[mode].append(balance(args, url, mode == "moves", k))
    keys = ("ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s", "hit_rate", "failed")
    result: dict[str, Any] = {"runs": runs}
    for mode, rows in runs.items():
        result[mode] = {key: percentile([r[key] for r in rows], 50) for key in keys}
        moved: dict[str, float] = {}
        for r in rows:
            for key, count in r["moved"].items():
                moved[key] = moved.get(key, 0.0) + count
        result[mode]["moved"] = moved
    result["ratios"] = {
        key: [on[key] / off[key] for on, off in zip(runs["moves"], runs["drain"], strict=True)]
        for key in ("ttft_p99_s", "e2e_p99_s")
    }
    return result


def balance(args: argparse.Namespace, url: str, on: bool, k: int = 0) -> dict[str, Any]:
    spec = WorkloadSpec(
        "multi_tenant",
        num_requests=args.balance_requests,
        rate=args.balance_rate,
        seed=args.seed,
        tenants=8,
        zipf=2.0,
        output_tokens=tuple(int(x) for x in args.output_tokens.split(",")),  # type: ignore[arg-type]
    )
    trace = make_trace(spec)
    config = cluster_args(args, url, 2, MoveConfig(balance=on), f"balance-{on}-{k}")
    with ServeCluster(config) as cluster:
        warm_up(cluster.base_url, config.engine.model_id, 2, 300)
        res, makespan = drive(cluster.base_url, config.engine.model_id, trace, 900)
        moved = moved_counts(cluster)
    ok = [r for r in res if r.status == 200 and r.error is None]
    prompt = sum(r.prompt_tokens for r in ok)
    e2e = [r.latency_s for r in ok if r.latency_s is not None]
    return {
        **counts(res, len(trace)),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p99_s": percentile(e2e, 99),
        "hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else None,
        "makespan_s": makespan,
        "moved": moved,
    }


SCENARIO_RUNS = {"scale_in": scale_in, "redeploy": redeploy, "balance": balance}
