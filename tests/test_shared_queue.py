"""One fair queue for two ingress replicas (``cluster.shared_queue``) in a real
redis-server: the 1:3 weights hold in charged tokens when each tenant reaches a different
ingress (two local queues split the slots 1:1 instead), a higher priority waiting at one
ingress goes before a lower one at the other, the slots are never exceeded, a waiter is
refused at its deadline and a client that leaves gives its place back, a dead ingress's
requests stop counting, and express slots are lent over both ingresses by the local queue's
rule (a light tenant or a higher priority at one ingress while a flood at the other holds
every slot; never the flood, never past a waiter ahead)."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from bench.harness.redis_server import LocalRedis
from cluster.api.errors import APIError
from cluster.fair_queue import FairQueue
from cluster.shared_queue import SharedFairQueue
from cluster.tenants import Tenant

SLOTS = 2


def queues(url: str, n: int = 2, slots: int = SLOTS, express: int = 0) -> list[SharedFairQueue]:
    return [
        SharedFairQueue(
            url,
            "sq",
            lambda: slots,
            FairQueue(lambda: slots // n),
            ingress_id=f"i{i}",
            express=lambda: express,
        )
        for i in range(n)
    ]


async def saturate(
    enter: list, leave: list, tenants: list[Tenant], seconds: float
) -> dict[str, float]:
    """Each tenant keeps 6 requests waiting at its own ingress (``enter[i]``); an admitted
    request runs 10 ms and costs 100 tokens. Returns the tokens charged per tenant."""
    charged = dict.fromkeys((t.name for t in tenants), 0.0)
    running = [0]
    stop = asyncio.get_running_loop().time() + seconds

    async def client(i: int, tenant: Tenant) -> None:
        while asyncio.get_running_loop().time() < stop:
            ticket = await enter[i](tenant, 100, 1, None)
            running[0] += 1
            assert running[0] <= SLOTS
            await asyncio.sleep(0.01)
            running[0] -= 1
            charged[tenant.name] += 100
            await leave[i](ticket, 100)

    await asyncio.gather(*(client(i, t) for i, t in enumerate(tenants) for _ in range(6)))
    return charged


def test_weights_hold_across_two_ingresses_each_reached_by_one_tenant(
    fresh_redis: LocalRedis,
) -> None:
    light, heavy = Tenant("a", weight=1.0), Tenant("b", weight=3.0)

    async def shared() -> dict[str, float]:
        qs = queues(fresh_redis.url)
        enter = [q.enter for q in qs]
        try:
            return await saturate(enter, [q.leave for q in qs], [light, heavy], 3.0)
        finally:
            for q in qs:
                await q.close()

    async def local() -> dict[str, float]:
        qs = [FairQueue(lambda: SLOTS // 2) for _ in range(2)]

        async def leave(q: FairQueue, ticket: object, cost: float) -> None:
            q.leave(ticket, cost)  # type: ignore[arg-type]

        leaves = [lambda t, c, q=q: leave(q, t, c) for q in qs]
        return await saturate([q.enter for q in qs], leaves, [light, heavy], 1.0)

    got = asyncio.run(shared())
    assert got["b"] / got["a"] == pytest.approx(3.0, rel=0.05), got
    alone = asyncio.run(local())  # each ingress orders only its own tenant: 1:1
    assert alone["b"] / alone["a"] == pytest.approx(1.0, rel=0.05), alone


def test_a_higher_priority_at_one_ingress_goes_before_a_lower_one_at_the_other(
    fresh_redis: LocalRedis,
) -> None:
    async def run() -> list[str]:
        one, two = queues(fresh_redis.url, slots=1)
        started: list[str] = []
        held = await one.enter(Tenant("x"), 10, 1, None)  # the one slot

        async def go(q: SharedFairQueue, tenant: Tenant) -> None:
            ticket = await q.enter(tenant, 10, 1, None)
            started.append(tenant.name)
            await asyncio.sleep(0.01)
            await q.leave(ticket, 10)

        tasks = [asyncio.create_task(go(one, Tenant(f"low{i}"))) for i in range(3)]
        await asyncio.sleep(0.1)
        tasks.append(asyncio.create_task(go(two, Tenant("high", priority=5))))
        await asyncio.sleep(0.1)
        await one.leave(held, 10)
        await asyncio.gather(*tasks)
        for q in (one, two):
            await q.close()
        return started

    assert asyncio.run(run())[0] == "high"


def test_a_deadline_refuses_and_a_leaving_client_gives_its_place_back(
    fresh_redis: LocalRedis,
) -> None:
    async def run() -> None:
        one, two = queues(fresh_redis.url, slots=1)
        held = await one.enter(Tenant("x"), 10, 1, None)
        with pytest.raises(APIError) as refused:
            await two.enter(Tenant("y"), 10, 1, 0.2)
        assert refused.value.status == 503 and refused.value.code == "queue_timeout"
        gone = asyncio.create_task(two.enter(Tenant("z"), 10, 1, None))
        await asyncio.sleep(0.1)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        after = asyncio.create_task(one.enter(Tenant("w"), 10, 1, None))
        await asyncio.sleep(0.1)
        assert not after.done()
        await one.leave(held, 10)
        ticket = await asyncio.wait_for(after, 2.0)  # neither y nor z took the slot
        await one.leave(ticket, 10)
        assert one.waiting == two.waiting == 0
        for q in (one, two):
            await q.close()

    asyncio.run(run())


def test_a_dead_ingresses_requests_stop_counting(
    fresh_redis: LocalRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("cluster.shared_queue.ALIVE_MS", 300)
    monkeypatch.setattr("cluster.shared_queue.BEAT_S", 0.1)

    async def run() -> None:
        dead, live = queues(fresh_redis.url, slots=1)
        await dead.enter(Tenant("x"), 10, 1, None)  # holds the slot, then its ingress dies
        for task in dead._tasks:
            task.cancel()
        ticket = await asyncio.wait_for(live.enter(Tenant("y"), 10, 1, None), 3.0)
        await live.leave(ticket, 10)
        await live.close()

    asyncio.run(run())


def test_arrivals_keep_their_order_within_a_tenant(fresh_redis: LocalRedis) -> None:
    async def run() -> list[int]:
        one, two = queues(fresh_redis.url, slots=1)
        held = await one.enter(Tenant("x"), 1, 1, None)
        order: list[int] = []
        counter = itertools.count()

        async def go(q: SharedFairQueue) -> None:
            mine = next(counter)
            ticket = await q.enter(Tenant("t"), 0, 1, None)
            order.append(mine)
            await q.leave(ticket, 0)

        tasks = []
        for i in range(6):
            tasks.append(asyncio.create_task(go((one, two)[i % 2])))
            await asyncio.sleep(0.02)
        await one.leave(held, 1)
        await asyncio.gather(*tasks)
        for q in (one, two):
            await q.close()
        return order

    assert asyncio.run(run()) == list(range(6))


def test_a_light_tenant_at_one_ingress_takes_the_express_slot_a_flood_at_the_other_never_does(
    fresh_redis: LocalRedis,
) -> None:
    """2 slots + 1 express. The flood (ingress one) holds both slots and has a waiter W; the
    light tenant (ingress two) runs nothing, under its share: its request starts at once on
    the lane, ahead of W, and W, over its share, never takes the lane (the lane lends a slot:
    W waits until the total is under the slots). A second light request arriving behind W
    waits although the lane is free (the lane goes to the head only), and takes it once W
    has a slot."""

    async def run() -> None:
        flood_q, light_q = queues(fresh_redis.url, slots=2, express=1)
        flood, light = Tenant("flood"), Tenant("light")
        held = [await flood_q.enter(flood, 10, 1, None) for _ in range(2)]
        assert not any(t.express for t in held)
        w = asyncio.create_task(flood_q.enter(flood, 10, 1, None))
        await asyncio.sleep(0.1)
        lane = await asyncio.wait_for(light_q.enter(light, 10, 1, None), 2.0)
        assert lane.express
        await light_q.leave(lane, 10)  # 2 running again, the lane free: W still over its share
        await asyncio.sleep(0.2)
        assert not w.done()
        second = asyncio.create_task(light_q.enter(light, 10, 1, None))  # behind W
        await asyncio.sleep(0.2)
        assert not second.done()
        await flood_q.leave(held[0], 10)  # a slot: W's, then the lane: the light request's
        assert not (await asyncio.wait_for(w, 2.0)).express
        assert (await asyncio.wait_for(second, 2.0)).express
        assert flood_q.local.in_flight == light_q.local.in_flight == 0  # all counted in Redis
        for q in (flood_q, light_q):
            await q.close()

    asyncio.run(run())


def test_a_higher_priority_at_one_ingress_takes_the_lane_by_priority_alone(
    fresh_redis: LocalRedis,
) -> None:
    """2 slots + 1 express, both held by a priority-0 tenant at ingress one. A priority-5
    tenant of weight 0.01 (a share of the slots far under one request) starts on the lane
    at once at ingress two: it outranks what runs. A priority-0 tenant of the same weight
    then waits for a slot with the lane free: neither rule lends it the lane."""

    async def run() -> None:
        one, two = queues(fresh_redis.url, slots=2, express=1)
        held = [await one.enter(Tenant("batch"), 10, 1, None) for _ in range(2)]
        urgent = await asyncio.wait_for(
            two.enter(Tenant("chat", priority=5, weight=0.01), 10, 1, None), 2.0
        )
        assert urgent.express
        await two.leave(urgent, 10)
        meek = asyncio.create_task(two.enter(Tenant("meek", weight=0.01), 10, 1, None))
        await asyncio.sleep(0.2)
        assert not meek.done()
        await one.leave(held[0], 10)
        assert not (await asyncio.wait_for(meek, 2.0)).express
        for q in (one, two):
            await q.close()

    asyncio.run(run())
