"""``faults``: the real cluster under faults, overload and a soak, with a JSON + Markdown report.

Scenarios (``--scenarios``, all by default), each on a fresh cluster (the default policy):

* ``redis_kill``: Redis is killed under streaming load and restarted empty.
* ``replica_kill``: one engine replica's process is killed (SIGKILL) under load; the
  streams on it resume on the other replica.
* ``repeated_kills``: a replica is killed every ``--kill-every-s`` seconds, ``--kills`` times.
* ``scale_down``: the engine deployment goes from 3 replicas to 2 under load.
* ``redis_slow``: Redis stalls (``DEBUG SLEEP``) again and again under load.
* ``events_lost``: the index's log skips sequence numbers under load (events a router's
  mirror never sees): every mirror notices the gap and takes a fresh snapshot.
* ``router_restart``: two ingress replicas (each a router with its mirror of the index);
  one ingress process is killed (SIGKILL) under load and Serve starts another, whose new
  mirror snapshots the index and routes from it.
* ``router_rolling_restart``: the same two ingress replicas replaced as a rolling upgrade
  replaces them (``serve deploy`` with the ingress's options changed): the old routers
  drain, the new ones snapshot the index and route from it.
* ``overload``: open-loop load far above capacity.
* ``soak``: mixed workloads for ``--soak-s`` seconds.

Each reports requests ok / failed / lost (never answered), recovery times, and what the
replicas' own audits say about their block accounting once idle. ``--index`` sets
``IndexConfig`` fields for every scenario (e.g. ``{"mirror": true}``); ``events_lost`` and
the router scenarios always run with mirrors.

Longer than 300 lines because it holds ten scenarios, each a short function of its own
(none over 60 lines) sharing one runner and one report; split, they would be nine modules
of one function each.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import redis

from bench.harness.scenario import (
    Scenario,
    fault_trace,
    gauge_by_ingress,
    index_answers,
    index_answers_by_ingress,
    probe,
    resume_counts,
    wait_for,
)
from bench.report import faults_markdown
from bench.workloads import TraceRequest
from kvindex.measure import percentile

SCENARIOS = (
    "redis_kill",
    "replica_kill",
    "repeated_kills",
    "scale_down",
    "redis_slow",
    "events_lost",
    "router_restart",
    "router_rolling_restart",
    "overload",
    "soak",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--rate", type=float, default=4.0, help="load during faults, per s")
    parser.add_argument("--duration-s", type=float, default=25.0, help="load per fault scenario")
    parser.add_argument("--soak-s", type=float, default=120.0)
    parser.add_argument("--soak-rate", type=float, default=1.5, help="below capacity, per s")
    parser.add_argument("--kills", type=int, default=6, help="repeated_kills: how many")
    parser.add_argument("--kill-every-s", type=float, default=10.0)
    parser.add_argument("--index", help='IndexConfig overrides, JSON, e.g. {"mirror": true}')


def _scenario(args: argparse.Namespace, **kwargs: Any) -> Scenario:
    """A scenario's cluster with ``--index``'s overrides (and the scenario's own)."""
    index = {**json.loads(args.index or "{}"), **kwargs.pop("index", {})}
    return Scenario(index=index, **kwargs)


def redis_kill(args: argparse.Namespace) -> dict[str, Any]:
    with _scenario(args) as s:
        trace = fault_trace(args.rate, args.duration_s)
        s.load(trace)
        time.sleep(args.duration_s * 0.25)
        resyncs = (s.cluster.stats().get("mirror") or {}).get("resyncs", 0)
        s.redis.stop()
        time.sleep(args.duration_s * 0.3)
        s.redis.start()  # empty: every registration and block entry is gone
        restarted = time.monotonic()
        # the router's mirror notices the new log and takes a new snapshot
        mirror_resynced = wait_for(
            lambda: (s.cluster.stats().get("mirror") or {}).get("resyncs", 0) > resyncs, 60
        )

        def rebuilt() -> bool:  # every replica re-registered and republished its blocks
            stats = s.stats()
            return len(stats) >= s.args.num_replicas and all(
                st["index_in_sync"] and st["time"] > time.time() - 1 and s.index.replica_blocks(r)
                for r, st in stats.items()
            )

        recovery = wait_for(rebuilt, 60)
        s.wait_load()
        answered = index_answers(s.cluster.base_url)
        probe(s.cluster.base_url, s.args.engine.model_id, 4)
        return s.report(
            trace,
            index_rebuilt_s=recovery,
            mirror_resynced_s=mirror_resynced,
            mirror=s.cluster.stats().get("mirror"),
            cache_aware_resumed=index_answers(s.cluster.base_url) > answered,
            index_blocks_after={rid: len(s.index.replica_blocks(rid)) for rid in s.stats()},
            since_restart_s=time.monotonic() - restarted,
        )


def replica_kill(args: argparse.Namespace) -> dict[str, Any]:
    with _scenario(args) as s:
        trace = fault_trace(args.rate, args.duration_s)
        s.load(trace)
        time.sleep(args.duration_s * 0.3)
        resumes = resume_counts(s.cluster.base_url)
        # the busiest replica, once one runs two requests, so that streams are
        # mid-generation on it when it dies
        wait_for(lambda: any(v["num_running"] >= 2 for v in s.stats().values()), 10)
        before = s.stats()
        victim, victim_stats = max(before.items(), key=lambda kv: kv[1]["num_running"])
        os.kill(victim_stats["pid"], signal.SIGKILL)
        killed = time.monotonic()
        purged = wait_for(lambda: victim not in s.index.live_replicas(), 30)
        reaped = wait_for(lambda: not s.index.replica_blocks(victim), 60)
        replaced = wait_for(
            lambda: len(set(s.index.live_replicas()) - {victim}) >= s.args.num_replicas, 120
        )
        s.wait_load()
        served_by = {r.replica for r in probe(s.cluster.base_url, s.args.engine.model_id, 12)}
        new_ids = set(s.index.live_replicas()) - set(before)
        # a resumed stream's longest gap between two tokens is what the failure cost it
        stalls = [max(r.itl_s) for r in s.results if r.replica == victim and r.itl_s]
        return s.report(
            trace,
            killed_replica=victim,
            **_resumes_since(s, resumes),
            resume_stall_p50_s=percentile(stalls, 50),
            resume_stall_p99_s=percentile(stalls, 99),
            left_index_answers_s=purged,
            blocks_purged_s=reaped,
            replacement_registered_s=replaced,
            replacement_epoch_new=bool(new_ids),
            replacement_gets_traffic=bool(new_ids & served_by),
            whole_after_s=time.monotonic() - killed if replaced is not None else None,
        )


def repeated_kills(args: argparse.Namespace) -> dict[str, Any]:
    """A replica killed every ``--kill-every-s`` under load, ``--kills`` times."""
    with _scenario(args) as s:
        trace = fault_trace(args.rate, args.kill_every_s * (args.kills + 1))
        s.load(trace)
        resumes, victims = resume_counts(s.cluster.base_url), []
        for i in range(args.kills):
            time.sleep(args.kill_every_s)
            live = sorted(s.stats().items())
            if not live:
                continue
            victim, stats = live[i % len(live)]
            os.kill(stats["pid"], signal.SIGKILL)
            victims.append(victim)
        s.wait_load(600)
        return s.report(trace, kills=len(victims), **_resumes_since(s, resumes))


def scale_down(args: argparse.Namespace) -> dict[str, Any]:
    """The engine deployment goes from 3 replicas to 2 (``serve deploy``, in place) under
    load: one replica drains, the two others keep serving (and keep their caches)."""
    with _scenario(args, num_replicas=3) as s:
        trace = fault_trace(args.rate, args.duration_s)
        s.load(trace)
        time.sleep(args.duration_s * 0.3)
        resumes, before = resume_counts(s.cluster.base_url), set(s.index.live_replicas())
        s.cluster.scale(2)
        left = wait_for(lambda: len(s.index.live_replicas()) == 2, 120)
        kept = set(s.index.live_replicas()) & before
        s.args = s.args.model_copy(update={"num_replicas": 2})
        s.wait_load()
        return s.report(
            trace,
            scaled="3 -> 2",
            drained_s=left,
            replicas_kept=len(kept),
            **_resumes_since(s, resumes),
        )


def _resumes_since(s: Scenario, before: dict[str, float]) -> dict[str, float]:
    after = resume_counts(s.cluster.base_url)
    return {f"{k}_requests": after[k] - before[k] for k in after}


def redis_slow(args: argparse.Namespace) -> dict[str, Any]:
    with _scenario(args) as s:
        trace = fault_trace(args.rate, args.duration_s)
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
        return s.report(
            trace,
            route_p50_ms=(route["decision_p50_s"] or 0) * 1e3,
            route_p99_ms=(route["decision_p99_s"] or 0) * 1e3,
        )


def _mirror(s: Scenario) -> dict[str, Any]:
    return s.cluster.stats().get("mirror") or {}


def events_lost(args: argparse.Namespace) -> dict[str, Any]:
    """The log's sequence jumps by 5 (five events no mirror will ever read) under load: the
    router's mirror must see the gap, resync from a snapshot, and keep routing."""
    with _scenario(args, index={"mirror": True}) as s:
        trace = fault_trace(args.rate, args.duration_s)
        s.load(trace)
        time.sleep(args.duration_s * 0.3)
        before = _mirror(s)
        client = redis.Redis.from_url(s.redis.url)
        client.incrby(f"{s.index.namespace}:evseq", 5)
        lost = time.monotonic()
        resynced = wait_for(lambda: _mirror(s).get("gaps", 0) > before.get("gaps", 0), 60)
        s.wait_load()
        answers = index_answers_by_ingress(s.cluster.base_url)
        return s.report(
            trace,
            gap_seen_and_resynced_s=resynced,
            mirror_before=before,
            mirror_after=_mirror(s),
            index_answers=answers,
            since_loss_s=time.monotonic() - lost,
        )


def router_restart(args: argparse.Namespace) -> dict[str, Any]:
    """Two ingress replicas; one's process SIGKILLed under load. Its cut streams fail (the
    client held an HTTP connection to that process); Serve starts a new ingress, whose
    router snapshots the index into a new mirror. Converged: the new router's mirror is
    synced (its ``synced_at`` gauge, exact to its own clock; seen once it shares its
    metrics, every 5 s), and, if the proxy sends it any, it decides from the mirror."""
    with _scenario(args, index={"mirror": True}, ingress_replicas=2) as s:
        trace, url, before = _routers_under_load(s, args)
        victim = s.cluster.replica_pids("Ingress")[0]
        os.kill(victim, signal.SIGKILL)
        killed, killed_wall = time.monotonic(), time.time()
        replaced = wait_for(
            lambda: len(set(s.cluster.replica_pids("Ingress")) - {victim}) >= 2, 120
        )

        def new_mirror_synced() -> bool:
            return any(
                v > 0 for i, v in gauge_by_ingress(url, SYNCED_AT).items() if i not in before
            )

        seen = wait_for(new_mirror_synced, 120)
        synced_at = [v for i, v in gauge_by_ingress(url, SYNCED_AT).items() if i not in before]
        s.wait_load()
        answers = index_answers_by_ingress(url)
        return s.report(
            trace,
            ingress_replaced_s=replaced,
            new_mirror_synced_s=max(synced_at) - killed_wall if synced_at else None,
            new_mirror_synced_seen_s=seen,
            new_router_mirror_decisions=sum(
                answers[i].get("mirror", 0) for i in set(answers) - before
            ),
            index_answers=answers,
            since_kill_s=time.monotonic() - killed,
        )


SYNCED_AT = "prefix_serve_index_mirror_synced_at_seconds"


def _routers_under_load(
    s: Scenario, args: argparse.Namespace
) -> tuple[list[TraceRequest], str, set[str]]:
    """The router scenarios' start: load running for 30% of it, and the ingress replicas
    seen so far (by their metrics' label), so the new ones can be told apart."""
    trace = fault_trace(args.rate, args.duration_s)
    s.load(trace)
    time.sleep(args.duration_s * 0.3)
    url = s.cluster.base_url
    return trace, url, set(index_answers_by_ingress(url)) | set(gauge_by_ingress(url, SYNCED_AT))


def router_rolling_restart(args: argparse.Namespace) -> dict[str, Any]:
    """Two ingress replicas replaced under load as a rolling upgrade replaces them: Serve
    starts new ones and drains the old (their open streams finish there), so no request
    should fail. Converged: every ingress is new and each new router's mirror is synced;
    what the new routers decided from their mirrors, and without the index, is counted."""
    with _scenario(args, index={"mirror": True}, ingress_replicas=2) as s:
        trace, url, before = _routers_under_load(s, args)
        old = set(s.cluster.replica_pids("Ingress"))
        started, started_wall = time.monotonic(), time.time()
        s.cluster.restart_ingress(generation=1)
        deployed = time.monotonic() - started

        def all_new() -> bool:
            pids = set(s.cluster.replica_pids("Ingress"))
            return len(pids) >= 2 and not pids & old

        replaced = wait_for(all_new, 120)

        def new_synced() -> list[float]:
            gauges = gauge_by_ingress(url, SYNCED_AT)
            return [v for i, v in gauges.items() if i not in before and v > 0]

        seen = wait_for(lambda: len(new_synced()) >= 2, 120)
        synced_at = new_synced()
        s.wait_load()
        answers = index_answers_by_ingress(url)
        new = set(answers) - before
        return s.report(
            trace,
            deploy_call_s=deployed,
            ingress_replaced_s=replaced,
            new_mirror_synced_s=max(synced_at) - started_wall if synced_at else None,
            new_mirror_synced_seen_s=seen,
            new_router_mirror_decisions=sum(answers[i].get("mirror", 0) for i in new),
            new_router_unknown_decisions=sum(answers[i].get("unknown", 0) for i in new),
            index_answers=answers,
            since_restart_s=time.monotonic() - started,
        )


def overload(args: argparse.Namespace) -> dict[str, Any]:
    with _scenario(args, max_queued_requests=32) as s:
        rss_before = {r: st["rss_mb"] for r, st in s.stats().items()}
        trace = fault_trace(40.0, 10.0, workload="chat", seed=3)
        s.load(trace)
        s.wait_load()
        shed = [r.latency_s for r in s.results if r.status == 503 and r.latency_s]
        accepted = [r.latency_s for r in s.results if r.status == 200 and r.latency_s]
        return s.report(
            trace,
            offered_per_s=40.0,
            shed_503=sum(1 for r in s.results if r.status == 503),
            shed_latency_p99_s=percentile(shed, 99),
            accepted_latency_p99_s=percentile(accepted, 99),
            replica_rss_mb_before=rss_before,
            replica_rss_mb_after={r: st["rss_mb"] for r, st in s.stats().items()},
        )


def soak(args: argparse.Namespace) -> dict[str, Any]:
    with _scenario(args) as s:
        rate = args.soak_rate / 3
        traces = [
            fault_trace(rate, args.soak_s, workload=w, seed=i)
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
        return s.report(merged, duration_s=args.soak_s)


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = args.out or Path("results/faults")
    runners = {
        f.__name__: f
        for f in (
            redis_kill,
            replica_kill,
            repeated_kills,
            scale_down,
            redis_slow,
            events_lost,
            router_restart,
            router_rolling_restart,
            overload,
            soak,
        )
    }
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
    (out / "faults.md").write_text(faults_markdown(report) + "\n")
    return report
