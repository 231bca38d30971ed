"""``store``: what the second cache tier (``replica.store``) gives and costs.

``--where engine``: two engines sharing one node store in one process. Per repeat a new
prefix of N tokens is computed on A (its blocks spill into the store when released), then
restored from the store by B (its own pool empty), then hit locally on A again (the last
two alternate order). Each is one request of one output token, timed whole.

``--where cluster``: the real thing, 2 replicas behind round robin (pulls off, the store
on, as by default), the ``openai`` SDK streaming. Per repeat a new system prompt goes to X
(computed), Y (restored from the node store: X released it) and X (a local hit). With
``--kill``, one more round: a prefix computed on X, X SIGKILLed, the same prefix again
(Serve sends it to Y, or to X's replacement): its ``cached_tokens`` and TTFT.

``--where decode``: does spilling cost the step anything? One engine with the tier and
one without take the same load (``--requests`` requests of distinct prompts, 32 running at
once, so blocks are released and spilled while others decode); every decode-only step is
timed, and the two alternate (A B B A) over ``--repeats`` rounds.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import time
from typing import Any

import numpy as np
import openai

from bench.experiments import engine as engine_experiment
from bench.experiments.prefix.pull import first_token, system_prompt, two_replicas, warm_client
from bench.harness.launcher import ServeCluster
from bench.harness.redis_server import LocalRedis
from bench.report import spread
from replica.checkpoints import TINY_MODEL, checkpoint_for
from replica.config import EngineConfig
from replica.engine.engine import Engine
from replica.model.runner import build_engine
from replica.sampling.params import SamplingParams
from replica.store.config import StoreConfig
from replica.store.layout import StoreGeometry, fingerprint
from replica.store.node_store import NodeStore
from replica.store.tier import StoreTier

MODES = ("computed", "restored", "local_hit")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--where", choices=["engine", "cluster", "decode"], default="engine")
    parser.add_argument("--model", default=TINY_MODEL, help="EngineConfig.model")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2, help="torch threads per engine")
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--store-mb", type=int, default=1024, help="the node store's size")
    parser.add_argument("--pause-s", type=float, default=0.5, help="cluster: between requests")
    parser.add_argument("--kill", action="store_true", help="cluster: and a SIGKILL round")
    parser.add_argument("--requests", type=int, default=32, help="decode: requests per run")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    longest = max(2048, args.prefix_tokens + 256)
    return engine_experiment.engine_config(args).model_copy(update={"max_model_len": longest})


def run(args: argparse.Namespace) -> dict[str, Any]:
    found = {"engine": engine_rounds, "cluster": cluster_rounds, "decode": decode_steps}[
        args.where
    ](args)
    return {"where": args.where, "model": args.model, "dtype": args.dtype, **found}


def shared_store(engine: Engine, megabytes: int) -> NodeStore:
    data = engine.runner.kv_cache.data
    layout = (str(data.dtype), tuple(data.shape[1:]))
    hasher = engine.hasher
    print_ = fingerprint(
        hasher.model_id, hasher.block_size, hasher.secret, layout, engine.runner.kv_source
    )
    geometry = StoreGeometry.for_bytes(megabytes * 2**20, hasher.block_size, data[0].nbytes)
    return NodeStore.anonymous(geometry, print_)


def _with_tier(config: EngineConfig, store: NodeStore) -> Engine:
    engine = build_engine(config)
    engine.attach_store(StoreTier(store, background=True))
    return engine


def engine_rounds(args: argparse.Namespace) -> dict[str, Any]:
    config = engine_config(args)
    a = build_engine(config)
    store = shared_store(a, args.store_mb)
    a.attach_store(StoreTier(store, background=True))
    b = _with_tier(config, store)
    for engine in (a, b):  # torch's first calls are slow
        engine.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=4))
    vocab = config.shape.vocab_size
    seconds: dict[str, list[float]] = {m: [] for m in MODES}
    cached: dict[str, list[int]] = {m: [] for m in MODES}
    one = SamplingParams(max_tokens=1)
    for rep in range(args.repeats):
        prompt = [(13 * i + 7 * rep) % (vocab - 20) + 10 for i in range(args.prefix_tokens)]
        prompt += [5, 6 + rep]
        order = ("computed", "restored", "local_hit")
        if rep % 2:
            order = ("computed", "local_hit", "restored")
        for mode in order:
            engine = b if mode == "restored" else a
            if mode == "restored":
                b.reset_prefix_cache()
            start = time.perf_counter()
            (out,) = engine.generate([prompt], one)
            seconds[mode].append(time.perf_counter() - start)
            cached[mode].append(out.num_cached_tokens)
            assert a.store is not None
            a.store.wait_idle()
    return _summary(seconds, cached) | {"store": b.store.counters.to_dict() if b.store else {}}


def _summary(seconds: dict[str, list[float]], cached: dict[str, list[int]]) -> dict[str, Any]:
    found: dict[str, Any] = {f"ttft_{m}_s": spread(seconds[m]) for m in MODES}
    for base in ("local_hit", "computed"):
        ratios = [r / b for r, b in zip(seconds["restored"], seconds[base], strict=True)]
        found[f"restored_over_{base}"] = spread(ratios)
    found["cached_tokens_min"] = {m: min(cached[m]) for m in MODES}
    return found


def cluster_rounds(args: argparse.Namespace) -> dict[str, Any]:
    config = engine_config(args)
    with LocalRedis() as redis_server:
        store = StoreConfig(memory_bytes=args.store_mb * 2**20)
        cluster_args = two_replicas(config, redis_server.url, "store-bench", store=store)
        with ServeCluster(cluster_args, log_path=None) as cluster:
            client = warm_client(cluster, config.model_id)
            found = _cluster_repeats(client, config.model_id, args)
            if args.kill:
                found["after_sigkill"] = _kill_round(cluster, client, config.model_id, args)
            time.sleep(1.5)
            stats = cluster.stats()["replicas"]
    keys = ("store_spilled_blocks", "store_restored_blocks", "store_restore_seconds")
    keys += ("store_restore_rejected", "store_blocks", "store_publisher")
    found["replica_counters"] = {rid: {k: s.get(k) for k in keys} for rid, s in stats.items()}
    return found


def _cluster_repeats(client: openai.OpenAI, model: str, args: argparse.Namespace) -> dict:
    seconds: dict[str, list[float]] = {m: [] for m in MODES}
    cached: dict[str, list[int]] = {m: [] for m in MODES}
    replicas: dict[str, list[str]] = {m: [] for m in MODES}
    tokenizer = checkpoint_for(args.model).tokenizer()
    for rep in range(args.repeats):
        system = system_prompt(args.prefix_tokens * 1000 + rep, args.prefix_tokens, tokenizer)
        for mode in MODES:  # round robin: X, Y, X
            ttft, usage, replica = first_token(client, model, system, f"Question {rep}{mode}?")
            seconds[mode].append(ttft)
            cached[mode].append(usage.prompt_tokens_details.cached_tokens)
            replicas[mode].append(replica)
            time.sleep(args.pause_s)
    return _summary(seconds, cached) | {"replicas": replicas}


def _kill_round(
    cluster: ServeCluster, client: openai.OpenAI, model: str, args: argparse.Namespace
) -> dict[str, Any]:
    tokenizer = checkpoint_for(args.model).tokenizer()
    system = system_prompt(7_777_777, args.prefix_tokens, tokenizer)
    computed, _, holder = first_token(client, model, system, "Before the kill?")
    time.sleep(args.pause_s)
    pid = cluster.stats()["replicas"][holder]["pid"]
    os.kill(pid, signal.SIGKILL)
    start = time.perf_counter()
    ttft, usage, replica = first_token(client, model, system, "After the kill?")
    return {
        "killed_replica": holder,
        "served_by": replica,
        "ttft_computed_s": computed,
        "ttft_after_kill_s": ttft,
        "wall_s": time.perf_counter() - start,
        "cached_tokens": usage.prompt_tokens_details.cached_tokens,
    }


def decode_steps(args: argparse.Namespace) -> dict[str, Any]:
    config = engine_config(args).model_copy(update={"max_model_len": None})
    plain = build_engine(config)
    tiered = _with_tier(config, shared_store(plain, args.store_mb))
    vocab = config.shape.vocab_size
    steps: dict[str, list[float]] = {"off": [], "on": []}
    for rep in range(args.repeats):
        for name in ("off", "on") if rep % 2 == 0 else ("on", "off"):
            engine = tiered if name == "on" else plain
            engine.reset_prefix_cache()
            steps[name] += _decode_run(engine, args, vocab, seed=rep)
    p99 = {name: float(np.percentile(found, 99)) for name, found in steps.items()}
    p50 = {name: statistics.median(found) for name, found in steps.items()}
    spilled = tiered.store.counters.spilled_blocks if tiered.store else 0
    return {
        "decode_step_p50_s": p50,
        "decode_step_p99_s": p99,
        "p99_on_over_off": p99["on"] / p99["off"],
        "decode_steps": {name: len(found) for name, found in steps.items()},
        "spilled_blocks": spilled,
    }


def _decode_run(engine: Engine, args: argparse.Namespace, vocab: int, seed: int) -> list[float]:
    """``args.requests`` requests of distinct 256-token prompts admitted together, each
    wanting a different number of tokens (16, 20, 24, ...), so they finish one by one and
    their blocks are released (and spilled) while the others decode: the durations of the
    steps that only decode."""
    for i in range(args.requests):
        prompt = [(31 * j + 17 * i + seed) % (vocab - 20) + 10 for j in range(256)]
        params = SamplingParams(max_tokens=16 + 4 * i, ignore_eos=True)
        engine.add_request(f"d{seed}-{i}", prompt, params)
    found = []
    while engine.has_unfinished_requests():
        sched = engine.scheduler
        prefill = bool(sched.waiting) or any(
            s.num_computed_tokens < s.num_tokens - 1 for s in sched.running
        )
        start = time.perf_counter()
        engine.step()
        if not prefill:
            found.append(time.perf_counter() - start)
    return found
