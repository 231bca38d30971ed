"""The cluster's one admission cap: a request the engines cannot take soon is refused at the
door (503 at once) instead of waiting in an unbounded queue."""

from __future__ import annotations

import time
from collections.abc import Callable

from cluster.api.errors import overloaded
from cluster.config import ClusterArgs


class Admission:
    """Requests this ingress has in the engines, capped so overload is refused at the door
    (503 at once) instead of waiting in a queue: engine replicas x ``max_ongoing_requests``
    plus ``max_queued_requests`` (no cap when that is -1) for the whole cluster.

    The engine replicas counted are the ones Serve runs (``replicas``, from the router:
    scaling in place moves the cap), up at once and down only once the lower count has held
    for ``DOWN_AFTER_S`` (a killed replica being replaced keeps its slots meanwhile); the
    configured count while the router cannot tell; with autoscaling, ``max_replicas`` (a
    cap at today's count would refuse the load that should scale it up).

    ``others`` tells how many requests the other ingress replicas have in the engines (their
    routers' shared bookings, from this router's mirror of the index: ``router.serve.link``), so
    the cap is one for the cluster; while it cannot tell (None: no mirror, or not synced),
    each ingress takes an even share of the cap (the proxy spreads requests over them).
    """

    DOWN_AFTER_S = 30.0

    def __init__(
        self,
        args: ClusterArgs,
        others: Callable[[], int | None] = lambda: None,
        replicas: Callable[[], int | None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.args = args
        self.others, self.replicas, self.clock = others, replicas, clock
        self._count = args.max_engine_replicas
        self._lately: list[tuple[float, int]] = []  # (until when, count) of recent counts
        self.in_flight = 0

    def engine_replicas(self) -> int:
        """The engine replicas the cap counts (the class docstring)."""
        if self.args.autoscaling is not None:
            return self.args.max_engine_replicas
        now, count = self.clock(), self.replicas()
        if count and count != self._count:
            self._lately.append((now + self.DOWN_AFTER_S, self._count))
            self._count = count
        self._lately = [(until, n) for until, n in self._lately if until > now]
        return max([self._count] + [n for _, n in self._lately])

    @property
    def cluster_limit(self) -> int | None:
        queued = self.args.max_queued_requests
        if queued < 0:
            return None
        return self.engine_replicas() * self.args.max_ongoing_requests + queued

    @property
    def limit(self) -> int | None:
        """What this ingress may still hold: the cluster's cap less the others' requests."""
        cluster = self.cluster_limit
        if cluster is None or self.args.ingress_replicas == 1:
            return cluster
        others = self.others()
        if others is None:
            return -(-cluster // self.args.ingress_replicas)  # an even share
        return cluster - others

    def engine_slots(self) -> int:
        """The engines' slots for the whole cluster: replicas x ``max_ongoing_requests``."""
        return self.engine_replicas() * self.args.max_ongoing_requests

    def engine_limit(self) -> int:
        """What this ingress may have in the engines now (the fair queue's capacity): their
        slots, replicas x ``max_ongoing_requests``, less the other ingresses' requests (an
        even share while they cannot be told)."""
        slots = self.engine_slots()
        if self.args.ingress_replicas == 1:
            return slots
        others = self.others()
        if others is None:
            return -(-slots // self.args.ingress_replicas)
        return max(0, slots - others)

    def express_slots(self) -> int:
        """The cluster's express slots: ``FairQueueConfig.express_slots`` per engine replica
        (the shared fair queue lends them over every ingress)."""
        return self.engine_replicas() * self.args.fair_queue.express_slots

    def express_limit(self) -> int:
        """The express slots this ingress may lend with its own queue: an even share of the
        cluster's with several ingresses."""
        return -(-self.express_slots() // self.args.ingress_replicas)

    def enter(self, count: int = 1) -> None:
        """Take ``count`` slots (a batch of prompts takes one each), or refuse with 503."""
        limit = self.limit
        if limit is not None and self.in_flight + count > limit:
            raise overloaded()
        self.in_flight += count

    def leave(self, count: int = 1) -> None:
        self.in_flight -= count
