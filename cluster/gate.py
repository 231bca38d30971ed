"""The door between a request and the engines: its tenant's quotas (``cluster.quotas``: 429
when over), then the admission cap (503 at once when the cluster is full:
``cluster.admission``) or, with ``fair_queue.enabled``, the fair queue
(``cluster.fair_queue``: held at the ingress, released by priority and by each tenant's
weighted share of what its requests cost after the cache).

A request's estimated cost is its prompt tokens that no replica holds, by the router's
mirror of the index (all of them when the mirror cannot tell), plus the output it may ask
for; when it ends its tenant is charged what it really cost (the prompt tokens its replica
did not serve from cache and the tokens it produced), in the queue and in the quotas.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from cluster.admission import Admission
from cluster.api import metrics as api_metrics
from cluster.api.errors import APIError
from cluster.config import ClusterArgs
from cluster.engine_stream import EngineStream
from cluster.fair_queue import FairQueue, Ticket
from cluster.quotas import Quotas, Taken
from cluster.tenants import Tenant, Tenants, bearer_key
from replica.messages import EngineRequest
from router.serve import link

TIMEOUT_HEADER = "x-request-timeout"  # seconds a client will wait (shortens the deadline)


def estimated_cost(request: EngineRequest) -> int:
    route = request.route
    cached = link.LINK.cached_tokens(route) or 0
    return route.num_prompt_tokens - cached + request.params.max_tokens * request.params.n


def actual_cost(requests: list[EngineRequest], streams: list[EngineStream]) -> int:
    """What the engines did: prompt tokens not served from cache, tokens sent (each choice
    counted as choice 0's length)."""
    return sum(
        len(r.prompt_token_ids) - s.cached_tokens + s.delivered_tokens * r.params.n
        for r, s in zip(requests, streams, strict=True)
    )


@dataclass
class Admitted:
    """A request through the door: the headers its answer carries, and what to call once
    it is over (exactly once, with its streams)."""

    leave: Callable[[list[EngineStream]], None]
    headers: dict[str, str] = field(default_factory=dict)


class Gate:
    def __init__(self, args: ClusterArgs, admission: Admission) -> None:
        self.args, self.admission = args, admission
        self.tenants = Tenants(args.api_keys)
        self.queue: FairQueue | None = None
        if args.fair_queue.enabled:
            self.queue = FairQueue(admission.engine_limit, args.max_queued_requests)
        limited = any(r.limits.model_dump(exclude_none=True) for r in self.tenants.records.values())
        self.quotas = Quotas(args.index.url, f"ps:{args.index.cluster}") if limited else None
        self._settling: set[asyncio.Task[None]] = set()

    def tenant(self, http: Request) -> Tenant:
        """Who sent it (``cluster.tenants``)."""
        return self.tenants.of(bearer_key(http.headers.get("authorization", "")), http.headers)

    async def enter(self, http: Request, requests: list[EngineRequest]) -> Admitted:
        """Take the tenant's quotas, then wait (fair queue) or not (cap) for the engines."""
        count, tenant = len(requests), self.tenant(http)
        if self.queue is None and self.quotas is None:  # the cap alone: nothing is charged
            self.admission.enter(count)
            return Admitted(lambda _streams: self.admission.leave(count))
        cost = sum(estimated_cost(r) for r in requests)
        taken = await self._take(tenant, cost)
        try:
            ticket = await self._wait(tenant, cost, count, http)
        except BaseException:
            if taken is not None:  # never ran: every token back
                self._spawn(self.quotas.settle(taken, 0))  # type: ignore[union-attr]
            raise
        headers = taken.headers if taken is not None else {}
        return Admitted(lambda streams: self._leave(ticket, taken, requests, streams), headers)

    async def _take(self, tenant: Tenant, cost: int) -> Taken | None:
        if self.quotas is None:
            return None
        try:
            return await self.quotas.take(tenant, cost)
        except APIError as exc:
            api_metrics.TENANT_REJECTED.labels(tenant.name, exc.type).inc()
            raise

    async def _wait(self, tenant: Tenant, cost: int, count: int, http: Request) -> Ticket | None:
        if self.queue is None:
            self.admission.enter(count)
            return None
        queued = api_metrics.TENANT_QUEUED.labels(tenant.name)
        queued.inc()
        try:
            ticket = await self.queue.enter(tenant, cost, count, self._deadline(http))
        except APIError as exc:
            api_metrics.TENANT_REJECTED.labels(tenant.name, exc.code or "refused").inc()
            raise
        finally:
            queued.dec()
        api_metrics.TENANT_WAIT.labels(tenant.name, str(tenant.priority)).observe(ticket.waited_s)
        return ticket

    def _leave(
        self,
        ticket: Ticket | None,
        taken: Taken | None,
        requests: list[EngineRequest],
        streams: list[EngineStream],
    ) -> None:
        cost = actual_cost(requests, streams)
        if ticket is None:
            self.admission.leave(len(requests))
        else:
            self.queue.leave(ticket, cost)  # type: ignore[union-attr]
            api_metrics.TENANT_CHARGED.labels(ticket.tenant.name).inc(cost)
        if taken is not None:
            self._spawn(self.quotas.settle(taken, cost))  # type: ignore[union-attr]

    def _spawn(self, settle: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(settle)
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    def _deadline(self, http: Request) -> float:
        deadline = self.args.fair_queue.deadline_s
        with contextlib.suppress(ValueError):
            asked = float(http.headers.get(TIMEOUT_HEADER, "inf"))
            if 0 < asked < deadline:
                return asked
        return deadline
