"""Readiness (``cluster.readiness``) against a real redis-server: ready once one engine
replica is up (the router's count, else the index's live replicas), still ready with the
index down but saying so, and not ready, with the reason, when no replica is up or nothing
can tell. The cluster's ``/ready`` itself is checked end to end in ``test_serve_e2e.py``
(Redis stopped) and ``test_reliability.py`` (no API key needed)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from conftest import tiny

from bench.harness.redis_server import LocalRedis
from cluster.config import ClusterArgs
from cluster.readiness import Readiness, readiness
from kvindex.config import IndexConfig
from kvindex.reader import IndexReader
from kvindex.writer import IndexWriter


def ready_now(server: LocalRedis, routed: Callable[[], int | None]) -> Readiness:
    args = ClusterArgs(num_replicas=2, engine=tiny(), index=IndexConfig(url=server.url))
    reader = IndexReader(args.index, args.engine.model_id)
    try:
        return asyncio.run(readiness(args, routed, reader))
    finally:
        reader.close()


def test_ready_once_a_replica_is_up_in_the_routers_view_or_else_in_the_index(
    fresh_redis: LocalRedis,
) -> None:
    empty = ready_now(fresh_redis, lambda: None)
    assert not empty.ready and "no engine replica is up" in (empty.reason or "")
    assert empty.indexed_replicas == 0 and empty.index == "ok"
    config = IndexConfig(url=fresh_redis.url)
    writer = IndexWriter(config, tiny().model_id)
    writer.register("replica-a", "epoch-1")
    assert writer.heartbeat("replica-a", "epoch-1")
    by_index = ready_now(fresh_redis, lambda: None)  # Ray's own routers report no count
    assert by_index.ready and by_index.engine_replicas == 1 and by_index.wanted_replicas == 2
    by_router = ready_now(fresh_redis, lambda: 2)
    assert by_router.ready and by_router.engine_replicas == 2 and by_router.routed_replicas == 2


def test_with_the_index_down_ready_in_a_stated_mode_or_not_ready_if_nothing_can_tell(
    fresh_redis: LocalRedis,
) -> None:
    fresh_redis.stop()
    degraded = ready_now(fresh_redis, lambda: 1)
    assert degraded.ready and degraded.indexed_replicas is None
    assert degraded.index.startswith("the index is unreachable")
    blind = ready_now(fresh_redis, lambda: None)
    assert not blind.ready and "cannot tell" in (blind.reason or "")
