"""``pull``: what a prefix of N tokens costs a request's first token three ways: computed
(nothing cached), a local hit, and pulled from another replica that holds it.

``--where engine``: two engines in one process (``replica.kv.transfer``), the three
alternated (A B C C B A ...). The pulled prefix is exported, carried and imported, verified,
then admitted as a local hit. ``--transport shared_memory`` (the default, what same-node
replicas do): only where the blocks are travels, and the puller copies them out of the
holder's shared pool; ``object_store`` (what replicas on different nodes do): the bytes
travel as Ray's object store carries them, pickled with the array out of band and copied
once, as a put into shared memory does.

``--where cluster``: the real thing: 2 replicas behind round robin with pulls on, the
``openai`` SDK streaming. Each repeat a new system prompt of N tokens goes to replica X
(computed), then to Y (Y pulls it from X: the index says X holds it), then to X again (a
local hit); X alternates between the replicas. TTFT is the first streamed token; the pulled
request's ``cached_tokens`` and the replicas' pull counters are reported. A short pause
after each request lets the holder publish its blocks, as between two users' requests.
"""

from __future__ import annotations

import argparse
import dataclasses
import pickle
import random
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import openai

from bench.experiments import engine as engine_experiment
from bench.harness.launcher import ServeCluster
from bench.harness.redis_server import LocalRedis
from bench.report import spread
from bench.sim.cost_model import CostModel
from cluster.config import ClusterArgs
from kvindex.config import IndexConfig
from replica.checkpoints import TINY_MODEL, checkpoint_for
from replica.config import EngineConfig
from replica.kv.transfer import PrefixExport, export_prefix, import_prefix
from replica.model.runner import build_engine
from replica.pull_config import PullConfig
from replica.sampling.params import SamplingParams
from router.config import routing_config

MODES = ("computed", "local_hit", "pulled")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--where", choices=["engine", "cluster"], default="engine")
    parser.add_argument("--model", default=TINY_MODEL, help="EngineConfig.model")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2, help="torch threads per engine")
    parser.add_argument(
        "--prefix-tokens", default="1024", help="prefix sizes, comma-separated (two or more: a fit)"
    )
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--pause-s", type=float, default=0.5, help="cluster: between requests")
    parser.add_argument(
        "--transport",
        choices=["shared_memory", "object_store"],
        default="shared_memory",
        help="how the KV travels (pull.shared_memory): from the holder's pool, or as bytes",
    )
    parser.add_argument(
        "--calibrate", type=Path, help="write the fitted pull cost into this simulator cost model"
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The ``engine`` experiment's engine, long enough for the largest prefix."""
    longest = max(2048, max(sizes(args)) + 256)
    return engine_experiment.engine_config(args).model_copy(update={"max_model_len": longest})


def sizes(args: argparse.Namespace) -> list[int]:
    return [int(n) for n in str(args.prefix_tokens).split(",")]


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.where == "engine":
        measured = {n: engine_pulls(args, n) for n in sizes(args)}
    else:
        measured = cluster_pulls(args)
    result: dict[str, Any] = {
        "where": args.where,
        "model": args.model,
        "transport": args.transport,
        "sizes": {},
    }
    for n, found in measured.items():
        seconds = found.pop("seconds")
        for mode in MODES:
            found[f"ttft_{mode}_s"] = spread(seconds[mode])
        for base in ("local_hit", "computed"):
            ratios = [a / b for a, b in zip(seconds["pulled"], seconds[base], strict=True)]
            found[f"pulled_over_{base}"] = spread(ratios)
        found["pull_extra_s"] = spread(
            [a - b for a, b in zip(seconds["pulled"], seconds["local_hit"], strict=True)]
        )
        found["prefill_s_per_token"] = statistics.median(
            (a - b) / n for a, b in zip(seconds["computed"], seconds["local_hit"], strict=True)
        )
        result["sizes"][str(n)] = found
    if len(measured) >= 2:
        result["fit"] = _fit(result["sizes"], engine_config(args).block_size)
        if args.calibrate is not None:
            _calibrate(args.calibrate, result["fit"], args)
    return result


def _fit(by_size: dict[str, dict[str, Any]], block_size: int) -> dict[str, Any]:
    """A pull's extra TTFT over a local hit as call + per block x blocks (least squares),
    and what that is in prefill tokens: the router's price of a pull."""
    blocks = [int(n) // block_size for n in by_size]
    extra = [found["pull_extra_s"]["median"] for found in by_size.values()]
    slope, intercept = np.polyfit(blocks, extra, 1)
    per_token = statistics.median(found["prefill_s_per_token"] for found in by_size.values())
    return {
        "pull_call_s": max(0.0, float(intercept)),
        "pull_block_s": max(0.0, float(slope)),
        "token_cost": max(0.0, float(slope)) / block_size / per_token,
        "call_cost_tokens": max(0.0, float(intercept)) / per_token,
    }


def _calibrate(path: Path, fit: dict[str, Any], args: argparse.Namespace) -> None:
    model = CostModel.load(path)
    stamp = f"bench pull --where {args.where} --model {args.model} --prefix-tokens "
    stamp += f"{args.prefix_tokens}, {time.strftime('%F')}"
    model = dataclasses.replace(
        model, pull_call_s=fit["pull_call_s"], pull_block_s=fit["pull_block_s"], pull_measured=stamp
    )
    model.save(path)


def engine_pulls(args: argparse.Namespace, tokens: int) -> dict[str, Any]:
    by_reference = args.transport == "shared_memory"
    config = engine_config(args).model_copy(update={"shared_kv_pool": by_reference})
    holder, puller = build_engine(config), build_engine(config)
    vocab = config.shape.vocab_size
    prefix = [(13 * i + 7) % (vocab - 20) + 10 for i in range(tokens)]
    for engine in (holder, puller):  # torch's first calls are slow
        engine.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=4))
        engine.reset_prefix_cache()
    holder.generate([prefix + [5]], SamplingParams(max_tokens=1))  # the holder caches it
    seconds: dict[str, list[float]] = {m: [] for m in MODES}
    pull_s: list[float] = []
    pulled_bytes = 0
    for rep in range(args.repeats):
        for mode in MODES if rep % 2 == 0 else MODES[::-1]:
            prompt = prefix + [6 + rep, 9]  # a new suffix every time
            puller.reset_prefix_cache()
            start = time.perf_counter()
            if mode == "pulled":
                exported = export_prefix(holder.kv, prompt, None, by_reference)
                carried = _carried(exported, by_reference)
                imported = import_prefix(puller.kv, prompt, None, carried)
                assert not imported.rejected, imported.rejected
                pull_s.append(time.perf_counter() - start)
                pulled_bytes = carried.num_bytes
            engine = holder if mode == "local_hit" else puller
            (out,) = engine.generate([prompt], SamplingParams(max_tokens=1))
            seconds[mode].append(time.perf_counter() - start)
            assert (out.num_cached_tokens > 0) == (mode != "computed")
    return {"seconds": seconds, "pull_only_s": spread(pull_s), "pulled_bytes": pulled_bytes}


def _carried(export: PrefixExport, by_reference: bool) -> PrefixExport:
    """``export`` as another process on the node reads it from Ray's object store (by
    reference: only where its blocks are travels, pickled)."""
    if by_reference:
        return pickle.loads(pickle.dumps(export))
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(export, protocol=5, buffer_callback=buffers.append)
    stored = [bytes(b.raw()) for b in buffers]  # the put: one copy into shared memory
    return pickle.loads(data, buffers=stored)


def two_replicas(config: EngineConfig, redis_url: str, name: str, **fields: Any) -> ClusterArgs:
    """The cluster these experiments time: 2 replicas of half a CPU behind round robin."""
    return ClusterArgs(
        num_replicas=2,
        replica_num_cpus=0.5,
        engine=config,
        routing=routing_config(policy="round_robin", stats_period_s=0.5),
        index=IndexConfig(url=redis_url, cluster=name),
        **fields,
    )


def warm_client(cluster: ServeCluster, model: str) -> openai.OpenAI:
    """An ``openai`` client of ``cluster`` after a request to each replica (round robin)."""
    client = openai.OpenAI(
        base_url=f"{cluster.base_url}/v1", api_key="x", max_retries=0, timeout=120
    )
    first_token(client, model, "warm up", "hi")  # and a second: both warm
    first_token(client, model, "warm up", "hi")
    return client


def cluster_pulls(args: argparse.Namespace) -> dict[str, Any]:
    config = engine_config(args)
    with LocalRedis() as redis_server:
        pull = PullConfig(enabled=True, shared_memory=args.transport == "shared_memory")
        cluster_args = two_replicas(config, redis_server.url, "pull-bench", pull=pull)
        with ServeCluster(cluster_args, log_path=None) as cluster:
            client = warm_client(cluster, config.model_id)
            measured = {n: _pull_rounds(client, config.model_id, args, n) for n in sizes(args)}
            time.sleep(2 * 0.5 + 0.5)  # the replicas' counters, a stats period later
            stats = cluster.stats()["replicas"]
    keys = ("pulls", "pulls_shared_memory", "pulled_blocks", "pulled_bytes", "pull_seconds")
    keys += ("pulls_failed",)
    counters = {
        rid: {k: s.get(k) for k in (*keys, "pull_blocks_refused")} for rid, s in stats.items()
    }
    pulls = sum(c["pulls"] or 0 for c in counters.values())
    pull_seconds = sum(c["pull_seconds"] or 0 for c in counters.values())
    for found in measured.values():  # the counters are the whole run's
        found |= {"replica_counters": counters, "pull_s_mean": pull_seconds / max(1, pulls)}
    return measured


def _pull_rounds(
    client: openai.OpenAI, model: str, args: argparse.Namespace, tokens: int
) -> dict[str, Any]:
    """Per repeat: a new prefix computed on one replica, pulled by the other, hit locally."""
    seconds: dict[str, list[float]] = {m: [] for m in MODES}
    replicas: dict[str, list[str]] = {m: [] for m in MODES}
    cached: list[int] = []
    tokenizer = checkpoint_for(args.model).tokenizer()
    for rep in range(args.repeats):
        system = system_prompt(tokens * 1000 + rep, tokens, tokenizer)
        for mode in ("computed", "pulled", "local_hit"):  # round robin: X, Y, X
            ttft, usage, replica = first_token(client, model, system, f"Question {rep}{mode}?")
            seconds[mode].append(ttft)
            replicas[mode].append(replica)
            if mode == "pulled":
                cached.append(usage.prompt_tokens_details.cached_tokens)
            time.sleep(args.pause_s)
    assert all(a != b for a, b in zip(replicas["computed"], replicas["pulled"], strict=True))
    return {"seconds": seconds, "pulled_cached_tokens_min": min(cached), "replicas": replicas}


def system_prompt(seed: int, tokens: int, tokenizer: Any) -> str:
    """At most ``tokens`` tokens (and nearly that many) of text no other repeat shares."""
    words_in = ("alpha", "river", "stone", "policy", "garden", "signal", "copper", "window")
    rng = random.Random(seed)
    words = [rng.choice(words_in) for _ in range(tokens)]
    text = f"Prompt {seed}. " + " ".join(words)
    while len(tokenizer.encode(text)) > tokens:  # a byte tokenizer takes ~1/6 of the words
        words = words[: max(1, int(len(words) * tokens / len(tokenizer.encode(text)) - 1))]
        text = f"Prompt {seed}. " + " ".join(words)
    return text


def first_token(client: openai.OpenAI, model: str, system: str, question: str) -> tuple:
    start = time.perf_counter()
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=2,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    ttft, usage = None, None
    for chunk in raw.parse():
        if ttft is None and chunk.choices and chunk.choices[0].delta.content is not None:
            ttft = time.perf_counter() - start
        usage = chunk.usage or usage
    return ttft, usage, raw.headers.get("x-replica-id", "")
