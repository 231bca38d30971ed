"""``simulate``: the routing experiment on simulated replicas (``bench.sim.simulator``).

Same traces, policies and report as ``routing``; ``--replicas`` may list several counts
(a sweep of hit rate and load imbalance against cluster size). With ``--per-replica``, the
request count and arrival rates are per replica, so every cluster size sees the same load
per replica. ``--calibrate`` measures the real engine first and stores the cost model.
A policy named with ``+pull`` (``prefill_cost+pull``) runs with the replicas pulling
prefixes from each other (``kvindex.pulls``; ``--pull`` sets the pull section as JSON), priced
by our policies, ignored by the peers' (their replicas still pull: a pull is the replica's).
``--store-blocks N`` gives every ``--replicas-per-node`` replicas a node store of N blocks
(``kvindex.stored``): every policy's replicas restore from it; ours price it (a policy
named with ``+nostore`` runs without it, as on the real cluster).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.experiments.routing_args import (
    add_workload_arguments,
    check_variants,
    our_routing,
    run_knobs,
    section_name,
    split_mirror,
    split_pull,
    split_store,
    traces,
)
from bench.experiments.seeds import over_seeds, parse_seeds
from bench.report import summarize, write_report
from bench.sim.cost_model import DEFAULT_CALIBRATION, CostModel, calibrate
from bench.sim.pace import matched
from bench.sim.peer_policies import DynamoKV, RayPrefixSim, SGLangCacheAware
from bench.sim.simulator import Simulation
from bench.workloads import TraceRequest, fast_engine, oracle_hit_rate
from replica.checkpoints import checkpoint_for
from replica.checkpoints.tokenizer import Tokenizer
from replica.config import EngineConfig
from replica.pull_config import PullConfig
from replica.store.config import StoreConfig
from router.config import make_policy
from router.policies import RoutingPolicy

OURS = ("round_robin", "prefix_affinity", "cache_aware", "prefill_cost")
PEERS = ("ray_prefix_sim", "ray_prefix_sim_t10", "sglang_cache_aware", "dynamo_kv")
SIMULATED = OURS + PEERS


PEER_MODELS: dict[str, Callable[[], RoutingPolicy]] = {
    "ray_prefix_sim": RayPrefixSim,
    "ray_prefix_sim_t10": lambda: RayPrefixSim(imbalanced_threshold=10),
    "sglang_cache_aware": SGLangCacheAware,
    "dynamo_kv": DynamoKV,
}


def sim_policy(
    name: str,
    epsilon: float = 0.25,
    knobs: str | None = None,
    pull: PullConfig | None = None,
    store: StoreConfig | None = None,
) -> RoutingPolicy:
    """A policy by name: ours (``knobs``, JSON, overrides its routing section's fields;
    ``epsilon`` goes to the policies that have one; ``pull`` is priced by ``prefill_cost``)
    and the peers' models (Ray's with its old imbalance threshold of 10 as
    ``ray_prefix_sim_t10``)."""
    if name in PEER_MODELS:
        return PEER_MODELS[name]()
    fields = json.loads(knobs) if knobs else {}
    return make_policy(our_routing(name, epsilon, fields), pull, store)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    parser.set_defaults(policies=",".join(SIMULATED))
    parser.add_argument("--per-replica", action="store_true", help="requests and rates per replica")
    parser.add_argument("--calibrate", action="store_true", help="measure the engine first")
    parser.add_argument("--cost-model", type=Path, default=DEFAULT_CALIBRATION)
    parser.add_argument("--max-ongoing-requests", type=int, default=32)
    parser.add_argument(
        "--knobs", help='RoutingConfig overrides as JSON, e.g. {"decode_cost_tokens": 8}'
    )
    parser.add_argument(
        "--store-blocks", type=int, default=0, help="node store slots per node (0: no store)"
    )
    parser.add_argument("--replicas-per-node", type=int, default=8)
    parser.add_argument(
        "--speed-of",
        type=Path,
        help="a real routing run's results (folder or results.json) on this trace: scale the "
        "cost model to its ITL p50 (bench.sim.pace)",
    )
    parser.add_argument(
        "--seeds",
        help="run the traces of several seeds (1-8, or 1,3,5) and report each policy's "
        "median, spread and means over them (--seed is then ignored)",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = args.out or Path(f"results/simulate-{args.workload}")
    engine = fast_engine(args.model, num_blocks=args.num_blocks)
    if args.calibrate:
        cost = calibrate(engine)
        cost.save(args.cost_model)
    else:
        cost = CostModel.load(args.cost_model)
    counts = [int(r) for r in str(args.replicas).split(",")]
    policies = [p for p in args.policies.split(",") if p]
    check_variants(args, policies)
    seeds = parse_seeds(args.seeds) if args.seeds else [args.seed]
    if args.seeds and args.trace is not None:
        raise ValueError("--seeds generates a trace per seed; a --trace file has none")
    tokenizer = checkpoint_for(engine.model).tokenizer()
    speed = None
    if args.speed_of is not None:  # probe runs on the first count, until the ITLs match

        def probe(at: CostModel) -> dict[str, dict[str, Any]]:
            sections = _runs(args, counts[0], policies, engine, at, tokenizer)
            return next(iter(sections.values()))[1]

        cost, speed = matched(cost, args.speed_of, probe)
    payload: dict[str, Any] = {
        "title": f"Simulated cluster: {args.workload}",
        "workload": vars(args) | {"out": str(out)},
        "cost_model": cost.__dict__,
        "runs": {},
        "oracle": {},
    }
    if speed is not None:
        payload["speed"] = speed
    started = time.monotonic()
    for replicas in counts:
        by_seed = [
            _runs(_seeded(args, seed), replicas, policies, engine, cost, tokenizer)
            for seed in seeds
        ]
        for section in by_seed[0]:
            oracles = [runs[section][0] for runs in by_seed]
            payload["oracle"][section] = sum(oracles) / len(oracles)
            payload["runs"][section] = {
                policy: over_seeds(seeds, [runs[section][1][policy] for runs in by_seed])
                for policy in policies
            }
    payload["wall_s"] = time.monotonic() - started
    payload["conditions"] = (
        f"cost model: {cost.base_s * 1e3:.2f} ms/step + "
        f"{cost.prefill_token_s * 1e6:.1f} us/prefill token + "
        f"{cost.decode_seq_s * 1e3:.2f} ms/decoding sequence ({cost.measured}); "
        f"{args.num_blocks} blocks per replica"
        + (f"; seeds {seeds}: medians (min-max), means in seed_means" if len(seeds) > 1 else "")
    )
    payload["sweeps"] = _replica_sweeps(payload, counts, policies)
    return write_report(out, payload)


def _runs(
    args: argparse.Namespace,
    replicas: int,
    policies: list[str],
    engine: EngineConfig,
    cost: CostModel,
    tokenizer: Tokenizer,
) -> dict[str, tuple[float, dict[str, dict[str, Any]]]]:
    """Section -> (the oracle's hit rate, policy -> metrics) for ``args.seed``'s traces."""
    sections = {}
    for rate, trace in traces(_scaled(args, replicas)).items():
        oracle = oracle_hit_rate(trace, engine.block_hasher(), tokenizer)
        sections[f"{replicas} replicas, {section_name(rate)}"] = (
            oracle,
            {
                policy: _simulate(args, policy, replicas, engine, cost, trace)
                | {"oracle_hit_rate": oracle}
                for policy in policies
            },
        )
    return sections


def _seeded(args: argparse.Namespace, seed: int) -> argparse.Namespace:
    return argparse.Namespace(**vars(args) | {"seed": seed})


def _scaled(args: argparse.Namespace, replicas: int) -> argparse.Namespace:
    """With ``--per-replica``, requests, rates and conversations grow with the cluster."""
    if not args.per_replica:
        return args
    rates = ",".join(str(float(r) * replicas) for r in args.rates.split(","))
    return argparse.Namespace(
        **vars(args)
        | {
            "requests": args.requests * replicas,
            "rates": rates,
            "conversations": args.conversations * replicas,
        }
    )


def _simulate(
    args: argparse.Namespace,
    policy: str,
    replicas: int,
    engine: EngineConfig,
    cost: CostModel,
    trace: list[TraceRequest],
) -> dict[str, Any]:
    name, knobs = run_knobs(args, policy)
    name, mirror = split_mirror(name)
    if mirror is not None:
        return {"error": "not simulated: the simulator's index answers at once, mirror or not"}
    name, stored = split_store(name)
    name, pull = split_pull(name, args.pull)
    if name not in SIMULATED:
        return {"error": "not simulated: Ray's own routers run only on the real cluster"}
    t0 = time.monotonic()
    store = stored if stored.enabled and args.store_blocks else None
    sim = Simulation(
        sim_policy(name, args.epsilon, json.dumps(knobs), pull, store),
        replicas,
        engine,
        cost,
        args.max_ongoing_requests,
        pull=pull,
        store=store,
        store_blocks=args.store_blocks,
        replicas_per_node=args.replicas_per_node,
    )
    results, makespan = sim.run(trace)
    metrics = summarize(results, makespan, sorted(sim.replicas))
    metrics.pop("requests")  # not kept: 30,000 requests a policy at 256 replicas
    pulls = {"pulls": sim.tally.pulls, "pulled_blocks": sim.tally.pulled_blocks} if pull else {}
    if store is not None:
        pulls["restored_blocks"] = sim.tally.restored_blocks
    return (
        metrics
        | pulls
        | {"hit_rate_engine": sim.engine_hit_rate(), "wall_s": time.monotonic() - t0}
    )


def _replica_sweeps(
    payload: dict[str, Any], counts: list[int], policies: list[str]
) -> list[dict[str, Any]]:
    """One plot per metric against cluster size, a line per policy (and the oracle)."""
    if len(counts) < 2:
        return []
    sweeps = []
    for key, label, file in (
        ("hit_rate_engine", "prompt-token hit rate", "hit_rate_vs_replicas.png"),
        ("load_imbalance", "load imbalance (max/mean requests)", "imbalance_vs_replicas.png"),
        ("work_imbalance", "work imbalance (max/mean tokens run)", "work_vs_replicas.png"),
        ("ttft_p99_s", "TTFT p99 (s)", "ttft_p99_vs_replicas.png"),
        ("ttft_p50_s", "TTFT p50 (s)", "ttft_p50_vs_replicas.png"),
    ):
        series: dict[str, list[tuple[float, float]]] = {}
        for section, runs in payload["runs"].items():
            replicas = int(section.split()[0])
            for policy in policies:
                m = runs.get(policy, {})
                if "error" not in m and m.get(key) is not None:
                    series.setdefault(policy, []).append((replicas, m[key]))
            if key == "hit_rate_engine":
                series.setdefault("oracle", []).append((replicas, payload["oracle"][section]))
        sweeps.append(
            {
                "series": series,
                "x": "replicas",
                "y": label,
                "title": f"{label} vs replicas",
                "file": file,
                "log_x": True,
            }
        )
    return sweeps
