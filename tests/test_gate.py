"""The gate without the fair queue: requests beyond the engines' slots wait at the ingress in
arrival order (never in Serve's queue, whose router retries each one it holds), the
admission cap still refuses beyond slots + ``max_queued_requests`` at once, and a client
that goes away while it waits gives its place back."""

from __future__ import annotations

import asyncio

import pytest
from conftest import tiny
from starlette.requests import Request

from cluster.admission import Admission
from cluster.api.errors import APIError
from cluster.config import ClusterArgs
from cluster.gate import REQUEST_LOG, Admitted, Gate
from kvindex.records import RoutingRequest
from replica.messages import EngineRequest
from replica.sampling.params import SamplingParams

PROMPT = list(range(40))


def gate(queued: int = 2) -> Gate:
    """2 replicas x 2 slots, ``queued`` more may wait."""
    args = ClusterArgs(
        num_replicas=2, max_ongoing_requests=2, max_queued_requests=queued, engine=tiny()
    )
    return Gate(args, Admission(args))


def http() -> Request:
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []})


def engine_request(i: int) -> EngineRequest:
    route = RoutingRequest(f"r{i}", [], None, len(PROMPT), 16, 4)
    return EngineRequest(f"r{i}", PROMPT, SamplingParams(max_tokens=4), route)


class Finished:
    """What the gate reads of a finished stream (``actual_cost``)."""

    cached_tokens = 0
    delivered_tokens = 4


async def enter(door: Gate, i: int) -> Admitted:
    return await door.enter(http(), [engine_request(i)])


def leave(admitted: Admitted) -> None:
    admitted.leave([Finished()])  # type: ignore[list-item]


def test_beyond_the_slots_requests_wait_in_arrival_order_and_the_cap_refuses_the_rest() -> None:
    async def go() -> None:
        door = gate(queued=2)
        running = [await enter(door, i) for i in range(4)]  # the 4 slots: no wait
        waiting = [asyncio.create_task(enter(door, i)) for i in (4, 5)]
        await asyncio.sleep(0)
        assert door.queue.waiting == 2 and not any(t.done() for t in waiting)
        with pytest.raises(APIError) as refused:  # slots + queued = 6 held: the 7th refused
            await enter(door, 6)
        assert (refused.value.status, refused.value.code) == (503, "overloaded")
        leave(running.pop())  # one slot frees: the first to wait goes, the second still waits
        done, _ = await asyncio.wait(waiting, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.sleep(0.05)
        assert done == {waiting[0]} and not waiting[1].done()
        running.append(waiting[0].result())
        leave(running.pop(0))
        running.append(await waiting[1])
        for admitted in running:
            leave(admitted)
        assert (door.queue.in_flight, door.queue.waiting, door.admission.in_flight) == (0, 0, 0)

    asyncio.run(go())


def test_a_request_whose_client_left_while_waiting_gives_its_place_back() -> None:
    async def go() -> None:
        door = gate(queued=4)
        running = [await enter(door, i) for i in range(4)]
        gone = asyncio.create_task(enter(door, 4))
        after = asyncio.create_task(enter(door, 5))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        assert door.admission.in_flight == 5 and door.queue.waiting == 1
        leave(running.pop())
        running.append(await after)  # the slot went to the one still waiting
        for admitted in running:
            leave(admitted)
        assert (door.queue.in_flight, door.queue.waiting, door.admission.in_flight) == (0, 0, 0)

    asyncio.run(go())


def test_the_cost_estimate_is_not_computed_without_fair_queue_or_quotas(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without them nothing reads it, and it would query the router's mirror per request."""

    def never(_request: EngineRequest) -> int:
        raise AssertionError("estimated_cost called")

    monkeypatch.setattr("cluster.gate.estimated_cost", never)

    async def go() -> None:
        leave(await enter(gate(), 0))

    asyncio.run(go())


def test_every_request_leaves_one_line_in_the_request_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def go() -> None:
        door = gate()
        leave(await enter(door, 7))

    with caplog.at_level("INFO", logger=REQUEST_LOG.name):
        asyncio.run(go())
    (line,) = [r.getMessage() for r in caplog.records if r.name == REQUEST_LOG.name]
    assert line.startswith("request r7 tenant=default priority=0 waited_s=0.000 express=False")
    assert "prompt_tokens=40 cached_tokens=0 output_tokens=4 charged=44 session=-" in line
