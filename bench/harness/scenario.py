"""The scaffold of a fault scenario: a fresh cluster with its own Redis, a load thread
driving it, and what every scenario reports (request counts and the replicas' idle audit)."""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import httpx

from bench.harness.launcher import ServeCluster
from bench.harness.redis_server import LocalRedis
from bench.loadgen import RequestResult, drive
from bench.workloads import TraceRequest, WorkloadSpec, fast_engine, make_trace
from cluster.config import ClusterArgs
from kvindex.config import IndexConfig
from kvindex.measure import percentile
from kvindex.reader import IndexReader
from replica.checkpoints import TINY_MODEL


class Scenario:
    """One fresh cluster with its own Redis, and the load thread driving it."""

    def __init__(
        self,
        max_queued_requests: int = -1,
        num_replicas: int = 2,
        index: dict[str, Any] | None = None,
        ingress_replicas: int = 1,
    ) -> None:
        self.redis = LocalRedis().start()
        index_config = IndexConfig(url=self.redis.url, cluster="faults", **(index or {}))
        self.args = ClusterArgs(
            num_replicas=num_replicas,
            replica_num_cpus=min(0.5, 1.5 / num_replicas),
            ingress_replicas=ingress_replicas,
            ingress_num_cpus=0.1 / ingress_replicas,
            engine=fast_engine(TINY_MODEL, num_blocks=640),
            max_queued_requests=max_queued_requests,
            index=index_config,
        )
        self.cluster = ServeCluster(self.args, dashboard=True).start()  # ``scale``
        # the harness's own reads wait longer than a router's 250 ms: on 2 busy cores a
        # timeout here would abort the scenario, not measure it
        watch = self.args.index.model_copy(update={"timeout_s": 2.0, "connect_timeout_s": 2.0})
        self.index = IndexReader(watch, self.args.engine.model_id)
        self.results: list[RequestResult] = []
        self._thread: threading.Thread | None = None

    def load(self, trace: list[TraceRequest]) -> None:
        def run() -> None:
            self.results, _ = drive(self.cluster.base_url, self.args.engine.model_id, trace, 120)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def wait_load(self, timeout_s: float = 300.0) -> None:
        assert self._thread is not None
        self._thread.join(timeout_s)

    def stats(self) -> dict[str, dict[str, Any]]:
        if not self.redis.running:
            return {}
        return self.index.replica_stats()

    def idle_audit(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """Wait until every replica is idle and has audited its blocks since; report."""
        since = time.time()
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            fresh = [s for s in stats.values() if s["time"] > since + 1.0]
            idle = len(fresh) >= self.args.num_replicas and all(
                s["num_running"] == s["num_waiting"] == s["blocks_in_use"] == 0 for s in fresh
            )
            if idle or time.monotonic() > deadline:
                return {
                    "replicas_idle": idle,
                    "blocks_in_use": sum(s["blocks_in_use"] for s in fresh),
                    "accounting_ok": idle and all(_audited(s) for s in fresh),
                    "audit_errors": [s["audit_error"] for s in fresh if s["audit_error"]],
                    "replicas": {s["replica_id"]: {k: s.get(k) for k in AUDIT_KEYS} for s in fresh},
                }
            time.sleep(0.5)

    def report(self, trace: list[TraceRequest], **extra: Any) -> dict[str, Any]:
        """What every scenario reports: request counts, its own findings, the idle audit."""
        return counts(self.results, len(trace)) | extra | self.idle_audit()

    def close(self, failed: bool = False) -> None:
        self.cluster.stop(keep_logs=failed)
        self.redis.close()

    def __enter__(self) -> Scenario:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        self.close(failed=exc_type is not None)


AUDIT_KEYS = ("blocks_free", "blocks_cached", "blocks_total", "idle_audits", "num_finished")


def _audited(stats: dict[str, Any]) -> bool:
    """Whole accounting, checked by the replica itself since it last served; a replica
    that never served a request (one Serve started late) has nothing to audit yet."""
    served = stats["num_finished"] + stats["num_aborted"] > 0
    return (
        stats["blocks_free"] + stats["blocks_cached"] == stats["blocks_total"]
        and stats["audit_error"] is None
        and (stats["idle_audits"] > 0 or not served)
    )


def counts(results: list[RequestResult], expected: int) -> dict[str, Any]:
    ok = [r for r in results if r.status == 200 and r.error is None]
    failed = [r for r in results if not (r.status == 200 and r.error is None)]
    return {
        "requests": expected,
        "ok": len(ok),
        "failed": len(failed),
        "lost": expected - len(results),  # never answered at all
        "failure_kinds": sorted({(r.error or str(r.status))[:100] for r in failed})[:5],
        "ttft_p50_s": percentile([r.ttft_s for r in ok if r.ttft_s is not None], 50),
        "ttft_p99_s": percentile([r.ttft_s for r in ok if r.ttft_s is not None], 99),
    }


def fault_trace(rate: float, duration_s: float, workload: str = "multi_tenant", seed: int = 7):
    return make_trace(
        WorkloadSpec(
            workload,
            num_requests=int(rate * duration_s),
            rate=rate,
            seed=seed,
            tenants=24,
            zipf=0.6,
        )
    )


def wait_for(condition: Callable[[], bool], timeout_s: float) -> float | None:
    """Seconds until ``condition`` held, or None if it never did within the timeout."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if condition():
            return time.monotonic() - start
        time.sleep(0.2)
    return None


def index_answers_by_ingress(base_url: str) -> dict[str, dict[str, float]]:
    """Each ingress's decisions by index outcome (``answered``, ``mirror``, ``unknown``),
    from one scrape (with several ingress replicas every one's series are in it)."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    found: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if line.startswith("prefix_serve_index_answers_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
            outcomes = found.setdefault(labels.get("ingress", ""), {})
            outcomes[labels["outcome"]] = float(line.split()[-1])
    return found


def gauge_by_ingress(base_url: str, name: str) -> dict[str, float]:
    """An unlabelled router gauge (e.g. ``prefix_serve_index_mirror_synced_at_seconds``),
    per ingress, from one scrape."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
            found[labels.get("ingress", "")] = float(line.split()[-1])
    return found


def index_answers(base_url: str) -> float:
    """Decisions the index answered: from the router's mirror, or from Redis."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    answered = 0.0
    for line in text.splitlines():
        for outcome in ("answered", "mirror"):
            if line.startswith("prefix_serve_index_answers_total{") and (
                f'outcome="{outcome}"' in line  # summed over ingress replicas' labels
            ):
                answered += float(line.split()[-1])
    return answered


def probe(base_url: str, model: str, n: int) -> list[RequestResult]:
    trace = [
        TraceRequest(f"probe-{i}", 0.05 * i, f"probe {i} {os.urandom(8).hex()} " * 3, 4)
        for i in range(n)
    ]
    results, _ = drive(base_url, model, trace, 60)
    return results


def resume_counts(base_url: str) -> dict[str, float]:
    """The ingress's resume counters: ``resumed`` and ``given_up`` (after max_resumes)."""
    counts = {"resumed": 0.0, "given_up": 0.0}
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("prefix_serve_resumed_requests_total{"):
            for outcome in counts:
                if f'outcome="{outcome}"' in line:
                    counts[outcome] += float(line.split()[-1])
    return counts


def phased_trace(
    workload: str,
    phases: Sequence[tuple[float, float]],
    seed: int,
    output_tokens: tuple[int, int],
    **spec: Any,
) -> list[TraceRequest]:
    """``workload`` with its arrival rate constant within each phase (seconds, rate): each
    phase a trace of its own (seed ``seed + k``), its ids prefixed ``p<k>-``, cut at the
    phase's end and shifted to its start. ``spec``: the workload's other ``WorkloadSpec``
    fields."""
    trace: list[TraceRequest] = []
    start = 0.0
    for k, (seconds, rate) in enumerate(phases):
        part = make_trace(
            WorkloadSpec(
                workload,
                num_requests=max(1, int(seconds * rate)),
                rate=rate,
                seed=seed + k,
                output_tokens=output_tokens,
                **spec,
            )
        )
        trace += [
            replace(r, request_id=f"p{k}-{r.request_id}", arrival_s=start + r.arrival_s)
            for r in part
            if r.arrival_s < seconds
        ]
        start += seconds
    return trace
