"""``autoscale``: the engine deployment follows a load that rises and falls (Ray Serve's
``autoscaling_config``), and routing and the index stay correct while replicas come and go.

One cluster with its own Redis, ``min_replicas`` 1 to ``max_replicas`` 3. The load is the
multi-tenant trace in phases of constant rate (``--phases``, "seconds:rate,..."). Every
second the index's live replicas are sampled; every request's arrival, TTFT, cached tokens
and replica are kept. Per ``--window-s`` window: the arrival rate, replicas (mean of the
samples), hit rate and TTFT p50 of the requests that arrived in it, and the share of them
served by replicas added after the start. JSON, a Markdown table and a PNG (four panels).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis

from bench.harness.launcher import ServeCluster
from bench.harness.redis_server import LocalRedis
from bench.harness.scenario import counts, phased_trace
from bench.loadgen import RequestResult, drive
from bench.workloads import TraceRequest, fast_engine
from cluster.config import Autoscaling, ClusterArgs
from kvindex.config import IndexConfig
from kvindex.measure import percentile
from kvindex.reader import IndexReader
from replica.checkpoints import TINY_MODEL


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--phases", default="40:0.5,80:5,80:0.5", help="seconds:rate,...")
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--max-replicas", type=int, default=3)
    parser.add_argument("--target-ongoing", type=float, default=2.0)
    parser.add_argument("--output-tokens", default="48,96", help="min,max per request")
    parser.add_argument("--tenants", type=int, default=24)
    parser.add_argument("--seed", type=int, default=7)


def multi_tenant_phases(
    phases: list[tuple[float, float]], args: argparse.Namespace
) -> list[TraceRequest]:
    """The multi-tenant trace, its arrival rate constant within each phase."""
    low, high = (int(x) for x in args.output_tokens.split(","))
    return phased_trace(
        "multi_tenant", phases, args.seed, (low, high), tenants=args.tenants, zipf=0.6
    )


@dataclass
class Sample:
    t: float
    live: set[str]  # replicas live in the index (registered, heartbeat current)
    running: int | None  # the engine deployment's replicas Serve reports RUNNING
    target: int | None  # and the number the autoscaler wants


class ReplicaSampler(threading.Thread):
    """Once a second: the index's live replicas and Serve's own view (its REST API)."""

    def __init__(self, index: IndexReader, dashboard: str) -> None:
        super().__init__(daemon=True)
        self.index = index
        self.dashboard = dashboard
        self.samples: list[Sample] = []
        self.stop = threading.Event()
        self.start_time = time.monotonic()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            try:
                live = set(self.index.live_replicas())
            except redis.RedisError:  # a busy machine: this second goes unsampled
                continue
            running, target = self._serve_view()
            self.samples.append(Sample(time.monotonic() - self.start_time, live, running, target))

    def _serve_view(self) -> tuple[int | None, int | None]:
        try:
            apps = httpx.get(f"{self.dashboard}/api/serve/applications/", timeout=2).json()
            engine = apps["applications"]["llm"]["deployments"]["EngineReplica"]
        except (httpx.HTTPError, KeyError, ValueError):
            return None, None
        running = sum(r.get("state") == "RUNNING" for r in engine.get("replicas", []))
        return running, engine.get("target_num_replicas")


def run(args: argparse.Namespace) -> dict[str, Any]:
    phases = [(float(s), float(r)) for s, r in (p.split(":") for p in args.phases.split(","))]
    trace = multi_tenant_phases(phases, args)
    with LocalRedis() as redis_server:
        cluster_args = ClusterArgs(
            autoscaling=Autoscaling(
                min_replicas=1,
                max_replicas=args.max_replicas,
                target_ongoing_requests=args.target_ongoing,
                upscale_delay_s=3.0,
                downscale_delay_s=15.0,
                metrics_interval_s=1.0,
                look_back_period_s=5.0,
            ),
            replica_num_cpus=min(0.5, 1.5 / args.max_replicas),
            engine=fast_engine(TINY_MODEL, num_blocks=640),
            index=IndexConfig(url=redis_server.url, cluster="autoscale"),
        )
        with ServeCluster(cluster_args, dashboard=True) as cluster:
            # the experiment's own client: patient, unlike the routers' 250 ms
            patient = cluster_args.index.model_copy(update={"timeout_s": 2.0})
            index = IndexReader(patient, cluster_args.engine.model_id)
            initial = set(index.live_replicas())
            sampler = ReplicaSampler(index, cluster.dashboard_url())
            sampler.start()
            results, _ = drive(cluster.base_url, cluster_args.engine.model_id, trace, 300)
            time.sleep(30)  # the downscale delay passes with no load: back to one replica
            sampler.stop.set()
            sampler.join()
            final = set(index.live_replicas())
            index.close()
    windows = per_window(trace, results, sampler.samples, initial, args.window_s)
    result = {
        "phases": phases,
        "requests": counts(results, len(trace)),
        "initial_replicas": len(initial),
        "max_live_replicas": max(len(s.live) for s in sampler.samples),
        "max_serve_replicas": max((s.running or 0) for s in sampler.samples),
        "final_replicas": len(final),
        "windows": windows,
        "conditions": {k: v for k, v in vars(args).items() if k != "out"},
    }
    write(args.out or Path("results/autoscale"), result)
    return result


def per_window(
    trace: list[TraceRequest],
    results: list[RequestResult],
    samples: list[Sample],
    initial: set[str],
    window_s: float,
) -> list[dict[str, Any]]:
    """Rate, replicas, hit rate, TTFT p50 and the new replicas' share, per arrival window."""
    end = max([r.arrival_s for r in trace] + [s.t for s in samples])
    windows = []
    for w in range(int(end // window_s) + 1):
        lo, hi = w * window_s, (w + 1) * window_s
        pairs = [(q, r) for q, r in zip(trace, results, strict=True) if lo <= q.arrival_s < hi]
        ok = [r for _, r in pairs if r.status == 200]
        inside = [s for s in samples if lo <= s.t < hi]
        live = [len(s.live) for s in inside]
        running = [s.running for s in inside if s.running is not None]
        prompt = sum(r.prompt_tokens for r in ok)
        windows.append(
            {
                "start_s": lo,
                "rate": len(pairs) / window_s,
                "replicas": sum(running) / len(running) if running else None,
                "index_live_replicas": sum(live) / len(live) if live else None,
                "hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else None,
                "ttft_p50_s": percentile([r.ttft_s for r in ok if r.ttft_s is not None], 50),
                "served_by_new_replicas": (
                    sum(r.replica not in initial for r in ok) / len(ok) if ok else None
                ),
                "failed": len(pairs) - len(ok),
            }
        )
    return windows


def markdown(result: dict[str, Any]) -> str:
    rows = [
        "| window start s | arrivals/s | replicas (Serve) | live in index | hit rate |"
        " TTFT p50 s | on new replicas |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for w in result["windows"]:
        cells = [w["start_s"], w["rate"], w["replicas"], w["index_live_replicas"]]
        cells += [w["hit_rate"], w["ttft_p50_s"], w["served_by_new_replicas"]]
        rows.append("| " + " | ".join(_fmt(c) for c in cells) + " |")
    return "\n".join(rows) + "\n"


def plot(path: Path, result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    windows = result["windows"]
    x = [w["start_s"] for w in windows]
    panels = [
        ("rate", "arrivals / s"),
        ("replicas", "live replicas"),
        ("hit_rate", "hit rate"),
        ("ttft_p50_s", "TTFT p50 (s)"),
    ]
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 8), sharex=True)
    for ax, (key, label) in zip(axes, panels, strict=True):
        ax.step(
            x, _series(windows, key), where="post", label="Serve" if key == "replicas" else None
        )
        if key == "replicas":
            ax.step(
                x, _series(windows, "index_live_replicas"), where="post", label="index", ls="--"
            )
            ax.legend(loc="upper right")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("time (s), 10 s windows by arrival")
    fig.suptitle("Autoscaling 1 -> 3 -> 1 replicas under a rising and falling load")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(out: Path, result: dict[str, Any]) -> None:
    """``out`` is a folder: autoscale.json, autoscale.md, autoscale.png."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "autoscale.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out / "autoscale.md").write_text(markdown(result))
    plot(out / "autoscale.png", result)


def _series(windows: list[dict[str, Any]], key: str) -> list[float]:
    return [w[key] if w[key] is not None else float("nan") for w in windows]


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if isinstance(value, float) else str(value)
