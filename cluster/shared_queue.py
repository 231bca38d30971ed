"""One fair queue for every ingress replica: the order and the slots kept in Redis.

With several ingress replicas (``ingress_replicas`` > 1) each one's own ``FairQueue`` would
order only the requests that reached it: a tenant whose requests all land on one ingress
would compete there with no one, and the slots would go to whichever ingress saw a slot
free first. Here the fair queue's state is the cluster's: the virtual time and each
tenant's finish tag (start-time fair queuing, ``cluster.fair_queue``), the waiting
requests of every ingress in one order (priority, then start tag, then arrival), and the
requests each ingress has in the engines, all in Redis and changed only by Lua scripts
(``cluster.shared_queue_scripts``: atomic). A request that finds a slot free and no one
waiting starts at once; otherwise it waits as a member of the shared order, and when a
request ends anywhere the script releases the heads that fit and publishes each to its
ingress, which wakes the waiter. A second's heartbeat renews the ingress (an ingress that
dies stops counting once its key expires, and its waiters are dropped), releases what
fits, and finds a release whose message was lost. An ingress silent for ``ALIVE_MS`` is
dropped: a dropped waiter is let through when its ingress notices (as if released), so an
ingress that stalls that long may overfill the slots once, never hold them forever.

Express slots are lent in the shared order too (``express``: the cluster's, replicas x
``fair_queue.express_slots``), by ``cluster.fair_queue``'s rule over every ingress's
requests: Redis keeps what each ingress runs per tenant and per priority, each tenant's
waiters and weight (``cluster.shared_queue_scripts``). Not shared: the wait estimate (a
waiter is refused at its deadline, not before). While Redis cannot be reached, requests go
to the ingress's own ``FairQueue`` over its share of the slots, as without sharing.
Invariants: a ticket is left exactly once; a waiter released is never withdrawn (its slots
are given back by ``leave``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable

import redis.asyncio
from redis.exceptions import RedisError

from cluster.fair_queue import FairQueue, Ticket, queue_full, wait_too_long
from cluster.shared_queue_scripts import BEAT, ENTER, LEAVE, WITHDRAW
from cluster.tenants import Tenant

log = logging.getLogger("ray.serve")
BEAT_S = 1.0  # how often an ingress renews itself and looks for lost releases
ALIVE_MS = 15_000  # an ingress silent this long is dropped (its requests, its waiters)


class SharedFairQueue:
    """The fair queue of the module docstring, for one ingress. ``slots``: the engines'
    slots for the whole cluster, ``express`` its express slots; ``local``: the queue used
    while Redis cannot be reached."""

    def __init__(
        self,
        url: str,
        namespace: str,
        slots: Callable[[], int],
        local: FairQueue,
        max_waiting: int = -1,
        ingress_id: str | None = None,
        express: Callable[[], int] = lambda: 0,
    ) -> None:
        self.ns, self.slots, self.local, self.max_waiting = namespace, slots, local, max_waiting
        self.express = express
        self.ingress = ingress_id or uuid.uuid4().hex[:12]
        self._redis = redis.asyncio.Redis.from_url(url, socket_timeout=2.0)
        self._scripts = {
            name: self._redis.register_script(src)
            for name, src in (
                ("enter", ENTER),
                ("leave", LEAVE),
                ("withdraw", WITHDRAW),
                ("beat", BEAT),
            )
        }
        self._waiters: dict[str, asyncio.Future[bool]] = {}  # True: on an express slot
        self._early: dict[str, bool] = {}  # released before their waiter was registered
        self._tasks: list[asyncio.Task[None]] = []
        self._starting: asyncio.Future[None] | None = None
        self.fallbacks = 0  # requests queued locally because Redis failed

    @property
    def waiting(self) -> int:
        return len(self._waiters) + self.local.waiting

    async def start(self) -> None:
        """Announce this ingress and start hearing its releases (before the first enter;
        once, however many requests arrive meanwhile; again after a failed try)."""
        if self._starting is None or (self._starting.done() and self._starting.exception()):
            self._starting = asyncio.ensure_future(self._start())
        await asyncio.shield(self._starting)

    async def _start(self) -> None:
        await self._beat()
        pubsub = await self._subscribe()
        self._tasks = [
            asyncio.create_task(self._listen(pubsub)),
            asyncio.create_task(self._beat_forever()),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks = []
        with contextlib.suppress(RedisError):
            await self._redis.delete(f"{self.ns}:alive:{self.ingress}")
        await self._redis.aclose()

    async def enter(
        self, tenant: Tenant, cost: float, count: int, deadline_s: float | None
    ) -> Ticket:
        """Wait for a slot in the shared order; 503 when the queue is full or the deadline
        passes first (``FairQueue.enter``'s contract)."""
        start = time.monotonic()
        try:
            await self.start()
            state, _, member = await self._run(
                "enter",
                self.ingress,
                tenant.name,
                tenant.weight,
                tenant.priority,
                cost,
                count,
                self.slots(),
                self.max_waiting,
                self.express(),
            )
        except RedisError as exc:
            self.fallbacks += 1
            log.warning("shared fair queue unreachable (%s): this ingress queues alone", exc)
            return await self.local.enter(tenant, cost, count, deadline_s)
        if int(state) < 0:
            raise queue_full(self.waiting)
        ticket = SharedTicket(tenant, cost, count, 0.0, express=int(state) == 2)
        if int(state) > 0:
            return ticket
        await self._await_release(member.decode(), tenant, cost, deadline_s, ticket)
        ticket.waited_s = time.monotonic() - start
        return ticket

    async def _await_release(
        self,
        member: str,
        tenant: Tenant,
        cost: float,
        deadline_s: float | None,
        ticket: Ticket,
    ) -> None:
        if member in self._early:
            ticket.express = self._early.pop(member)
            return
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiters[member] = future
        try:
            ticket.express = await asyncio.wait_for(asyncio.shield(future), deadline_s)
        except TimeoutError:
            if await self._withdraw(member, tenant, cost):
                raise wait_too_long(deadline_s or 0.0, deadline_s or 0.0) from None
        except asyncio.CancelledError:  # the client went away
            if not await self._withdraw(member, tenant, cost):
                await self.leave(ticket, 0.0)
            raise
        finally:
            self._waiters.pop(member, None)

    async def _withdraw(self, member: str, tenant: Tenant, cost: float) -> bool:
        """Take a waiter out; False if it was released already (it holds its slots)."""
        gone = await self._run(
            "withdraw", member, tenant.name, cost / tenant.weight, self.slots(), self.express()
        )
        return bool(int(gone))

    async def leave(self, ticket: Ticket, actual_cost: float | None = None) -> None:
        """The request is over: its slots free (the next heads released), its tenant's
        finish tag corrected by what it really cost."""
        if not isinstance(ticket, SharedTicket):
            self.local.leave(ticket, actual_cost)
            return
        if ticket.left:
            raise AssertionError("a ticket left twice")
        ticket.left = True
        cost = ticket.cost if actual_cost is None else actual_cost
        correction = (cost - ticket.cost) / ticket.tenant.weight
        try:
            await self._run(
                "leave",
                self.ingress,
                ticket.tenant.name,
                ticket.count,
                correction,
                self.slots(),
                ticket.tenant.priority,
                self.express(),
            )
        except RedisError as exc:  # its slots come back when this ingress's entry is dropped
            log.warning("shared fair queue: a request's end not recorded (%s)", exc)

    async def _run(self, name: str, *args: object) -> list:
        return await self._scripts[name](args=[self.ns, *args])

    async def _subscribe(self) -> redis.asyncio.client.PubSub:
        pubsub = self._redis.pubsub()
        await pubsub.subscribe(f"{self.ns}:rel:{self.ingress}")
        return pubsub

    async def _listen(self, pubsub: redis.asyncio.client.PubSub) -> None:
        """Wake the waiters released; subscribe again after a lost connection (meanwhile
        the heartbeat finds the releases)."""
        while True:
            try:
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        member, _, express = message["data"].decode().partition(" ")
                        self._released(member, express == "x")
            except RedisError as exc:
                log.warning("shared fair queue: releases unheard (%s); subscribing again", exc)
                await asyncio.sleep(BEAT_S)
                with contextlib.suppress(RedisError):
                    pubsub = await self._subscribe()

    def _released(self, member: str, express: bool = False) -> None:
        future = self._waiters.get(member)
        if future is None:
            self._early[member] = express  # its enter has not registered it yet
        elif not future.done():
            future.set_result(express)

    async def _beat(self) -> None:
        await self._run("beat", self.ingress, ALIVE_MS, self.slots(), self.express())

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(BEAT_S)
            try:
                await self._beat()
                await self._find_lost_releases()
            except RedisError as exc:
                log.warning("shared fair queue heartbeat failed: %s", exc)

    async def _find_lost_releases(self) -> None:
        """A waiter no longer in the shared order was released (its message was lost)."""
        members = list(self._waiters)
        if not members:
            return
        scores = await self._redis.zmscore(f"{self.ns}:wait", members)
        for member, score in zip(members, scores, strict=True):
            if score is None:
                self._released(member)  # the lost message named the lane: counted as not


class SharedTicket(Ticket):
    """A ticket of the shared order (its slots are counted in Redis, not locally)."""
