"""When a started cluster can take requests: its ``/ready`` says so, with every wanted
replica in the index and in the ingress router's view.

A replica joins the index from its ``__init__``, before Serve's controller has marked it
running and told the routers, so a first request could find one replica of two (a test of
round robin saw it): both counts are waited for. Ray's own routers report no view: not
waited for. Another revision of this project (a benchmark's ``rev:``) may predate
``/ready``; its readiness is read from ``/health``, the index and ``/cluster/stats``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from cluster.config import ClusterArgs
from kvindex.reader import IndexReader
from router.config import RayRouting


def cluster_ready(
    base_url: str,
    args: ClusterArgs,
    index: IndexReader,
    wanted: int,
    stats: Callable[[], dict[str, Any]],
) -> bool:
    """Whether the cluster at ``base_url`` serves with ``wanted`` engine replicas
    (``stats``: its ``/cluster/stats``, for a revision without ``/ready``)."""
    try:
        resp = httpx.get(f"{base_url}/ready", timeout=5)
    except httpx.HTTPError:
        return False
    if resp.status_code == 404:  # another revision, from before /ready
        return _ready_by_parts(base_url, args, index, wanted, stats)
    if resp.status_code != 200:
        return False
    report = resp.json()
    indexed, routed = report["indexed_replicas"], report["routed_replicas"]
    in_index = indexed is None or indexed >= wanted  # None: Redis down, stated
    ray_routing = isinstance(args.routing, RayRouting)
    return in_index and (ray_routing or (routed or 0) >= wanted)


def _ready_by_parts(
    base_url: str,
    args: ClusterArgs,
    index: IndexReader,
    wanted: int,
    stats: Callable[[], dict[str, Any]],
) -> bool:
    try:
        healthy = httpx.get(f"{base_url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
    indexed = healthy and (not index.ping() or len(index.live_replicas()) >= wanted)
    if not indexed or isinstance(args.routing, RayRouting):
        return indexed
    try:
        replicas = stats().get("replicas") or {}
    except (httpx.HTTPError, ValueError):
        return False
    return len(replicas) >= wanted
