"""Load from several tenants at once, each with its own API key, as outside clients.

``drive_tenants``: each tenant's trace open loop (every request sent at its arrival time),
until a cut-off after which whatever is still waiting or running is abandoned: its client
disconnects, as a client that gave up does, and the cluster drops it (so a backlog that
would take minutes to drain does not). ``closed_loop``: as many requests in flight as
given, each sent when one finishes, for a while: what the cluster serves when saturated.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence

import httpx

from bench.loadgen import RequestResult, new_traceparent, send
from bench.workloads import TraceRequest

CUT_OFF = "cut off"  # the error of a request abandoned at the cut-off


def _client(base_url: str, key: str, timeout_s: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    headers = {"authorization": f"Bearer {key}"}
    return httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits, headers=headers)


def drive_tenants(
    base_url: str,
    model: str,
    traces: Mapping[str, tuple[str, Sequence[TraceRequest]]],
    cut_off_s: float,
    traced: frozenset[str] = frozenset(),
) -> dict[str, list[RequestResult]]:
    """``traces``: per tenant, its API key and its trace. Returns each tenant's results.
    ``traced``: the tenants whose requests ask to be traced (a sampled ``traceparent``)."""
    return asyncio.run(_drive_tenants(base_url, model, traces, cut_off_s, traced))


async def _drive_tenants(
    base_url: str,
    model: str,
    traces: Mapping[str, tuple[str, Sequence[TraceRequest]]],
    cut_off_s: float,
    traced: frozenset[str],
) -> dict[str, list[RequestResult]]:
    clients = {name: _client(base_url, key, cut_off_s + 30) for name, (key, _) in traces.items()}
    start = time.monotonic()

    async def one(name: str, req: TraceRequest) -> RequestResult:
        await asyncio.sleep(max(0.0, start + req.arrival_s - time.monotonic()))
        result = RequestResult(req.request_id, name, status=0)
        left = start + cut_off_s - time.monotonic()
        headers = {"traceparent": new_traceparent()} if name in traced else None
        try:
            sent = send(clients[name], model, req, result, headers)
            await asyncio.wait_for(sent, max(left, 0.001))
        except TimeoutError:
            result.error = CUT_OFF
        return result

    try:
        tasks = {
            name: [asyncio.ensure_future(one(name, r)) for r in trace]
            for name, (_, trace) in traces.items()
        }
        return {name: list(await asyncio.gather(*ts)) for name, ts in tasks.items()}
    finally:
        for client in clients.values():
            await client.aclose()


def closed_loop(
    base_url: str,
    model: str,
    key: str,
    request: Callable[[int], TraceRequest],
    concurrency: int,
    duration_s: float,
) -> float:
    """Requests completed per second with ``concurrency`` always in flight (``request(i)``
    makes the i-th), over ``duration_s`` seconds; a request still running then is not
    counted."""
    sent, done = 0, 0
    end = time.monotonic() + duration_s

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal sent, done
        while time.monotonic() < end:
            sent += 1
            req = request(sent)
            try:
                result = await asyncio.wait_for(
                    send(client, model, req), max(end - time.monotonic(), 0.001)
                )
            except TimeoutError:
                return
            if result.status != 200 or result.error is not None:
                raise RuntimeError(f"calibration request failed: {result.error}")
            done += 1

    async def go() -> None:
        async with _client(base_url, key, duration_s + 60) as client:
            await asyncio.gather(*(worker(client) for _ in range(concurrency)))

    asyncio.run(go())
    return done / duration_s
