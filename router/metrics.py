"""What this process's request routers saw, for ``/metrics`` and ``/cluster/stats``.

Kept apart from ``router.serve_router`` on purpose: Serve pickles the router's module by
value, so state that must be shared with the ingress (and anything holding a lock) lives here
and is reached as ``metrics.STATE``, never imported into the router's namespace.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from replica.metrics import percentile

ROUTED = Counter(
    "prefix_serve_routed_requests", "Requests sent to each engine replica", ["replica", "policy"]
)
DECISION_SECONDS = Histogram(
    "prefix_serve_routing_decision_seconds",
    "Time to rank replicas for one request (index query included)",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25),
)
INDEX_ANSWERS = Counter("prefix_serve_index_answers", "Index queries by outcome", ["outcome"])
_REPLICA_KEYS = (
    "hit_rate",
    "prompt_tokens",
    "cached_prompt_tokens",
    "blocks_free",
    "blocks_cached",
    "blocks_in_use",
    "running",
    "waiting",
    "preemptions",
)
REPLICA_GAUGES = {
    key: Gauge(f"prefix_serve_replica_{key}", f"Engine replica {key} (routing stats)", ["replica"])
    for key in _REPLICA_KEYS
}


class RouterState:
    """Per-replica routing stats, requests routed and recent decision times."""

    def __init__(self) -> None:
        self.policy = ""
        self.replica_stats: dict[str, dict[str, Any]] = {}
        self.routed: dict[str, int] = {}
        self.decision_s: deque[float] = deque(maxlen=10_000)

    def record_stats(self, replica_id: str, stats: dict[str, Any]) -> None:
        self.replica_stats[replica_id] = stats
        for key, gauge in REPLICA_GAUGES.items():
            if key in stats:
                gauge.labels(replica_id).set(stats[key])

    def record_decision(self, seconds: float) -> None:
        self.decision_s.append(seconds)
        DECISION_SECONDS.observe(seconds)

    def record_routed(self, replica_id: str) -> None:
        self.routed[replica_id] = self.routed.get(replica_id, 0) + 1
        ROUTED.labels(replica_id, self.policy).inc()

    def keep_only(self, live: set[str]) -> None:
        for rid in set(self.replica_stats) - live:
            del self.replica_stats[rid]

    def snapshot(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "routed": dict(self.routed),
            "replicas": {rid: dict(s) for rid, s in self.replica_stats.items()},
            "decision_p50_s": percentile(self.decision_s, 50),
            "decision_p99_s": percentile(self.decision_s, 99),
        }


STATE = RouterState()
