"""The names a router turns into Prometheus gauges (``router.routing_stats._REPLICA_KEYS``)
are names a replica reports (``EngineReplica.record_routing_stats``: the engine's
``EngineStats``, the puller's, the mover's, the node store tier's and the index publisher's
counters): a renamed counter would otherwise drop its gauge without a word."""

from __future__ import annotations

import dataclasses

from replica.engine.stats import EngineStats
from replica.moves import MoveCounters
from replica.publisher import PublisherCounters
from replica.pull import PullCounters
from replica.store.node_store import NodeStore, StoreGeometry
from replica.store.tier import StoreTier
from router.routing_stats import _REPLICA_KEYS


def test_every_gauge_names_a_counter_a_replica_reports() -> None:
    tier = StoreTier(NodeStore.anonymous(StoreGeometry(4, 64, 1, 2)), background=False)
    reported = (
        {f.name for f in dataclasses.fields(EngineStats)}
        | set(PullCounters().to_dict())
        | set(MoveCounters().to_dict())
        | set(tier.stats())
        | set(PublisherCounters().routing_stats(in_sync=True))
    )
    assert set(_REPLICA_KEYS) <= reported, set(_REPLICA_KEYS) - reported
