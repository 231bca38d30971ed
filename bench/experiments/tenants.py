"""``tenants``: a noisy neighbour, first come first served against the fair queue (issue 49).

On the real cluster (2 engine replicas, Redis, the ingress, over HTTP with each tenant's API
key), for each mode (``fifo``: ``fair_queue`` off, requests beyond the engines' slots wait
at the ingress in arrival order; ``fair``: the fair queue without express slots;
``express``: the fair queue with ``--express-slots`` per replica lent to a light tenant or a
higher priority; ``express_flat``: the same with the engines' ``priority_prefill`` off, so
a higher priority's prompt shares its steps with the flood's prompts) these phases, one
after another on one cluster:

* ``b_alone``: tenant B alone at ``--light`` x capacity (its TTFT with nobody else);
* ``noisy``: the same B trace while tenant A floods at ``--flood`` x capacity;
* ``cost_share``: A's prompts all uncached, B's all cached, both at ``--share`` x capacity:
  the fair queue shares what requests cost after the cache, so B gets more requests through
  than A; what request-count fairness would have given is computed from the measured costs;
* ``priority`` (the fair queue only): a priority-5 tenant at ``--light`` x capacity while a
  priority-0 tenant floods (``b_alone`` is its alone value: the same request shape).

Before the phases one request of B and one of the priority tenant cache their system
prompts, so every phase compares warm requests (an alone value that includes the one cold
prefill would flatter every ratio). Capacity is measured first, once, on the first cluster:
requests completed per second with the engines' slots (replicas x ``--max-ongoing``)
always busy with A's cached requests. Each phase sends arrivals for ``--duration``
seconds and abandons what is still waiting or running ``--grace`` seconds later (the
clients disconnect; FIFO's backlog would otherwise take minutes to drain): a request
abandoned before its first token counts as a TTFT beyond the cut-off. Modes alternate
ABBA over ``--repeats``. With ``--ingress-replicas`` 2 the clients reach two ingresses
(Serve's proxy picks one per request) that share one fair queue in Redis
(``cluster.shared_queue``), express slots included; ``--phases`` runs some phases only.
``--trace`` traces the named tenants' requests and says, per phase, where their time to
first token went (``bench.harness.span_breakdown``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from bench.experiments.tenants_report import markdown, summary
from bench.harness.histograms import between, tenant_ttft_buckets
from bench.harness.launcher import ServeCluster
from bench.harness.private_ray import PrivateRay
from bench.harness.rounds import abba, chosen_modes, redis_and_ray
from bench.harness.span_breakdown import TracedTenants
from bench.loadgen import RequestResult
from bench.peers.host import provenance
from bench.tenant_load import CUT_OFF, closed_loop, drive_tenants
from bench.tenant_workloads import tenant_trace
from bench.workloads import TraceRequest, fast_engine
from cluster.config import ClusterArgs
from cluster.tenants import APIKeyRecord
from kvindex.config import IndexConfig
from kvindex.measure import percentile
from replica.config import EngineConfig

KEYS = {"a": "sk-tenant-a", "b": "sk-tenant-b", "lo": "sk-tenant-lo", "hi": "sk-tenant-hi"}
PRIORITY = {"hi": 5}
MODES = ("fifo", "fair", "express", "express_flat")
PHASES = ("b_alone", "noisy", "cost_share", "priority")
Load = list[TraceRequest]
Phase = dict[str, tuple[str, Load]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-blocks", type=int, default=640, help="KV blocks per replica")
    parser.add_argument("--max-ongoing", type=int, default=4, help="slots per engine replica")
    parser.add_argument("--duration", type=float, default=45.0, help="seconds of arrivals")
    parser.add_argument("--grace", type=float, default=20.0, help="then this long to finish")
    parser.add_argument("--flood", type=float, default=4.0, help="A's rate, x capacity")
    parser.add_argument("--light", type=float, default=0.1, help="B's rate, x capacity")
    parser.add_argument("--share", type=float, default=2.0, help="cost_share: each, x capacity")
    parser.add_argument("--deadline", type=float, default=20.0, help="fair_queue.deadline_s")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--calibrate-s", type=float, default=30.0)
    parser.add_argument("--capacity", type=float, help="requests/s (default: measured)")
    parser.add_argument("--express-slots", type=int, default=1, help="per replica, express")
    parser.add_argument("--modes", default="fifo,fair,express", help="comma-separated")
    parser.add_argument("--phases", default=",".join(PHASES), help="comma-separated, in this order")
    parser.add_argument(
        "--ingress-replicas",
        type=int,
        default=1,
        help="more than 1: one fair queue for all of them, in Redis (fair_queue.shared)",
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--trace",
        default="",
        help="tenants (comma-separated) whose requests are traced: where their TTFT went",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = args.out or Path("results/tenants")
    out.mkdir(parents=True, exist_ok=True)
    engine = fast_engine(args.model, num_blocks=args.num_blocks)
    modes = chosen_modes(args.modes, MODES)
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    capacity = args.capacity
    traced = chosen_modes(args.trace, tuple(KEYS), "--trace") if args.trace else []
    tracing = TracedTenants(frozenset(traced)) if traced else None
    try:
        with redis_and_ray(out, tracing.env if tracing else None) as (url, ray):
            for rep in range(args.repeats):
                for mode in abba(modes, rep):
                    result, capacity = run_mode(args, mode, capacity, url, ray, engine, tracing)
                    runs[mode].append(result)
    finally:
        if tracing is not None:
            tracing.stop()
    assert capacity is not None
    payload = {
        "title": "Tenants: a noisy neighbour, FIFO vs the fair queue (real cluster)",
        "provenance": provenance(),
        "arguments": {k: str(v) for k, v in vars(args).items()},
        "capacity_rps": capacity,
        "runs": runs,
        "summary": summary(runs, capacity, args),
        "measured": time.strftime("%F"),
    }
    (out / "results.json").write_text(json.dumps(payload, indent=2) + "\n")
    (out / "results.md").write_text(markdown(payload))
    return payload


def cluster_args(
    args: argparse.Namespace, mode: str, url: str, engine: EngineConfig
) -> ClusterArgs:
    keys = [
        APIKeyRecord(key=key, tenant=name, priority=PRIORITY.get(name, 0))
        for name, key in KEYS.items()
    ]
    return ClusterArgs(
        num_replicas=2,
        engine=engine.model_copy(update={"priority_prefill": mode != "express_flat"}),
        max_ongoing_requests=args.max_ongoing,
        max_queued_requests=-1,  # FIFO holds everything; the fair queue refuses by deadline
        ingress_replicas=args.ingress_replicas,
        api_keys=list(keys),
        fair_queue={
            "enabled": mode != "fifo",
            "deadline_s": args.deadline,
            "express_slots": args.express_slots if mode.startswith("express") else 0,
        },
        index=IndexConfig(url=url, cluster=f"tenants-{os.getpid()}-{time.monotonic_ns()}"),
    )


def run_mode(
    args: argparse.Namespace,
    mode: str,
    capacity: float | None,
    url: str,
    ray: PrivateRay,
    engine: EngineConfig,
    tracing: TracedTenants | None = None,
) -> tuple[dict[str, Any], float]:
    """One cluster in ``mode``: (calibrate,) then every phase; returns their metrics (and
    with ``tracing``, where its tenants' TTFT went: ``_spans``)."""
    env = tracing.env if tracing else None
    with ServeCluster(cluster_args(args, mode, url, engine), ray=ray, env=env) as cluster:
        model = engine.model_id
        warm = lambda i: TraceRequest(f"warm-{i}", 0, f"warm up {i}", 2)  # noqa: E731
        closed_loop(cluster.base_url, model, KEYS["a"], warm, 4, 5)
        if capacity is None:
            prompts = tenant_trace("a", 1000.0, 10.0, args.seed + 1, True, args.max_tokens)
            slots = 2 * args.max_ongoing
            capacity = closed_loop(
                cluster.base_url,
                model,
                KEYS["a"],
                lambda i: prompts[i % len(prompts)],
                slots,
                args.calibrate_s,
            )
        result: dict[str, Any] = {}
        todo = phases(args, mode, capacity)
        # B's and the priority tenant's system prompts cached first, as in the later
        # phases: their alone values are then of warm requests too, not of one prefill
        warm_up = {  # a request of its own each: no phase's first request is replayed
            t: (KEYS[t], tenant_trace(t, 1.0, 10.0, args.seed, True, args.max_tokens, "warm")[:1])
            for t in ("b", "hi")
            if any(t in phase for phase in todo.values())
        }
        drive_tenants(cluster.base_url, model, warm_up, 60)
        for name, phase in todo.items():
            print(f"tenants: {mode} {name} ({capacity:.2f} requests/s capacity)", flush=True)
            cut_off = args.duration + args.grace
            before = tenant_ttft_buckets(cluster.base_url, KEYS["a"])
            traced = tracing.tenants if tracing else frozenset()
            per_tenant = drive_tenants(cluster.base_url, model, phase, cut_off, traced)
            result[name] = {t: tenant_metrics(rs, cut_off) for t, rs in per_tenant.items()}
            result[name]["_after"] = wait_idle(cluster)
            if tracing is not None:
                result[name]["_spans"] = tracing.collect(per_tenant)
            # the same requests' TTFT as the ingress measured it (its wait included)
            after = tenant_ttft_buckets(cluster.base_url, KEYS["a"])
            result[name]["_ingress_ttft"] = between(before, after)
    return result, capacity


def phases(args: argparse.Namespace, mode: str, capacity: float) -> dict[str, Phase]:
    """Each phase's tenants, keys and traces. Every phase asks its own questions (a trace
    ``variant`` of its own): B under the flood must not replay B alone's requests, whose
    full blocks would then be cached (22 prompt tokens to compute alone, 7 replayed)."""

    def load(tenant: str, times: float, phase: str, cached: bool = True) -> tuple[str, Load]:
        trace = tenant_trace(
            tenant, times * capacity, args.duration, args.seed, cached, args.max_tokens, phase
        )
        return KEYS[tenant], trace

    out: dict[str, Phase] = {
        "b_alone": {"b": load("b", args.light, "b_alone")},
        "noisy": {"a": load("a", args.flood, "noisy"), "b": load("b", args.light, "noisy")},
        "cost_share": {
            "a": load("a", args.share, "cost_share", cached=False),
            "b": load("b", args.share, "cost_share"),
        },
    }
    if mode != "fifo":  # priorities act in the fair queue only
        lo, hi = load("lo", args.flood, "priority"), load("hi", args.light, "priority")
        out["priority"] = {"lo": lo, "hi": hi}
    wanted = chosen_modes(args.phases, PHASES, "--phases")  # b_alone too: every ratio's alone value
    return {name: phase for name, phase in out.items() if name in wanted}


def wait_idle(cluster: ServeCluster, timeout_s: float = 60.0) -> dict[str, Any]:
    """Until the abandoned requests are gone from the engines (the router's bookings);
    what was still busy at ``timeout_s`` is returned (and reported), not hidden."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = cluster.stats()
        left = stats.get("bookings_in_flight", 0)
        if left == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    replicas = {r: (s.get("num_running"), s.get("in_flight")) for r, s in stats["replicas"].items()}
    if left:
        print(f"tenants: {left} bookings left after the cut-off; replicas {replicas}", flush=True)
    return {"bookings_left": left, "replicas_running": replicas}


def tenant_metrics(results: list[RequestResult], cut_off_s: float) -> dict[str, Any]:
    """One tenant's phase: what it sent, what was served, refused, abandoned; its TTFT with
    a request abandoned before its first token counted as beyond the cut-off."""
    ok = [r for r in results if r.status == 200 and r.error is None]
    refused = [r for r in results if r.status in (429, 503)]
    cut = [r for r in results if r.error == CUT_OFF]
    waited = [  # a refused request never waited for a token
        math.inf if r.ttft_s is None else r.ttft_s for r in results if r.status not in (429, 503)
    ]
    charged = [r.prompt_tokens - r.cached_tokens + r.completion_tokens for r in ok]
    return {
        "sent": len(results),
        "ok": len(ok),
        "refused": len(refused),
        "refused_codes": sorted({(r.error or "")[:80] for r in refused})[:3],
        "cut_off": len(cut),
        "cut_before_first_token": sum(1 for r in cut if r.ttft_s is None),
        "failed_other": len(results) - len(ok) - len(refused) - len(cut),
        "ttft_p50_s": censored_percentile(waited, 50),
        "ttft_p99_s": censored_percentile(waited, 99),
        "served_rps": len(ok) / cut_off_s,
        "charged_tokens": sum(charged),
        "mean_cost_tokens": sum(charged) / len(charged) if charged else None,
    }


def censored_percentile(values: list[float], q: float) -> float | None:
    """``kvindex.measure.percentile`` when it falls among the measured values; None when it
    needs one beyond the cut-off (infinite here: only a bound is known, the cut-off)."""
    data = sorted(values)
    if not data or not math.isfinite(data[math.ceil((len(data) - 1) * q / 100.0)]):
        return None
    return percentile(data, q)
