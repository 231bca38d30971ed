"""What a running cluster's Serve and ingress say about its engine replicas: Serve's list of
them (its REST API, on the cluster's dashboard port), when a change has settled, and the
ingress's moved-stream counters."""

from __future__ import annotations

import time
from typing import Any

import httpx

from bench.harness.launcher import ServeCluster


def serve_replicas(cluster: ServeCluster) -> list[dict[str, Any]]:
    apps = httpx.get(f"{cluster.dashboard_url()}/api/serve/applications/", timeout=5).json()
    return apps["applications"]["llm"]["deployments"]["EngineReplica"].get("replicas", [])


def replica_ids(cluster: ServeCluster) -> set[str]:
    return {r["replica_id"] for r in serve_replicas(cluster)}


def wait_settled(cluster: ServeCluster, expect: int, old: set[str]) -> float:
    """When Serve runs ``expect`` replicas, none of ``old``, and none is stopping."""
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        try:
            replicas = serve_replicas(cluster)
        except (httpx.HTTPError, KeyError, ValueError):
            replicas = None
        if replicas is not None:
            states = [r.get("state") for r in replicas]
            ids = {r["replica_id"] for r in replicas}
            if states == ["RUNNING"] * expect and not ids & old:
                return time.monotonic()
        time.sleep(0.1)
    raise TimeoutError("the deployment did not settle")


def moved_counts(cluster: ServeCluster) -> dict[str, float]:
    """The ingress's moved-stream counters by reason and outcome."""
    text = httpx.get(f"{cluster.base_url}/metrics", timeout=10).text
    moved: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("prefix_serve_moved_requests_total{"):
            labels = line[line.index("{") + 1 : line.index("}")]
            parts = dict(p.split("=") for p in labels.split(","))
            key = f"{parts['reason'].strip(chr(34))}:{parts['outcome'].strip(chr(34))}"
            moved[key] = moved.get(key, 0.0) + float(line.split()[-1])
    return moved
