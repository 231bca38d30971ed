"""The ingress's fair queue and who a request belongs to (``cluster.fair_queue``,
``cluster.tenants``): shares, priorities, deadlines, charge-back and header trust, exactly,
on the queue itself (the engines stand in as a loop that finishes whatever was admitted)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from cluster.api.errors import APIError
from cluster.config import ClusterArgs
from cluster.fair_queue import FairQueue, Ticket
from cluster.tenants import APIKeyRecord, Tenant, Tenants, key_tenant_name


async def _serve(queue: FairQueue, jobs: list[tuple[Tenant, float]], served: int) -> list[str]:
    """Submit every job at once, then finish admitted ones one at a time (each charged its
    estimate) until ``served`` have run; the tenants in the order they were admitted."""
    order: list[str] = []
    admitted: asyncio.Queue[Ticket] = asyncio.Queue()

    async def one(tenant: Tenant, cost: float) -> None:
        ticket = await queue.enter(tenant, cost, 1, deadline_s=60)
        order.append(tenant.name)
        await admitted.put(ticket)

    tasks = [asyncio.create_task(one(t, c)) for t, c in jobs]
    await asyncio.sleep(0)
    while len(order) < served:
        ticket = await admitted.get()
        await asyncio.sleep(0)
        queue.leave(ticket)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return order[:served]


# (slots, express slots): the lane lends a slot to the next in line only, so it never
# changes the shares
SLOTS = pytest.mark.parametrize("slots,express", [(1, 0), (4, 0), (4, 2)])


@SLOTS
def test_two_saturating_tenants_of_weights_1_and_3_share_1_to_3_in_tokens(
    slots: int, express: int
) -> None:
    queue = FairQueue(lambda: slots, express=lambda: express)
    light, heavy = Tenant("a", weight=1.0), Tenant("b", weight=3.0)
    jobs = [(t, 100.0) for _ in range(200) for t in (light, heavy)]
    order = asyncio.run(_serve(queue, jobs, 200))
    counts = Counter(order)
    assert counts["b"] / counts["a"] == pytest.approx(3.0, rel=0.05)
    charged = queue.charged
    assert charged["b"] / charged["a"] == pytest.approx(3.0, rel=0.05)


def test_the_share_is_of_cost_after_the_cache_not_of_requests() -> None:
    """A tenant whose prompts are cached (cost 100) gets ten requests through for each of a
    tenant whose prompts are not (cost 1,000), at equal weights: equal tokens."""
    queue = FairQueue(lambda: 1)
    cold, warm = Tenant("cold"), Tenant("warm")
    jobs = [(cold, 1000.0) for _ in range(50)] + [(warm, 100.0) for _ in range(300)]
    order = asyncio.run(_serve(queue, jobs, 220))
    counts = Counter(order)
    assert counts["warm"] / counts["cold"] == pytest.approx(10.0, rel=0.1)


def test_express_slots_never_change_the_order_requests_leave_the_queue() -> None:
    """The lane lends a slot to the next in line only: the order in which a flood of cheap
    and costly requests of two tenants leaves the queue is the same with and without it."""
    cold, warm = Tenant("cold"), Tenant("warm", weight=2)
    jobs = [(cold, 1000.0) for _ in range(40)] + [(warm, 100.0) for _ in range(200)]
    plain, lent = FairQueue(lambda: 4), FairQueue(lambda: 4, express=lambda: 2)
    orders = [asyncio.run(_serve(queue, jobs, 150)) for queue in (plain, lent)]
    assert orders[0] == orders[1]
    assert sum(lent.expressed.values()) > 0 and not plain.expressed  # the lane was used


def test_a_higher_priority_always_leaves_the_queue_first() -> None:
    async def run() -> list[str]:
        queue = FairQueue(lambda: 1)
        first = await queue.enter(Tenant("batch"), 10, 1, 60)  # holds the one slot
        order: list[str] = []

        async def one(tenant: Tenant) -> None:
            ticket = await queue.enter(tenant, 10, 1, 60)
            order.append(f"{tenant.name}{tenant.priority}")
            queue.leave(ticket)

        tasks = [asyncio.create_task(one(Tenant("batch", priority=0))) for _ in range(5)]
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(one(Tenant("chat", priority=2))) for _ in range(2)]
        tasks.append(asyncio.create_task(one(Tenant("ops", priority=5))))
        await asyncio.sleep(0)
        queue.leave(first)
        await asyncio.gather(*tasks)
        assert queue.in_flight == 0 and queue.waiting == 0
        return order

    assert asyncio.run(run()) == ["ops5", "chat2", "chat2"] + ["batch0"] * 5


def test_a_request_that_cannot_start_by_its_deadline_is_refused_at_once() -> None:
    """Once the drain rate is known (tokens charged lately), a request with more cost queued
    ahead of it than drains by its deadline is refused with 503 and Retry-After at once
    (the fake clock never moves: a refusal after waiting would say 1 s); it is charged
    nothing."""
    now = [0.0]

    async def run() -> None:
        queue = FairQueue(lambda: 1, clock=lambda: now[0])
        for _ in range(4):  # 4 requests of 100 tokens in 4 s: 100 tokens/s
            ticket = await queue.enter(Tenant("a"), 100, 1, 60)
            now[0] += 1.0
            queue.leave(ticket)
        holder = await queue.enter(Tenant("a"), 100, 1, 60)
        waiters = [asyncio.create_task(queue.enter(Tenant("a"), 100, 1, 60)) for _ in range(5)]
        await asyncio.sleep(0)
        before = dict(queue._finish)
        with pytest.raises(APIError) as refused:  # 500 of a's tokens ahead: 3.75 s > 2 s
            await queue.enter(Tenant("a"), 100, 1, 2.0)
        assert refused.value.status == 503 and refused.value.code == "queue_timeout"
        assert (refused.value.headers or {})["retry-after"] == "4"  # 400 tokens in 3 s
        assert queue.waiting == 5 and queue._finish == before  # nothing charged
        queue.leave(holder)
        for task in waiters:
            task.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)

    asyncio.run(run())


def test_a_request_still_waiting_at_its_deadline_is_refused_then_and_not_charged() -> None:
    async def run() -> None:
        queue = FairQueue(lambda: 1)
        holder = await queue.enter(Tenant("a"), 100, 1, 60)
        with pytest.raises(APIError) as refused:
            await queue.enter(Tenant("b"), 100, 1, 0.05)
        assert refused.value.code == "queue_timeout" and queue.waiting == 0
        queue.leave(holder)
        assert queue.in_flight == 0 and queue.charged["b"] == 0
        # b's finish tag went back: its next request starts level with a's
        ticket = await queue.enter(Tenant("b"), 100, 1, 60)
        queue.leave(ticket)

    asyncio.run(run())


def test_a_full_queue_refuses_at_once_and_a_client_that_leaves_frees_its_place() -> None:
    async def run() -> None:
        queue = FairQueue(lambda: 1, max_waiting=2)
        holder = await queue.enter(Tenant("a"), 1, 1, 60)
        waiting = [asyncio.create_task(queue.enter(Tenant("a"), 1, 1, 60)) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(APIError) as full:
            await queue.enter(Tenant("a"), 1, 1, 60)
        assert full.value.code == "overloaded"
        waiting[0].cancel()  # the client went away
        await asyncio.gather(waiting[0], return_exceptions=True)
        assert queue.waiting == 1
        queue.leave(holder)
        ticket = await waiting[1]
        queue.leave(ticket)
        with pytest.raises(AssertionError):
            queue.leave(ticket)
        assert queue.in_flight == 0 and queue.waiting == 0

    asyncio.run(run())


def test_charge_back_moves_a_tenants_next_turn() -> None:
    """A request estimated at its max_tokens that stopped early is charged what it used:
    its tenant's next turn comes that much sooner."""
    queue = FairQueue(lambda: 1)

    async def run() -> None:
        ticket = await queue.enter(Tenant("a"), 1000, 1, 60)
        queue.leave(ticket, actual_cost=100)
        assert queue.charged["a"] == 100
        assert queue._finish["a"] == pytest.approx(100)

    asyncio.run(run())


def test_headers_change_a_tenant_only_as_far_as_its_key_allows() -> None:
    tenants = Tenants(
        [
            "plain-key",
            APIKeyRecord(key="k-batch", tenant="batch", priority=1, weight=0.5),
            APIKeyRecord(key="k-gw", tenant="gateway", priority=2, trust_headers=True),
            APIKeyRecord(key="k-ops", tenant="ops", priority=4, weight=4),
        ]
    )
    assert tenants.of("plain-key", {}).name == key_tenant_name("plain-key")
    assert tenants.of("k-batch", {}) == Tenant("batch", 1, 0.5)
    # an untrusted key: a higher priority and another tenant are ignored, a lower one taken
    assert tenants.of("k-batch", {"x-priority": "9", "x-tenant": "ops"}) == Tenant("batch", 1, 0.5)
    assert tenants.of("k-batch", {"x-priority": "0"}).priority == 0
    assert tenants.of("k-batch", {"x-priority": "-3"}).priority == 1  # not a priority
    # a trusted gateway: its users by name, at the priority it says
    assert tenants.of("k-gw", {"x-priority": "7"}).priority == 7
    assert tenants.of("k-gw", {"x-tenant": "ops"}) == Tenant("ops", 2, 4.0)
    assert tenants.of("k-gw", {"x-tenant": "user-17"}).name == "user-17"
    assert tenants.of("k-gw", {"x-tenant": "no spaces!"}).name == "gateway"
    assert Tenants([]).of(None, {"x-priority": "9"}) == Tenant("default")


def test_api_keys_take_plain_keys_and_records_and_refuse_a_key_twice() -> None:
    args = ClusterArgs.model_validate(
        {"api_keys": ["k1", {"key": "k2", "tenant": "team-2", "priority": 3, "weight": 2}]}
    )
    assert isinstance(args.api_keys[1], APIKeyRecord) and args.api_keys[1].priority == 3
    with pytest.raises(ValueError, match="listed twice"):
        ClusterArgs.model_validate({"api_keys": ["k1", {"key": "k1", "tenant": "t"}]})
    with pytest.raises(ValueError):
        ClusterArgs.model_validate({"api_keys": [{"key": "k", "tenant": "t", "priority": 10}]})


async def _flood(queue: FairQueue, tenant: Tenant, count: int) -> list[asyncio.Task[Ticket]]:
    tasks = [asyncio.create_task(queue.enter(tenant, 100, 1, 60)) for _ in range(count)]
    await _settle()
    return tasks


async def _settle() -> None:
    """Let every released waiter's task run to its end (a few turns of the loop)."""
    for _ in range(10):
        await asyncio.sleep(0)


async def _finish(queue: FairQueue, tasks: list[asyncio.Task[Ticket]]) -> None:
    """Leave every admitted ticket, one at a time, until all have run."""
    while tasks:
        done, _ = await asyncio.wait(tasks, timeout=1, return_when=asyncio.FIRST_COMPLETED)
        assert done, "nothing admitted while requests wait"
        for task in done:
            tasks.remove(task)
            queue.leave(task.result())
    assert queue.in_flight == 0 and queue.waiting == 0


def test_a_light_tenant_starts_at_once_on_an_express_slot_and_a_flood_never_does() -> None:
    """Slots 4, express 1: the flood holds the 4 slots and waits for more (it is over its
    share: never lent one); a light tenant, under its share, starts at once; the flood's
    next request waits until the total is back under the slots."""

    async def run() -> None:
        queue = FairQueue(lambda: 4, express=lambda: 1)
        flood = await _flood(queue, Tenant("a"), 10)
        assert queue.in_flight == 4 and queue.waiting == 6 and not queue.expressed
        light = await queue.enter(Tenant("b"), 100, 1, 60)
        assert light.express and queue.in_flight == 5 and queue.expressed == {"b": 1}
        with pytest.raises(APIError):  # the lane is taken: b waits like anyone else
            await queue.enter(Tenant("b"), 100, 1, 0.01)
        queue.leave(next(t for t in flood if t.done()).result())  # 5 -> 4: nobody starts
        assert queue.in_flight == 4 and queue.waiting == 6
        queue.leave(light)  # 4 -> 3: the flood's next
        assert queue.in_flight == 4 and queue.waiting == 5
        await _finish(queue, [t for t in flood if not t.done() or not t.result().left])
        assert queue.expressed == {"b": 1}

    asyncio.run(run())


def test_a_higher_priority_starts_on_an_express_slot_and_never_jumps_a_higher_waiter() -> None:
    async def run() -> None:
        queue = FairQueue(lambda: 2, express=lambda: 1)
        low = await _flood(queue, Tenant("batch", priority=0), 4)
        urgent = await queue.enter(Tenant("ops", priority=5), 10, 1, 60)
        assert urgent.express and queue.in_flight == 3
        # the lane is taken: the next urgent one waits, and leaves the queue first
        second = asyncio.create_task(queue.enter(Tenant("ops", priority=5), 10, 1, 60))
        await _settle()
        assert not second.done()
        # a light tenant at priority 0 may not start ahead of the waiting priority 5
        queue.leave(urgent)  # 3 -> 2: the lane is free, but ops 5 waits first in line
        await _settle()
        assert second.done() and second.result().express
        light = asyncio.create_task(queue.enter(Tenant("chat", priority=0), 10, 1, 60))
        await _settle()
        assert not light.done()  # the lane is taken again: chat waits its turn
        queue.leave(second.result())
        await _settle()
        assert light.done() and light.result().express  # under its share: lent the lane
        queue.leave(light.result())
        await _finish(queue, low)

    asyncio.run(run())


def test_an_express_lane_is_never_lent_below_a_higher_priority_waiting() -> None:
    """Every running request is priority 5 and a priority-5 request waits (its tenant over
    its share, so not lent the lane): a priority-0 tenant, however light, waits behind it."""

    async def run() -> None:
        queue = FairQueue(lambda: 2, express=lambda: 1)
        ops = await _flood(queue, Tenant("ops", priority=5), 3)
        assert queue.in_flight == 2 and queue.waiting == 1
        light = asyncio.create_task(queue.enter(Tenant("chat", priority=0), 10, 1, 60))
        await _settle()
        assert not light.done() and queue.in_flight == 2 and not queue.expressed
        await _finish(queue, ops + [light])

    asyncio.run(run())
