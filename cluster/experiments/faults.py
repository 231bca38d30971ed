"""``faults``: the real cluster under faults, overload and a soak, with a JSON + Markdown report.

Scenarios (``--scenarios``, all by default), each on a fresh cluster (``cache_aware``):

* ``redis_kill``: Redis is killed under streaming load and restarted empty.
* ``replica_kill``: one engine replica's process is killed (SIGKILL) under load.
* ``redis_slow``: Redis stalls (``DEBUG SLEEP``) again and again under load.
* ``overload``: open-loop load far above capacity.
* ``soak``: mixed workloads for ``--soak-s`` seconds.

Each reports requests ok / failed / lost (never answered), recovery times, and what the
replicas' own audits say about their block accounting once idle.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import redis

from cluster.config import ClusterArgs, IndexConfig
from cluster.index import BlockIndex
from cluster.launcher import ServeCluster
from cluster.loadgen import RequestResult, drive
from cluster.redis_server import LocalRedis
from cluster.workloads import TraceRequest, WorkloadSpec, make_trace
from replica.config import EngineConfig
from replica.metrics import percentile

SCENARIOS = ("redis_kill", "replica_kill", "redis_slow", "overload", "soak")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--rate", type=float, default=4.0, help="load during faults, per s")
    parser.add_argument("--duration-s", type=float, default=25.0, help="load per fault scenario")
    parser.add_argument("--soak-s", type=float, default=120.0)
    parser.add_argument("--soak-rate", type=float, default=1.5, help="below capacity, per s")


class Scenario:
    """One fresh cluster with its own Redis, and the load thread driving it."""

    def __init__(self, max_queued_requests: int = -1) -> None:
        self.redis = LocalRedis().start()
        self.args = ClusterArgs(
            engine=EngineConfig(num_threads=1, num_blocks=640),
            max_queued_requests=max_queued_requests,
            index=IndexConfig(url=self.redis.url, cluster="faults"),
        )
        self.cluster = ServeCluster(self.args).start()
        self.index = BlockIndex(self.args.index, self.args.engine.model_id)
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
                s["running"] == s["waiting"] == s["blocks_in_use"] == 0 for s in fresh
            )
            if idle or time.monotonic() > deadline:
                return {
                    "replicas_idle": idle,
                    "blocks_in_use": sum(s["blocks_in_use"] for s in fresh),
                    "accounting_ok": idle
                    and all(
                        s["blocks_free"] + s["blocks_cached"] == s["blocks_total"]
                        and s["audit_error"] is None
                        and s["idle_audits"] > 0
                        for s in fresh
                    ),
                    "audit_errors": [s["audit_error"] for s in fresh if s["audit_error"]],
                }
            time.sleep(0.5)

    def close(self) -> None:
        self.cluster.stop()
        self.redis.__exit__(None, None, None)


def counts(results: list[RequestResult], expected: int) -> dict[str, Any]:
    ok = [r for r in results if r.status == 200 and r.error is None]
    failed = [r for r in results if r not in ok]
    return {
        "requests": expected,
        "ok": len(ok),
        "failed": len(failed),
        "lost": expected - len(results),  # never answered at all
        "failure_kinds": sorted({(r.error or str(r.status))[:100] for r in failed})[:5],
        "ttft_p50_s": percentile([r.ttft_s for r in ok if r.ttft_s is not None], 50),
        "ttft_p99_s": percentile([r.ttft_s for r in ok if r.ttft_s is not None], 99),
    }


def _trace(rate: float, duration_s: float, workload: str = "multi_tenant", seed: int = 7):
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


def _wait(condition: Callable[[], bool], timeout_s: float) -> float | None:
    """Seconds until ``condition`` held, or None if it never did within the timeout."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if condition():
            return time.monotonic() - start
        time.sleep(0.2)
    return None


def redis_kill(args: argparse.Namespace) -> dict[str, Any]:
    s = Scenario()
    try:
        trace = _trace(args.rate, args.duration_s)
        s.load(trace)
        time.sleep(args.duration_s * 0.25)
        s.redis.stop()
        time.sleep(args.duration_s * 0.3)
        s.redis.start()  # empty: every registration and block entry is gone
        restarted = time.monotonic()

        def rebuilt() -> bool:  # every replica re-registered and republished its blocks
            stats = s.stats()
            return len(stats) >= s.args.num_replicas and all(
                st["index_in_sync"] and st["time"] > time.time() - 1 and s.index.replica_blocks(r)
                for r, st in stats.items()
            )

        recovery = _wait(rebuilt, 60)
        s.wait_load()
        answered = _index_answers(s.cluster.base_url)
        _probe(s.cluster.base_url, s.args.engine.model_id, 4)
        resumed = _index_answers(s.cluster.base_url) > answered
        return (
            counts(s.results, len(trace))
            | {
                "index_rebuilt_s": recovery,
                "cache_aware_resumed": resumed,
                "index_blocks_after": {rid: len(s.index.replica_blocks(rid)) for rid in s.stats()},
                "since_restart_s": time.monotonic() - restarted,
            }
            | s.idle_audit()
        )
    finally:
        s.close()


def replica_kill(args: argparse.Namespace) -> dict[str, Any]:
    s = Scenario()
    try:
        trace = _trace(args.rate, args.duration_s)
        s.load(trace)
        time.sleep(args.duration_s * 0.3)
        before = s.stats()
        victim, victim_stats = sorted(before.items())[0]
        os.kill(victim_stats["pid"], signal.SIGKILL)
        killed = time.monotonic()
        purged = _wait(lambda: victim not in s.index.live_replicas(), 30)
        reaped = _wait(lambda: not s.index.replica_blocks(victim), 60)
        replaced = _wait(
            lambda: len(set(s.index.live_replicas()) - {victim}) >= s.args.num_replicas, 120
        )
        s.wait_load()
        served_by = {r.replica for r in _probe(s.cluster.base_url, s.args.engine.model_id, 12)}
        new_ids = set(s.index.live_replicas()) - set(before)
        return (
            counts(s.results, len(trace))
            | {
                "killed_replica": victim,
                "left_index_answers_s": purged,
                "blocks_purged_s": reaped,
                "replacement_registered_s": replaced,
                "replacement_epoch_new": bool(new_ids),
                "replacement_gets_traffic": bool(new_ids & served_by),
                "whole_after_s": time.monotonic() - killed if replaced is not None else None,
            }
            | s.idle_audit()
        )
    finally:
        s.close()


def redis_slow(args: argparse.Namespace) -> dict[str, Any]:
    s = Scenario()
    try:
        trace = _trace(args.rate, args.duration_s)
        stop = threading.Event()

        def stall() -> None:
            client = redis.Redis.from_url(s.redis.url)
            while not stop.is_set():
                client.execute_command("DEBUG", "SLEEP", "0.5")
                time.sleep(0.1)

        staller = threading.Thread(target=stall, daemon=True)
        s.load(trace)
        time.sleep(args.duration_s * 0.2)
        staller.start()
        time.sleep(args.duration_s * 0.5)
        stop.set()
        staller.join()
        s.wait_load()
        route = s.cluster.stats()
        return (
            counts(s.results, len(trace))
            | {
                "route_p50_ms": (route["decision_p50_s"] or 0) * 1e3,
                "route_p99_ms": (route["decision_p99_s"] or 0) * 1e3,
            }
            | s.idle_audit()
        )
    finally:
        s.close()


def overload(args: argparse.Namespace) -> dict[str, Any]:
    s = Scenario(max_queued_requests=32)
    try:
        rss_before = {r: st["rss_mb"] for r, st in s.stats().items()}
        trace = _trace(40.0, 10.0, workload="chat", seed=3)
        s.load(trace)
        s.wait_load()
        shed = [r for r in s.results if r.status == 503]
        accepted = [r for r in s.results if r.status == 200]
        rss_after = {r: st["rss_mb"] for r, st in s.stats().items()}
        return (
            counts(s.results, len(trace))
            | {
                "offered_per_s": 40.0,
                "shed_503": len(shed),
                "shed_latency_p99_s": percentile([r.latency_s for r in shed if r.latency_s], 99),
                "accepted_latency_p99_s": percentile(
                    [r.latency_s for r in accepted if r.latency_s], 99
                ),
                "replica_rss_mb_before": rss_before,
                "replica_rss_mb_after": rss_after,
            }
            | s.idle_audit()
        )
    finally:
        s.close()


def soak(args: argparse.Namespace) -> dict[str, Any]:
    s = Scenario()
    try:
        rate = args.soak_rate / 3
        traces = [
            _trace(rate, args.soak_s, workload=w, seed=i)
            for i, w in enumerate(("multi_tenant", "multi_turn", "random"))
        ]
        merged = sorted(
            (
                TraceRequest(f"{i}-{r.request_id}", r.arrival_s, r.prompt, r.max_tokens, r.group)
                for i, t in enumerate(traces)
                for r in t
            ),
            key=lambda r: r.arrival_s,
        )
        s.load(merged)
        s.wait_load(args.soak_s + 300)
        return counts(s.results, len(merged)) | {"duration_s": args.soak_s} | s.idle_audit()
    finally:
        s.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = args.out or Path("results/faults")
    runners = {f.__name__: f for f in (redis_kill, replica_kill, redis_slow, overload, soak)}
    report: dict[str, Any] = {}
    for name in args.scenarios.split(","):
        t0 = time.monotonic()
        try:
            report[name] = runners[name](args)
        except Exception as exc:  # a scenario that cannot run is reported, not dropped
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
        report[name]["scenario_s"] = time.monotonic() - t0
    out.mkdir(parents=True, exist_ok=True)
    (out / "faults.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "faults.md").write_text(markdown(report) + "\n")
    return report


def markdown(report: dict[str, Any]) -> str:
    lines = ["# Faults, overload and soak on the real cluster", ""]
    lines += ["| scenario | ok | failed | lost | recovery | accounting | notes |"]
    lines += ["| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in report.items():
        if "error" in r and "ok" not in r:
            lines.append(f"| {name} | - | - | - | - | - | could not run: {r['error']} |")
            continue
        recovery = _recovery(name, r)
        lines.append(
            f"| {name} | {r['ok']} | {r['failed']} | {r['lost']} | {recovery} | "
            f"{'ok' if r.get('accounting_ok') else 'NOT OK'} | "
            f"{'; '.join(r.get('failure_kinds', []))[:200]} |"
        )
    return "\n".join(lines)


def _recovery(name: str, r: dict[str, Any]) -> str:
    if name == "redis_kill":
        return f"index rebuilt {_s(r.get('index_rebuilt_s'))} after restart"
    if name == "replica_kill":
        return (
            f"out of index answers {_s(r.get('left_index_answers_s'))}, replacement "
            f"registered {_s(r.get('replacement_registered_s'))}"
        )
    if name == "redis_slow":
        return f"route p99 {r.get('route_p99_ms', 0):.1f} ms"
    if name == "overload":
        return f"{r.get('shed_503')} shed, shed p99 {_s(r.get('shed_latency_p99_s'))}"
    return f"{r.get('duration_s', 0):.0f} s of mixed load"


def _s(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:.1f} s"


def _index_answers(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith('prefix_serve_index_answers_total{outcome="answered"}'):
            return float(line.split()[-1])
    return 0.0


def _probe(base_url: str, model: str, n: int) -> list[RequestResult]:
    trace = [
        TraceRequest(f"probe-{i}", 0.05 * i, f"probe {i} {os.urandom(8).hex()} " * 3, 4)
        for i in range(n)
    ]
    results, _ = drive(base_url, model, trace, 60)
    return results
