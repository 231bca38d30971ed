"""The door between a request and the engines: its tenant's quotas (``cluster.quotas``: 429
when over), then the queue at the ingress (``cluster.fair_queue``), which lets a request on
to the engines only while they have a free slot.

Without ``fair_queue.enabled`` that queue is first come, first served, behind the admission
cap (503 at once when the cluster is full: ``cluster.admission``). With it, requests are
released by priority and by each tenant's weighted share of what they cost after the cache,
and one that cannot start within its deadline is refused; a light tenant or a higher
priority may start at once on an express slot (``cluster.fair_queue``). With several
ingress replicas that order is one for all of them, kept in Redis
(``cluster.shared_queue``; ``fair_queue.shared``).

Why requests wait here and not in Serve's queue: Serve's router retries every request it
holds (choose, probe the queue lengths, send, be rejected by the full replica, back off), so
a backlog of a few dozen requests costs the ingress half a core (measured on vLLM engines:
docs/results.md) that the engines on the same machine then lack. Held here, a request costs
nothing until a slot frees, and Serve routes it at once.

A request's estimated cost is its prompt tokens that no replica holds, by the router's
mirror of the index (all of them when the mirror cannot tell), plus the output it may ask
for; when it ends its tenant is charged what it really cost (the prompt tokens its replica
did not serve from cache and the tokens it produced), in the queue and in the quotas.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
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
from cluster.shared_queue import SharedFairQueue
from cluster.tenants import Tenant, Tenants, bearer_key
from replica.messages import EngineRequest
from router.serve import link

TIMEOUT_HEADER = "x-request-timeout"  # seconds a client will wait (shortens the deadline)
REQUEST_LOG = logging.getLogger("ray.serve.prefix_serve.requests")  # in Serve's replica log
ARRIVAL = Tenant("*")  # without the fair queue every request queues as this one: in order


def estimated_cost(request: EngineRequest) -> int:
    route = request.route
    cached = link.LINK.cached_tokens(route) or 0
    return route.num_prompt_tokens - cached + request.params.max_tokens * request.params.n


def log_request(
    tenant: Tenant,
    ticket: Ticket,
    requests: list[EngineRequest],
    streams: list[EngineStream],
    tokens: tuple[int, int, int],
) -> None:
    """The request log: one line a request once it is over (the ingress replica's log);
    ``tokens``: its prompt tokens, those served from cache, and the tokens charged."""
    first = requests[0]
    prompt, cached, cost = tokens
    session = first.retention.session if first.retention is not None else "-"
    REQUEST_LOG.info(
        "request %s tenant=%s priority=%d waited_s=%.3f express=%s prompts=%d "
        "prompt_tokens=%d cached_tokens=%d output_tokens=%d charged=%d session=%s",
        first.request_id,
        tenant.name,
        tenant.priority,
        ticket.waited_s,
        ticket.express,
        len(requests),
        prompt,
        cached,
        sum(s.delivered_tokens for s in streams),
        cost,
        session,
    )


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
    tenant: Tenant
    headers: dict[str, str] = field(default_factory=dict)


class Gate:
    def __init__(self, args: ClusterArgs, admission: Admission) -> None:
        self.args, self.admission = args, admission
        self.fair = args.fair_queue.enabled
        self.tenants = Tenants(args.api_keys)
        # without the fair queue the admission cap refuses, and this queue only holds
        waiting = args.max_queued_requests if self.fair else -1
        express = admission.express_limit if self.fair else lambda: 0
        self.queue = FairQueue(admission.engine_limit, waiting, express=express)
        self.shared = (  # one queue for every ingress replica, in Redis
            SharedFairQueue(
                args.index.url,
                f"ps:{args.index.cluster}:fq",
                admission.engine_slots,
                self.queue,
                waiting,
                express=admission.express_slots,
            )
            if self.fair and args.fair_queue.shared and args.ingress_replicas > 1
            else None
        )
        limited = any(r.limits.model_dump(exclude_none=True) for r in self.tenants.records.values())
        self.quotas = Quotas(args.index.url, f"ps:{args.index.cluster}") if limited else None
        self._settling: set[asyncio.Task[None]] = set()

    def tenant(self, http: Request) -> Tenant:
        """Who sent it (``cluster.tenants``)."""
        return self.tenants.of(bearer_key(http.headers.get("authorization", "")), http.headers)

    async def enter(self, http: Request, requests: list[EngineRequest]) -> Admitted:
        """Take the tenant's quotas, then wait for a slot in the engines (in its turn)."""
        count, tenant = len(requests), self.tenant(http)
        charged = self.fair or self.quotas is not None  # else the estimate is never read
        cost = sum(estimated_cost(r) for r in requests) if charged else 0
        taken = await self._take(tenant, cost)
        try:
            ticket = await self._wait(tenant, cost, count, http)
        except BaseException:
            if taken is not None:  # never ran: every token back
                self._spawn(self.quotas.settle(taken, 0))  # type: ignore[union-attr]
            raise
        headers = taken.headers if taken is not None else {}
        return Admitted(
            lambda streams: self._leave(tenant, ticket, taken, requests, streams), tenant, headers
        )

    async def _take(self, tenant: Tenant, cost: int) -> Taken | None:
        if self.quotas is None:
            return None
        try:
            return await self.quotas.take(tenant, cost)
        except APIError as exc:
            api_metrics.TENANT_REJECTED.labels(tenant.name, exc.type).inc()
            raise

    async def _wait(self, tenant: Tenant, cost: int, count: int, http: Request) -> Ticket:
        if not self.fair:
            self.admission.enter(count)  # 503 beyond the cluster's cap
        queued = api_metrics.TENANT_QUEUED.labels(tenant.name)
        queued.inc()
        try:
            if self.shared is not None:
                ticket = await self.shared.enter(tenant, cost, count, self._deadline(http))
            elif self.fair:
                ticket = await self.queue.enter(tenant, cost, count, self._deadline(http))
            else:  # in arrival order, as long as it takes
                ticket = await self.queue.enter(ARRIVAL, 0, count, None)
        except APIError as exc:
            api_metrics.TENANT_REJECTED.labels(tenant.name, exc.code or "refused").inc()
            raise
        except BaseException:
            if not self.fair:
                self.admission.leave(count)
            raise
        finally:
            queued.dec()
        api_metrics.TENANT_WAIT.labels(tenant.name, str(tenant.priority)).observe(ticket.waited_s)
        if ticket.express:
            api_metrics.TENANT_EXPRESS.labels(tenant.name).inc()
        return ticket

    def _leave(
        self,
        tenant: Tenant,
        ticket: Ticket,
        taken: Taken | None,
        requests: list[EngineRequest],
        streams: list[EngineStream],
    ) -> None:
        cost = actual_cost(requests, streams)
        prompt = sum(len(r.prompt_token_ids) for r in requests)
        cached = sum(s.cached_tokens for s in streams)
        log_request(tenant, ticket, requests, streams, (prompt, cached, cost))
        api_metrics.TENANT_PROMPT_TOKENS.labels(tenant.name).inc(prompt)
        api_metrics.TENANT_CACHED_TOKENS.labels(tenant.name).inc(cached)
        if self.fair:
            if self.shared is not None:
                self._spawn(self.shared.leave(ticket, cost))
            else:
                self.queue.leave(ticket, cost)
            api_metrics.TENANT_CHARGED.labels(ticket.tenant.name).inc(cost)
        else:
            self.queue.leave(ticket, 0)
            self.admission.leave(len(requests))
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
