"""A serving stack started for a whole-stack measurement, and this project's own.

``Running`` is what the ``stack`` experiment needs of any stack: where it answers, how long
it took to start, which processes are its engine replicas (by title, for their memory), how
to read its prompt-token cache counters, and what stopping it found (``stopped``: what it
left behind, filled when its context exits). ``ours`` starts ``make serve``'s cluster.
"""

from __future__ import annotations

import os
import re
import shutil
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
from bench.harness.redis_server import LocalRedis
from bench.peers.engines import revision_tree
from cluster.config import ClusterArgs
from kvindex.config import IndexConfig
from replica.checkpoints import SMOLLM2

Counters = Callable[[], tuple[float, float]]  # (prompt tokens, of which served from cache)


@dataclass
class Running:
    """A started stack: where it answers and how to read its cache counters."""

    base_url: str
    startup_s: float
    replica_title: str
    cache_counters: Counters
    notes: dict[str, Any] = field(default_factory=dict)
    stopped: dict[str, Any] = field(default_factory=dict)  # filled once it has stopped


def prometheus_total(text: str, name: str) -> float:
    """The sum of a Prometheus counter's samples (every label set) in an exposition."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", re.M)
    return sum(float(v) for v in pattern.findall(text))


@contextmanager
def ours(name: str, cold: bool, vllm: tuple[Path, Path] | None = None) -> Iterator[Running]:
    """``make serve``'s cluster (``name`` is ``ours`` or ``rev:<git rev>``): that tree's
    ``deploy/config.yaml`` with only the ports changed (a private redis-server for the
    index). Cold: the kernels not yet built. ``vllm``: (vLLM's interpreter, the model's
    Hugging Face folder): ``make serve-vllm``'s cluster instead (``deploy/vllm.yaml``, run
    by that interpreter, the folder in place of the one ``make install-vllm`` writes)."""
    repo = REPO if name in ("ours", "ours-vllm") else revision_tree(name.removeprefix("rev:"))
    config_file = "vllm.yaml" if vllm else "config.yaml"
    config = yaml.safe_load((repo / "deploy" / config_file).read_text())
    app_args = config["applications"][0]["args"]
    if vllm:
        app_args["engine"]["model"] = str(vllm[1])
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
        python = vllm[0] if vllm else None
        cluster = ServeCluster(current, repo=repo, app_args=app_args, python=python)
        try:
            start = time.monotonic()
            cluster.start(timeout_s=900)
            startup = time.monotonic() - start
            title = "VLLMReplica" if vllm else "EngineReplica"
            yield Running(cluster.base_url, startup, title, _counters(cluster))
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


def _counters(cluster: ServeCluster) -> Counters:
    def read() -> tuple[float, float]:
        text = httpx.get(f"{cluster.base_url}/metrics", timeout=10).text
        return (
            prometheus_total(text, "prefix_serve_prompt_tokens_total"),
            prometheus_total(text, "prefix_serve_cached_prompt_tokens_total"),
        )

    return read
