"""Routers that run in Ray Serve LLM's own application, for ``routing --backend vllm``.

A policy named ``ray_llm:<router>`` (``kv``: Ray's ``KVAwareRouter`` on Dynamo's selection
service; ``prefix``: its ``PrefixCacheAffinityRouter``; ``pow2``: Serve's default; ``ours``:
``cluster.ray_llm``'s drop-in) is run by Ray Serve LLM itself (``bench/peers/ray_serve_llm.py``
in vLLM's virtualenv, its own private Ray) over vLLM engines given the same arguments our
replicas give theirs (``replica.vllm.args``: blocks, block size, step budget, dtype, eager),
one OpenMP thread each bound to a core of its own, and is driven by the same client with the
same trace as the policies of our cluster beside it. What Ray's app cannot report is left
out, not estimated: which replica served a request (no ``x-replica-id``), the router's
decision time. The prompt tokens served from cache are vLLM's own prefix-cache counters,
read through Ray's metrics agent.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench.experiments.routing_args import check_knobs, json_option, run_knobs, split_variant
from bench.loadgen import drive, progress_printer, warm_up
from bench.peers.engines import ensure_vllm_venv
from bench.peers.ray_llm_stack import ray_llm
from bench.report import summarize
from bench.workloads import TraceRequest
from replica.config import EngineConfig
from replica.vllm.args import vllm_kwargs

PREFIX = "ray_llm:"
ROUTERS = ("kv", "prefix", "pow2", "ours")
# what a variant may set on Ray Serve LLM's deployment, whatever its router: requests a
# replica takes at once (Ray Serve LLM's default is unbounded, 1e9; this harness gives 64)
DEPLOYMENT_KNOBS = ("max_ongoing_requests",)


def is_ray_llm(policy: str) -> bool:
    return policy.startswith(PREFIX)


def check_ray_llm_policies(args: argparse.Namespace, policies: list[str]) -> None:
    """Before the first run: a variant of Ray Serve LLM's app sets its deployment
    (``DEPLOYMENT_KNOBS``) for any router, and routing knobs only for ours (the drop-in,
    ``prefill_cost``'s fields)."""
    variants = json_option(args, "variants")
    for policy in policies:
        if not is_ray_llm(policy):
            continue
        name, extra = split_variant(policy, variants)
        routing = {k: v for k, v in extra.items() if k not in DEPLOYMENT_KNOBS}
        if routing and name != f"{PREFIX}ours":
            raise ValueError(f"{policy}: {sorted(routing)} are our router's; Ray's take none")
        check_knobs(["prefill_cost"], routing, args.epsilon)


def peer_engine_kwargs(engine: EngineConfig) -> dict[str, Any]:
    """What our replicas give vLLM, less what Ray Serve LLM sets itself (model and name)."""
    kwargs = vllm_kwargs(engine)
    for key in ("model", "served_model_name"):
        kwargs.pop(key)
    return kwargs


def run_ray_llm_policy(
    args: argparse.Namespace,
    policy: str,
    trace: list[TraceRequest],
    engine: EngineConfig,
    label: str,
    work_dir: Path,
) -> dict[str, Any]:
    """One run of ``trace`` through Ray Serve LLM with the policy's router: started, warmed
    up, driven, its counters read, stopped. A stack that cannot start is reported."""
    name, knobs = run_knobs(args, policy)
    router = name.removeprefix(PREFIX)
    if engine.backend != "vllm" or router not in ROUTERS or int(args.replicas) != 2:
        raise ValueError(f"{policy}: needs --backend vllm, 2 replicas, a router of {ROUTERS}")
    deployment = {k: knobs.pop(k) for k in DEPLOYMENT_KNOBS if k in knobs}
    knobs = knobs if router == "ours" else {}  # Ray's routers have none of ours
    # Ray Serve LLM and Dynamo's selection service beside vLLM (installed once, if missing)
    python = ensure_vllm_venv(args.vllm_python.absolute().parent.parent, stack=True)
    work_dir.mkdir(parents=True, exist_ok=True)
    kwargs = peer_engine_kwargs(engine)
    try:
        stack = ray_llm(python, args.hf_model.resolve(), work_dir, False, router=router,
                        engine_kwargs=kwargs, routing=knobs, **deployment)  # fmt: skip
        with stack as running:
            warm_up(running.base_url, engine.model_id, int(args.replicas), timeout_s=120)
            before = running.cache_counters()
            results, makespan = drive(
                running.base_url, engine.model_id, trace, 120.0, progress_printer(label)
            )
            after = running.cache_counters()
    except Exception as exc:  # a peer that cannot run is reported, not dropped
        return {"error": f"Ray Serve LLM ({router}) failed: {type(exc).__name__}: {exc}"}
    metrics = summarize(results, makespan, [])
    prompt, cached = (a - b for a, b in zip(after, before, strict=True))
    metrics["hit_rate_engine"] = cached / prompt if prompt else 0.0
    metrics["engine_prompt_tokens"] = prompt
    if metrics["requests_ok"] == 0:
        metrics["error"] = f"no request succeeded: {metrics['errors']}"
    return metrics
