"""A three-node Ray cluster on this host (``ray.cluster_utils.Cluster``: a head and two
workers, each its own raylet, as separate machines would run them), the application started
on it with ``serve run`` against its address, as an operator does with ``RAY_ADDRESS``.

The head runs no engine (``num_cpus=0``, KubeRay's convention) and holds the ingress through
a custom resource; each worker has one CPU and takes at most one engine replica
(``max_replicas_per_node: 1``), so the two CPUs of this machine are never oversubscribed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import keep_logs, tiny
from ray.cluster_utils import Cluster
from streams import Stream, resumed
from test_failover import bodies
from test_serve_e2e import assert_no_leaked_blocks

from bench.harness.launcher import ServeCluster
from bench.harness.redis_server import LocalRedis
from cluster.config import ClusterArgs
from kvindex.config import IndexConfig
from kvindex.reader import IndexReader
from router.config import routing_config

MODEL = "tiny-llama-6m"
HEARTBEAT_TTL_S = 3.0
SYSTEM = "You are the support assistant of a shop that sells tents and stoves. " * 4


class ThreeNodes:
    """The Ray cluster: a head (ingress only) and two one-CPU workers."""

    def __init__(self) -> None:
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 0, "resources": {"head": 1}, "include_dashboard": False},
        )
        self.workers = [self.add_worker(), self.add_worker()]

    def add_worker(self) -> Any:  # ray._private.node.Node
        return self.cluster.add_node(num_cpus=1, resources={"worker": 1})

    @property
    def address(self) -> str:
        return self.cluster.address

    def shutdown(self) -> None:
        self.cluster.shutdown()


@pytest.fixture(scope="module")
def nodes() -> Iterator[ThreeNodes]:
    three = ThreeNodes()
    yield three
    three.shutdown()


@pytest.fixture(scope="module")
def cluster(
    nodes: ThreeNodes, redis_server: LocalRedis, request: pytest.FixtureRequest
) -> Iterator[ServeCluster]:
    failed = request.session.testsfailed
    args = ClusterArgs(
        num_replicas=2,
        max_replicas_per_node=1,
        replica_num_cpus=0.5,
        replica_resources={"worker": 0.5},
        ingress_num_cpus=0,
        ingress_resources={"head": 0.5},
        max_ongoing_requests=16,
        engine=tiny(num_threads=1, num_blocks=512),
        routing=routing_config(stats_period_s=0.5),
        index=IndexConfig(
            url=redis_server.url, cluster="multinode", heartbeat_ttl_s=HEARTBEAT_TTL_S
        ),
    )
    c = ServeCluster(args, ray_address=nodes.address).start(timeout_s=240)
    yield c
    c.stop(keep_logs=keep_logs(request, failed))


def replica_nodes(cluster: ServeCluster, count: int, timeout_s: float = 60) -> dict[str, str]:
    """replica id -> node id, once ``count`` replicas have pushed stats (a stats period)."""
    deadline = time.monotonic() + timeout_s
    while True:
        replicas = cluster.stats()["replicas"]
        fresh = {r: s for r, s in replicas.items() if time.time() - s.get("time", 0) < 3}
        if len(fresh) == count and all("node_id" in s for s in fresh.values()):
            return {rid: s["node_id"] for rid, s in fresh.items()}
        assert time.monotonic() < deadline, replicas
        time.sleep(0.2)


def live_replicas(cluster: ServeCluster) -> set[str]:
    index = IndexReader(cluster.args.index, cluster.args.engine.model_id)
    try:
        return set(index.live_replicas())
    finally:
        index.close()


def chat(cluster: ServeCluster, question: str, system: str = SYSTEM) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 4,
        "temperature": 0,
    }
    resp = httpx.post(f"{cluster.base_url}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp


def test_replicas_land_on_different_worker_nodes(nodes: ThreeNodes, cluster) -> None:
    placed = replica_nodes(cluster, 2)
    workers = {w.node_id for w in nodes.workers}
    assert set(placed.values()) == workers  # one on each worker, none on the head


def test_a_shared_prompt_hits_the_cache_across_nodes(nodes: ThreeNodes, cluster) -> None:
    placed = replica_nodes(cluster, 2)
    first = chat(cluster, "Do you ship to Canada?")
    hits = [chat(cluster, f"Question {i}: can I return a tent?") for i in range(4)]
    # the proxy is on the head; the replica holding the prompt is on a worker
    for resp in hits:
        assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
        assert resp.headers["x-replica-id"] == first.headers["x-replica-id"]
    assert placed[first.headers["x-replica-id"]] in {w.node_id for w in nodes.workers}


def test_a_worker_node_dies_and_comes_back(nodes: ThreeNodes, cluster) -> None:
    original = placed = replica_nodes(cluster, 2)
    reference = [Stream(cluster.base_url, body) for body in bodies()[:4]]
    for s in reference:
        s.start()
    for s in reference:
        s.join(120)
    before = resumed(cluster)
    streams = [Stream(cluster.base_url, body) for body in bodies()[:4]]
    for s in streams:
        s.start()
    deadline = time.monotonic() + 60
    while min(len(s.pieces) for s in streams) < 5:  # every stream is mid-generation
        assert time.monotonic() < deadline
        time.sleep(0.005)
    victim_replica = streams[0].replica  # one system prompt: most or all on one replica
    on_victim = [s for s in streams if s.replica == victim_replica]
    victim = next(w for w in nodes.workers if w.node_id == placed[victim_replica])
    nodes.cluster.remove_node(victim, allow_graceful=False)  # its raylet and workers die
    killed_at = time.monotonic()
    nodes.workers.remove(victim)

    # the index forgets the dead replica within its heartbeat TTL
    while victim_replica in live_replicas(cluster):
        assert time.monotonic() - killed_at < HEARTBEAT_TTL_S + 5
        time.sleep(0.1)
    for s in streams:
        s.join(120)
    for got, want in zip(streams, reference, strict=True):
        assert got.errors == []
        assert "".join(got.pieces) == "".join(want.pieces)  # resumed token for token
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert got.usage[key] == want.usage[key]  # each output token counted once
    assert resumed(cluster) - before >= len(on_victim)  # they were cut, and continued

    # a new worker: Serve places the missing replica there, and it serves again
    nodes.workers.append(nodes.add_worker())
    placed = replica_nodes(cluster, 2, timeout_s=180)
    assert set(placed.values()) == {w.node_id for w in nodes.workers}
    assert len(live_replicas(cluster)) == 2
    (new_replica,) = set(placed) - set(original)
    # new tenants (new system prompts) go where the least recent work was: the new replica
    tenants = [f"Tenant {i} sells only bicycles and answers in French. " * 4 for i in range(4)]
    served = {chat(cluster, "Hello?", t).headers["x-replica-id"] for t in tenants}
    assert new_replica in served
    assert_no_leaked_blocks(cluster, timeout_s=60)
