"""Ray Serve LLM as a stack for the ``stack`` experiment, started from our interpreter.

``ray_serve_llm.py`` runs in vLLM's virtualenv (it imports ``ray.serve.llm`` and vLLM); this
module starts it as a subprocess, waits for its ``READY`` line and reads vLLM's prefix-cache
counters through Ray's metrics agent.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from bench.harness.redis_server import free_port
from bench.harness.stacks import Counters, Running, prometheus_total
from replica.checkpoints import SMOLLM2

SCRIPT = Path(__file__).resolve().parent / "ray_serve_llm.py"


@contextmanager
def ray_llm(python: Path, hf: Path, work_dir: Path, cold: bool) -> Iterator[Running]:
    """Ray Serve LLM in vLLM's virtualenv; cold: an empty vLLM/inductor compile cache."""
    cache = work_dir / "ray-llm-cache"
    if cold:
        shutil.rmtree(cache, ignore_errors=True)
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
    ]
    start = time.monotonic()
    with open(work_dir / "ray-llm-serve.log", "a") as f:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=f, text=True)
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
