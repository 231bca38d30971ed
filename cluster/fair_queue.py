"""Requests held at the ingress until the engines have a slot, released by priority and,
inside a priority, by weighted fair share of what they cost.

A request's cost is what it will make the engines do: its prompt tokens that no replica
holds (the router's index says how many are cached before the request runs) plus the
output tokens it may ask for (``max_tokens``). So a tenant whose prompts are cached pays
for the little it computes, not for the length of its prompts. When the request ends it is
charged what it really cost (the engine's cached count, the tokens it produced) and the
difference is carried into its tenant's next turn.

Scheduling is start-time fair queuing (Goyal et al., 1996): each tenant's next request
gets the start tag ``max(V, F)`` (V: the start tag of the request released last; F: the
finish tag of the tenant's previous request) and the finish tag ``start + cost / weight``;
the waiting request with the highest priority and, within it, the smallest start tag goes
first. Two saturating tenants of weights 1 and 3 are served 1:3 in charged tokens; a tenant
that was idle starts at V, with no credit saved up.

Express slots (``express``, a few per engine replica) keep a light tenant and a high
priority from waiting for a slot to free: when the engines' slots are all taken, the
request the queue would release next (and only it: the lane never reorders the queue, so
the shares of cost stay as they are) may start at once on an express slot if its priority
is above the lowest running, or if its tenant has fewer requests running than its weighted
share of the slots (a tenant that floods is always over its share, so it never gets one).
The engines batch the extra request (their ``max_num_seqs`` must leave room); the flood's
next request waits until the total is back under the slots, so the lane lends, it does not
add, capacity. Measured in docs/results.md (tenants).

A request that cannot start before its deadline is refused at once with 503 and
``Retry-After`` (the wait is estimated from the cost queued ahead of it and the tokens the
engines have been charged for lately); one still waiting at its deadline is refused then.
Invariants: ``in_flight`` never exceeds the capacity plus the express slots when a request
is released, and the capacity alone unless the request is express (a request larger than
the capacity goes alone); a waiter never starts before one of higher priority; every
admitted ticket is left exactly once.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.api.errors import APIError
from cluster.tenants import Tenant

RATE_WINDOW_S = 30.0  # how far back the drain rate looks


@dataclass(order=True)
class _Waiter:
    key: tuple[int, float, int]  # (-priority, start tag, arrival): the queue's order
    tenant: Tenant = field(compare=False)
    cost: float = field(compare=False)
    count: int = field(compare=False)
    future: asyncio.Future[None] = field(compare=False)
    express: bool = field(default=False, compare=False)


@dataclass
class Ticket:
    """An admitted request: what it was estimated to cost, to charge back when it ends."""

    tenant: Tenant
    cost: float
    count: int
    waited_s: float
    express: bool = False  # started on an express slot
    left: bool = False


def queue_full(waiting: int) -> APIError:
    return APIError(
        503,
        f"The server is overloaded ({waiting} requests waiting); retry later",
        "overloaded_error",
        code="overloaded",
        headers={"retry-after": "1"},
    )


def wait_too_long(expected_s: float, deadline_s: float) -> APIError:
    retry = max(1, math.ceil(expected_s))
    return APIError(
        503,
        f"The request would wait about {expected_s:.0f} s for the engines, past its "
        f"deadline of {deadline_s:g} s; retry later",
        "overloaded_error",
        code="queue_timeout",
        headers={"retry-after": str(retry)},
    )


class FairQueue:
    """The ingress's queue in front of the engines (the module docstring).

    ``capacity`` says how many requests this ingress may have in the engines now (None: no
    cap); ``max_waiting`` caps the requests held (-1: no cap; beyond it 503 at once);
    ``express`` how many more it may lend to a light tenant or a higher priority."""

    def __init__(
        self,
        capacity: Callable[[], int | None],
        max_waiting: int = -1,
        clock: Callable[[], float] = time.monotonic,
        express: Callable[[], int] = lambda: 0,
    ) -> None:
        self.capacity, self.max_waiting, self.clock = capacity, max_waiting, clock
        self.express = express
        self.in_flight = 0
        self.running: Counter[str] = Counter()  # requests in the engines, per tenant
        self._priorities: Counter[int] = Counter()  # requests in the engines, per priority
        self._weights: dict[str, float] = {}
        self.virtual = 0.0  # V: the start tag of the request released last
        self._finish: dict[str, float] = {}  # each tenant's last finish tag
        self._heap: list[_Waiter] = []
        self._arrivals = itertools.count()
        self._drained: deque[tuple[float, float]] = deque()  # (when, tokens) charged lately
        self.charged: Counter[str] = Counter()  # tokens charged per tenant (for tests, stats)
        self.expressed: Counter[str] = Counter()  # requests started on an express slot
        self.waiting_by_tenant: Counter[str] = Counter()

    @property
    def waiting(self) -> int:
        return len(self._heap)

    def _fits(self, count: int) -> bool:
        cap = self.capacity()
        return cap is None or self.in_flight + count <= cap or self.in_flight == 0

    async def enter(
        self, tenant: Tenant, cost: float, count: int, deadline_s: float | None
    ) -> Ticket:
        """Wait until the request may go to the engines; refuse it (503) when the queue is
        full, or when it cannot start within ``deadline_s`` seconds (None: it waits as long
        as it takes)."""
        start = self.clock()
        self._weights[tenant.name] = tenant.weight
        tag = max(self.virtual, self._finish.get(tenant.name, 0.0))
        key = (-tenant.priority, tag, next(self._arrivals))
        if not self._heap and self._fits(count):
            self._admit(tenant, cost, count, tag)
            return Ticket(tenant, cost, count, 0.0)
        if (not self._heap or key < self._heap[0].key) and self._may_express(tenant, count):
            self._admit(tenant, cost, count, tag)
            self.expressed[tenant.name] += 1
            return Ticket(tenant, cost, count, 0.0, express=True)
        if 0 <= self.max_waiting <= len(self._heap):
            raise queue_full(len(self._heap))
        expected = None if deadline_s is None else self.expected_wait_s(key, cost)
        if expected is not None and deadline_s is not None and expected > deadline_s:
            raise wait_too_long(expected, deadline_s)
        self._finish[tenant.name] = tag + cost / tenant.weight
        waiter = _Waiter(key, tenant, cost, count, asyncio.get_running_loop().create_future())
        heapq.heappush(self._heap, waiter)
        self.waiting_by_tenant[tenant.name] += 1
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), deadline_s)
        except TimeoutError:
            if self._withdraw(waiter):  # still waiting: never admitted, never charged
                raise wait_too_long(self.clock() - start, deadline_s or 0.0) from None
            # released in the instant its deadline came: it holds a slot, so it goes on
        except asyncio.CancelledError:  # the client went away
            if not self._withdraw(waiter):  # released already: give its slot back
                self.leave(Ticket(tenant, cost, count, self.clock() - start), 0.0)
            raise
        return Ticket(tenant, cost, count, self.clock() - start, express=waiter.express)

    def _admit(self, tenant: Tenant, cost: float, count: int, tag: float) -> None:
        self._start(tenant, count)
        self.virtual = tag
        self._finish[tenant.name] = max(
            self._finish.get(tenant.name, 0.0), tag + cost / tenant.weight
        )

    def _withdraw(self, waiter: _Waiter) -> bool:
        """Take a waiter out that was not released; False if it already was."""
        if waiter.future.done():
            return False
        self._heap.remove(waiter)
        heapq.heapify(self._heap)
        self.waiting_by_tenant[waiter.tenant.name] -= 1
        tenant = waiter.tenant
        self._finish[tenant.name] -= waiter.cost / tenant.weight  # not charged for nothing
        waiter.future.cancel()
        self._release_next()
        return True

    def leave(self, ticket: Ticket, actual_cost: float | None = None) -> None:
        """The request is over: its slots free, its tenant charged what it really cost."""
        if ticket.left:
            raise AssertionError("a ticket left twice")
        ticket.left = True
        self.in_flight -= ticket.count
        self.running[ticket.tenant.name] -= ticket.count
        self._priorities[ticket.tenant.priority] -= ticket.count
        cost = ticket.cost if actual_cost is None else actual_cost
        tenant = ticket.tenant
        self._finish[tenant.name] = (
            self._finish.get(tenant.name, 0.0) + (cost - ticket.cost) / tenant.weight
        )
        self.charged[tenant.name] += cost
        now = self.clock()
        self._drained.append((now, cost))
        self._release_next()

    def _start(self, tenant: Tenant, count: int) -> None:
        self.in_flight += count
        self.running[tenant.name] += count
        self._priorities[tenant.priority] += count

    def _release_next(self) -> None:
        while self._heap:
            head = self._heap[0]
            if not self._fits(head.count):
                if not self._may_express(head.tenant, head.count):
                    return  # the lane goes to the next in line only, never past it
                head.express = True
                self.expressed[head.tenant.name] += 1
            waiter = heapq.heappop(self._heap)
            self.waiting_by_tenant[waiter.tenant.name] -= 1
            self._start(waiter.tenant, waiter.count)
            self.virtual = waiter.key[1]
            waiter.future.set_result(None)

    def _may_express(self, tenant: Tenant, count: int) -> bool:
        """Whether a request of ``tenant`` may start on an express slot now (the module
        docstring): one is free, and it outranks a running request or its tenant runs less
        than its weighted share of the slots."""
        cap, extra = self.capacity(), self.express()
        if cap is None or extra <= 0 or self.in_flight + count > cap + extra:
            return False
        running = [p for p, n in self._priorities.items() if n > 0]
        if running and tenant.priority > min(running):
            return True
        active = {name for name, n in self.running.items() if n > 0}
        active |= {name for name, n in self.waiting_by_tenant.items() if n > 0}
        active.add(tenant.name)
        total = sum(self._weights.get(name, 1.0) for name in active)
        return self.running[tenant.name] + count <= cap * tenant.weight / total

    def drain_rate(self) -> float | None:
        """Tokens charged per second over the last ``RATE_WINDOW_S`` (None: too few)."""
        now = self.clock()
        while self._drained and self._drained[0][0] < now - RATE_WINDOW_S:
            self._drained.popleft()
        if len(self._drained) < 4:
            return None
        span = max(now - self._drained[0][0], 1.0)
        return sum(tokens for _, tokens in self._drained) / span

    def expected_wait_s(self, key: tuple[int, float, int], cost: float) -> float | None:
        """Seconds until a request queued with ``key`` would start: the cost queued ahead of
        it over the recent drain rate (None while the rate is unknown)."""
        rate = self.drain_rate()
        if rate is None or rate <= 0:
            return None
        ahead = sum(w.cost for w in self._heap if w.key < key)
        return ahead / rate
