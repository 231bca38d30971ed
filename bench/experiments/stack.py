"""``stack``: the whole cluster next to the stack a user would pick instead, on one machine.

``ours`` is ``make serve``'s cluster (``deploy/config.yaml``: 2 engine replicas of
SmolLM2-135M-Instruct, bfloat16, prefix-aware routing over Redis) on a private Ray and a
private redis-server; ``ray-llm`` is Ray Serve LLM with vLLM CPU engines, 2 replicas of one
CPU each behind Ray's ``PrefixCacheAffinityRouter`` (``bench/peers/ray_serve_llm.py``, in
vLLM's virtualenv, which this command makes); ``rev:<git rev>`` is this project's cluster
as it was at that revision (its own ``deploy/config.yaml``, from a worktree).

Both are driven by vLLM's own load generator, ``vllm bench serve``, with shared-prefix chat
traffic (its ``prefix_repetition`` dataset: ``--prefixes`` prompts of ``--prefix-len``
tokens, each request one of them and a ``--suffix-len`` unique part, ``--output-len``
tokens out, EOS ignored, greedy), Poisson arrivals at ``--rate`` with at most
``--concurrency`` in flight. Each round starts its stack, runs the trace once on empty
caches, reads the prompt tokens served from cache (our ingress's ``/metrics``; vLLM's
prefix-cache counters through Ray's metrics agent) and the memory of every engine replica,
and stops the stack. Rounds alternate the stacks, the order reversed every repeat (A B B A);
each stack's first start is cold (no compiled kernels, no compile cache), later ones warm.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.harness.launcher import REPO, ServeCluster
from bench.harness.memory import replica_memory
from bench.harness.redis_server import LocalRedis, free_port
from bench.peers.engines import (
    DEFAULT_VLLM_VENV,
    ensure_hf_folder,
    ensure_vllm_venv,
    revision_tree,
)
from cluster.config import ClusterArgs
from kvindex.config import IndexConfig
from replica.checkpoints import SMOLLM2, checkpoint_for

PEERS = Path(__file__).resolve().parents[1] / "peers"
METRICS = ("request_throughput", "output_throughput", "completed")
LATENCIES = ("ttft", "itl", "e2el")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stacks", default="ours,ray-llm", help="ours, ray-llm, rev:<git rev>")
    parser.add_argument("--repeats", type=int, default=2, help="rounds per stack (ABBA)")
    parser.add_argument("--prompts", type=int, default=120)
    parser.add_argument("--prefixes", type=int, default=6)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rate", type=float, default=4.0, help="requests/s (Poisson)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV)
    parser.add_argument("--work-dir", type=Path, default=REPO / "results" / "stack")


@dataclass
class Running:
    """A started stack: where it answers and how to read its cache counters."""

    base_url: str
    startup_s: float
    replica_title: str
    cache_counters: Callable[[], tuple[float, float]]  # (prompt tokens, of which cached)
    notes: dict[str, Any] = field(default_factory=dict)


def run(args: argparse.Namespace) -> dict[str, Any]:
    python = ensure_vllm_venv(args.vllm_venv, stack=True)
    hf = ensure_hf_folder(checkpoint_for(SMOLLM2), REPO / "results" / f"{SMOLLM2}-hf")
    names = args.stacks.split(",")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for rep in range(args.repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            cold = not rounds[name]
            with _start(name, args, python, hf, cold) as stack:
                rounds[name].append(_round(stack, args, python, hf, name, rep, cold))
    result: dict[str, Any] = {"trace": _trace_flags(args), "rounds": rounds}
    for name in names:
        result[name] = _summarise(rounds[name])
    for name in names[1:]:
        result[f"{names[0]}_over_{name}"] = _ratios(rounds[names[0]], rounds[name])
    return result


def _round(
    stack: Running,
    args: argparse.Namespace,
    python: Path,
    hf: Path,
    name: str,
    rep: int,
    cold: bool,
) -> dict[str, Any]:
    before = stack.cache_counters()
    out = args.work_dir / f"{name.replace(':', '-')}-{rep}.json"
    bench = _bench_serve(python, hf, stack.base_url, args, out)
    after = stack.cache_counters()
    prompt, cached = (a - b for a, b in zip(after, before, strict=True))
    row = {key: bench[key] for key in METRICS}
    for what in LATENCIES:
        for q in ("p50", "p99"):
            row[f"{what}_{q}_ms"] = bench[f"{q}_{what}_ms"]
    row["failed"] = bench.get("failed", args.prompts - bench["completed"])
    row["prompt_tokens"], row["cached_prompt_tokens"] = prompt, cached
    row["cached_fraction"] = cached / prompt if prompt else None
    row["startup_s"], row["cold"] = stack.startup_s, cold
    row["replicas"] = replica_memory(stack.replica_title)
    return row | stack.notes


def _trace_flags(args: argparse.Namespace) -> list[str]:
    """vLLM ``bench serve``'s flags for the trace (the same for every stack)."""
    return [
        "--backend=openai-chat",
        "--endpoint=/v1/chat/completions",
        f"--model={SMOLLM2}",
        "--dataset-name=prefix_repetition",
        f"--prefix-repetition-num-prefixes={args.prefixes}",
        f"--prefix-repetition-prefix-len={args.prefix_len}",
        f"--prefix-repetition-suffix-len={args.suffix_len}",
        f"--prefix-repetition-output-len={args.output_len}",
        f"--num-prompts={args.prompts}",
        f"--request-rate={args.rate}",
        f"--max-concurrency={args.concurrency}",
        f"--seed={args.seed}",
        "--ignore-eos",
        "--temperature=0",
        "--percentile-metrics=ttft,tpot,itl,e2el",
        "--metric-percentiles=50,99",
    ]


def _bench_serve(
    python: Path, hf: Path, base_url: str, args: argparse.Namespace, out: Path
) -> dict[str, Any]:
    command = [
        str(python),
        str(PEERS / "vllm_bench.py"),
        "bench",
        "serve",
        f"--base-url={base_url}",
        f"--tokenizer={hf}",
        *_trace_flags(args),
        "--save-result",
        f"--result-dir={out.parent}",
        f"--result-filename={out.name}",
    ]
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        done = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed; see {log}")
    return json.loads(out.read_text())


def _start(name: str, args: argparse.Namespace, python: Path, hf: Path, cold: bool) -> Any:
    if name == "ray-llm":
        return _ray_llm(args, python, hf, cold)
    if name == "ours" or name.startswith("rev:"):
        return _ours(args, name, cold)
    raise SystemExit(f"unknown stack {name!r}: ours, ray-llm or rev:<git rev>")


@contextmanager
def _ours(args: argparse.Namespace, name: str, cold: bool) -> Iterator[Running]:
    """``make serve``'s cluster: the repo's ``deploy/config.yaml`` with only the ports
    changed (a private redis-server for the index). Cold: the kernels not yet built."""
    repo = REPO if name == "ours" else revision_tree(name.removeprefix("rev:"))
    config = yaml.safe_load((repo / "deploy" / "config.yaml").read_text())
    app_args = config["applications"][0]["args"]
    kernels = Path(tempfile.mkdtemp(prefix="kernels-")) if cold else None
    saved = os.environ.get("PREFIX_SERVE_KERNEL_DIR")
    with LocalRedis() as redis:
        app_args["index"] = {**app_args.get("index", {}), "url": redis.url, "cluster": "stack"}
        current = ClusterArgs(  # what readiness reads: the index and the replica count
            num_replicas=app_args.get("num_replicas", 2),
            engine={"model": SMOLLM2},
            index=IndexConfig(url=redis.url, cluster="stack"),
        )
        if kernels is not None:
            os.environ["PREFIX_SERVE_KERNEL_DIR"] = str(kernels)
        cluster = ServeCluster(current, repo=repo, app_args=app_args)
        try:
            start = time.monotonic()
            cluster.start(timeout_s=900)
            startup = time.monotonic() - start
            yield Running(cluster.base_url, startup, "EngineReplica", _our_counters(cluster))
        finally:
            cluster.stop()
            _restore("PREFIX_SERVE_KERNEL_DIR", saved)
            if kernels is not None:
                shutil.rmtree(kernels, ignore_errors=True)


def _restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _our_counters(cluster: ServeCluster) -> Callable[[], tuple[float, float]]:
    def read() -> tuple[float, float]:
        text = httpx.get(f"{cluster.base_url}/metrics", timeout=10).text
        return (
            _counter(text, "prefix_serve_prompt_tokens_total"),
            _counter(text, "prefix_serve_cached_prompt_tokens_total"),
        )

    return read


def _counter(text: str, name: str) -> float:
    """The sum of a Prometheus counter's samples (every label set) in an exposition."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", re.M)
    return sum(float(v) for v in pattern.findall(text))


@contextmanager
def _ray_llm(args: argparse.Namespace, python: Path, hf: Path, cold: bool) -> Iterator[Running]:
    """Ray Serve LLM in vLLM's virtualenv; cold: an empty vLLM/inductor compile cache."""
    cache = args.work_dir / "ray-llm-cache"
    if cold:
        shutil.rmtree(cache, ignore_errors=True)
    port, metrics = free_port(), free_port()
    log = args.work_dir / "ray-llm-serve.log"
    command = [
        str(python),
        str(PEERS / "ray_serve_llm.py"),
        f"--model-path={hf}",
        f"--model-id={SMOLLM2}",
        f"--port={port}",
        f"--metrics-port={metrics}",
        f"--cache-dir={cache}",
        f"--temp-dir={tempfile.mkdtemp(prefix='ray-llm-')}",
    ]
    start = time.monotonic()
    with open(log, "a") as f:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=f, text=True)
    try:
        _wait_for_ready(proc)
        startup = time.monotonic() - start
        yield Running(f"http://127.0.0.1:{port}", startup, "LLMServer", _vllm_counters(metrics))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()


def _wait_for_ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("READY "):
            return
    raise RuntimeError(f"Ray Serve LLM exited (code {proc.wait()}) before it was ready")


def _vllm_counters(port: int) -> Callable[[], tuple[float, float]]:
    """vLLM's prefix-cache counters (tokens queried, tokens hit), summed over the replicas,
    from Ray's metrics agent. Ray flushes them every second; wait until two reads agree."""

    def read() -> tuple[float, float]:
        last = None
        for _ in range(30):
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            now = (
                _counter(text, "ray_vllm_prefix_cache_queries_total"),
                _counter(text, "ray_vllm_prefix_cache_hits_total"),
            )
            if now == last:
                return now
            last = now
            time.sleep(2)
        assert last is not None
        return last

    return read


def _summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median, min and max of every number over the rounds; startup cold and warm apart."""
    keys = [k for k, v in rows[0].items() if isinstance(v, int | float) and k != "cold"]
    out = {k: _spread([r[k] for r in rows if r[k] is not None]) for k in keys}
    out.pop("startup_s", None)
    out["startup_cold_s"] = [r["startup_s"] for r in rows if r["cold"]]
    out["startup_warm_s"] = [r["startup_s"] for r in rows if not r["cold"]]
    out["replica_rss_mib"] = _spread([m["rss_mib"] for r in rows for m in r["replicas"]])
    out["replica_pss_mib"] = _spread([m["pss_mib"] for r in rows for m in r["replicas"]])
    return out


def _ratios(ours: list[dict[str, Any]], peer: list[dict[str, Any]]) -> dict[str, Any]:
    """Round by round (the pairs that ran back to back): ours over the peer's."""
    keys = ["request_throughput", "output_throughput"] + [
        f"{w}_{q}_ms" for w in LATENCIES for q in ("p50", "p99")
    ]
    return {k: _spread([a[k] / b[k] for a, b in zip(ours, peer, strict=True)]) for k in keys}


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}
