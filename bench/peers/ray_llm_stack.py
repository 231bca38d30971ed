"""Ray Serve LLM as a stack for the ``stack`` experiment, started from our interpreter.

``ray_serve_llm.py`` runs in vLLM's virtualenv (it imports ``ray.serve.llm`` and vLLM); this
module starts it as a subprocess, waits for its ``READY`` line and reads vLLM's prefix-cache
counters through Ray's metrics agent. Its engines get what vLLM's CPU documentation asks for
(``bench.peers.host``): TCMalloc and Intel OpenMP preloaded, each replica's OpenMP threads
bound to a physical core of its own. It runs inside ``shm_sweep``: stopping it leaves vLLM's
shared-memory queues in ``/dev/shm`` (Ray LLM 2.60's engine shutdown does not stop vLLM's
engine core, and Ray kills a dead actor's child processes, the resource tracker that would
unlink them among them), and the sweep removes them once its processes are gone.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from bench.harness.memory import shm_sweep
from bench.harness.redis_server import LocalRedis, free_port
from bench.harness.stacks import Counters, Running, prometheus_total
from bench.peers.host import PRELOADS, physical_cores, vllm_preload
from replica.checkpoints import SMOLLM2
from replica.model.cpu import resolve_dtype

SCRIPT = Path(__file__).resolve().parent / "ray_serve_llm.py"
REPLICAS = 2  # of one CPU each (ray_serve_llm.py's default)
# What a KV-aware router needs of Ray 2.60 (``kv``, ``ours``): its LLM ingress tokenizes a
# request and hands the router the prompt's token ids only with direct streaming (HAProxy in
# front, asking the ingress's ``/internal/route`` where to send each request), and HAProxy
# sends that route call the request's body only when told to; without the last one every
# route call is body-less and a KV-aware router routes blind (Ray's falls back to a random
# replica: what this benchmark measured as ``ray_llm:kv`` before it was set).
KV_AWARE_ENV = {
    "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1",
}


@contextmanager
def ray_llm(
    python: Path,
    hf: Path,
    work_dir: Path,
    cold: bool,
    preload: Iterable[str] = PRELOADS,
    router: str = "prefix",
    engine_kwargs: dict[str, Any] | None = None,
    routing: dict[str, Any] | None = None,
    max_ongoing_requests: int | None = None,
) -> Iterator[Running]:
    """Ray Serve LLM in vLLM's virtualenv, in the dtype ``make serve``'s cluster serves on
    this CPU (``dtype: auto``); cold: an empty vLLM/inductor compile cache. What stopping
    it left in ``/dev/shm`` is removed, and counted in ``Running.stopped``. ``router``:
    ``ray_serve_llm.py --router`` (``kv`` and ``ours`` run Ray's direct streaming, the
    path on which its ingress hands the router token ids; ``ours`` gets a redis-server of
    its own for the index). ``engine_kwargs``: vLLM engine arguments on top (a ``dtype``
    among them replaces the one ``auto`` picks). ``routing``: router ``ours``'s routing
    fields (``RoutingConfig``: its cost model's knobs). ``max_ongoing_requests``: per
    replica (``ray_serve_llm.py``'s default, 64, when None)."""
    cache = work_dir / "ray-llm-cache"
    if cold:
        shutil.rmtree(cache, ignore_errors=True)
    cores = physical_cores()[:REPLICAS]
    libs = ":".join(vllm_preload(python, preload))
    kwargs = dict(engine_kwargs or {})
    dtype = kwargs.pop("dtype", str(resolve_dtype("auto")).removeprefix("torch."))
    given = {
        "ld_preload": libs,
        "omp_threads_bind_per_replica": [str(c) for c in cores],
        "dtype": dtype,
        "router": router,
        "engine_kwargs": kwargs,
    }
    flags = [f"--preload={libs}", f"--dtype={dtype}", f"--router={router}"]
    flags.append(f"--engine-kwargs={json.dumps(kwargs)}")
    if routing:
        flags.append(f"--routing={json.dumps(routing)}")
        given["routing"] = routing
    if max_ongoing_requests is not None:
        flags.append(f"--max-ongoing-requests={max_ongoing_requests}")
        given["max_ongoing_requests"] = max_ongoing_requests
    with (
        shm_sweep() as sweep,
        LocalRedis() as redis,
        _serve(python, hf, work_dir, cache, cores, flags, redis.url) as running,
    ):
        running.notes["peer_given"] = given
        running.notes["index_url"] = redis.url  # where router ``ours`` keeps its index
        yield running  # the sweep is left last: after the script and its Ray have exited
    running.stopped |= sweep.summary()


@contextmanager
def _serve(
    python: Path,
    hf: Path,
    work_dir: Path,
    cache: Path,
    cores: list[int],
    flags: list[str],
    index_url: str,
) -> Iterator[Running]:
    """Start the script, yield the stack, stop it (SIGTERM: the script stops its Ray)."""
    port, metrics = free_port(), free_port()
    command = [
        str(python),
        str(SCRIPT),
        f"--model-path={hf}",
        f"--model-id={SMOLLM2}",
        f"--port={port}",
        f"--metrics-port={metrics}",
        f"--cache-dir={cache}",
        f"--temp-dir={tempfile.mkdtemp(prefix='ray-llm-')}",
        f"--replicas={REPLICAS}",
        f"--cores={','.join(str(c) for c in cores)}",
        *flags,
        f"--index-url={index_url}",
    ]
    env = dict(os.environ)
    if "--router=kv" in flags or "--router=ours" in flags:
        env |= KV_AWARE_ENV
    start = time.monotonic()
    with open(work_dir / "ray-llm-serve.log", "a") as f:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=f, text=True, env=env)
    try:
        _wait_for_ready(proc)
        startup = time.monotonic() - start
        yield Running(f"http://127.0.0.1:{port}", startup, "LLMServer", _counters(metrics))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_for_ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("READY "):
            return
    raise RuntimeError(f"Ray Serve LLM exited (code {proc.wait()}) before it was ready")


def _counters(port: int) -> Counters:
    """vLLM's prefix-cache counters (tokens queried, tokens hit), summed over the replicas,
    from Ray's metrics agent. Ray flushes them every second; wait until two reads agree."""

    def read() -> tuple[float, float]:
        last = None
        for _ in range(30):
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            now = (
                prometheus_total(text, "ray_vllm_prefix_cache_queries_total"),
                prometheus_total(text, "ray_vllm_prefix_cache_hits_total"),
            )
            if now == last:
                return now
            last = now
            time.sleep(2)
        assert last is not None
        return last

    return read
