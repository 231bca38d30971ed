"""What one Redis index costs as the cluster grows: N registered replicas, each holding
``blocks_per_replica`` blocks, and the operations a routed request and a replica make.

Redis runs commands one at a time, so its CPU time per operation bounds the cluster: the
``commandstats`` of the server (reset before each measurement) give the commands each
script runs inside Redis and the microseconds Redis spent, not just the round trip seen
by the client. From those: the routed requests per second one Redis can take, and the
share of it that heartbeats of N replicas use.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import redis

from bench.harness.mirror_scale import measure_mirror
from kvindex.config import IndexConfig
from kvindex.hashing import BlockHasher
from kvindex.measure import percentile
from kvindex.reader import IndexReader
from kvindex.records import Booking
from kvindex.writer import IndexWriter


def redis_cost(client: redis.Redis) -> tuple[int, int]:
    """(commands, microseconds) Redis has executed since the last ``CONFIG RESETSTAT``,
    EVALSHA's own entry excluded (its inner commands are counted, its time includes them)."""
    stats = client.info("commandstats")
    calls = sum(v["calls"] for k, v in stats.items() if k != "cmdstat_evalsha")
    usec = sum(v["usec"] for k, v in stats.items() if k == "cmdstat_evalsha")
    return calls, usec


def _timed(client: redis.Redis, repeats: int, op: Any) -> dict[str, float]:
    """Round trip p50/p99 (ms), inner commands and Redis microseconds per call of ``op``."""
    client.config_resetstat()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        op()
        times.append(time.perf_counter() - t0)
    calls, usec = redis_cost(client)
    return {
        "p50_ms": percentile(times, 50) * 1e3,
        "p99_ms": percentile(times, 99) * 1e3,
        "redis_commands": calls / repeats,
        "redis_us": usec / repeats,
    }


# The prompts queried, and who holds them (every replica also holds unrelated blocks up
# to ``blocks_per_replica``):
# * ``tenant``: a tenant's 64-block prompt, held whole by two replicas, its first 2 blocks
#   (a chat template's head) by every replica: the common case of a multi-tenant cluster.
# * ``global``: a 64-block prompt whose first 37 blocks (a 600-token system prompt every
#   tenant shares) every replica holds, the rest two replicas: a prompt hot everywhere.
# * ``staircase``: replica r holds the first r/N of a 64-block prompt: every replica holds a
#   different length of one prompt, the most work a query can meet.
LAYOUTS = ("tenant", "global", "staircase")


def _held(layout: str, r: int, n: int, chain: list[bytes]) -> list[bytes]:
    if layout == "staircase":
        return chain[: len(chain) * r // n]
    shared = 2 if layout == "tenant" else 37
    return chain if r < 2 else chain[:shared]


def _fill(writer: IndexWriter, n: int, blocks: int, held: Any) -> None:
    """Register ``n`` replicas, replica r holding ``held(r)`` and unrelated blocks."""
    for r in range(n):
        rid = f"replica-{r}"
        writer.register(rid, "epoch-1")
        mine = held(r)
        batch = mine + [os.urandom(16) for _ in range(blocks - len(mine))]
        for i in range(0, len(batch), 512):
            writer.publish(rid, "epoch-1", batch[i : i + 512])


def measure_scale(url: str, n: int, args: Any) -> dict[str, Any]:
    """The index with ``n`` replicas: memory, and the cost of each operation."""
    config = IndexConfig(
        url=url, cluster=f"scale-{n}-{os.getpid()}", timeout_s=5.0, heartbeat_ttl_s=3600
    )
    writer, reader = IndexWriter(config, "bench-model"), IndexReader(config, "bench-model")
    client = redis.Redis.from_url(url)
    hasher = BlockHasher(args.block_size, "bench-model")
    chains = {
        layout: hasher.chain([k * 7 + 1] * 4 + list(range(64 * args.block_size - 4)))
        for k, layout in enumerate(LAYOUTS)
    }
    for layout in ("global", "tenant"):  # the same head: the chat template's first blocks
        chains[layout] = chains["global"][:2] + chains[layout][2:]
    mem_before = client.info("memory")["used_memory"]
    _fill(
        writer,
        n,
        args.blocks_per_replica,
        lambda r: sorted({h for lay in LAYOUTS for h in _held(lay, r, n, chains[lay])}),
    )
    memory = client.info("memory")["used_memory"] - mem_before
    queries = max(20, min(args.queries, 20_000 // n))
    query = {
        layout: _timed(client, queries, lambda c=chains[layout]: reader.query(c))
        for layout in LAYOUTS
    }
    beat = _timed(client, 200, lambda: writer.heartbeat("replica-0", "epoch-1", {"x": 1}))
    publish = _timed(client, 200, lambda: writer.publish("replica-1", "epoch-1", [os.urandom(16)]))
    booking = Booking("replica-0", "req", 512, 4, tuple(chains["tenant"]))
    loop = asyncio.new_event_loop()  # one loop: the async client's connections live on it
    route = _timed(client, 100, lambda: loop.run_until_complete(_book_cycle(reader, booking)))
    loop.close()
    mirrored = measure_mirror(url, config, chains, n, args)
    for r in range(n):
        writer.deregister(f"replica-{r}", "epoch-1")
    writer.close()
    reader.close()
    per_request_us = query["tenant"]["redis_us"] + route["redis_us"]
    beats_per_s = n / config.heartbeat_interval_s
    return {
        "replicas": n,
        "blocks_indexed": n * args.blocks_per_replica,
        "memory_mb": memory / 2**20,
        "memory_bytes_per_block": memory / (n * args.blocks_per_replica),
        "query": query,
        "book_prefill_done_release": route,
        "heartbeat": beat,
        "publish_one_block": publish,
        "redis_ops_per_request": 4,  # query, book, prefill_done, release: one script each
        "redis_commands_per_request": query["tenant"]["redis_commands"] + route["redis_commands"],
        "heartbeats_per_s": beats_per_s,
        "heartbeat_share_of_redis": beats_per_s * beat["redis_us"] / 1e6,
        "max_routed_requests_per_s": 1e6 / per_request_us if per_request_us else None,
        **mirrored,  # routing from a mirror: decision_p50_ms, decision_p99_ms, routed_per_s
    }


async def _book_cycle(reader: IndexReader, booking: Booking) -> None:
    """One routed request's writes: book, prefill done, release."""
    await reader.abook(booking, predict_ttl_s=5.0, booking_ttl_s=60.0)
    await reader.aprefill_done(booking.replica_id, booking.request_id)
    await reader.arelease(booking.replica_id, booking.request_id)
