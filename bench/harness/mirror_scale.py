"""What routing from a mirror of the index costs (``kvindex.mirror``), on the index that
``index_scale`` filled: a decision's time (the mirror's answer plus the routing core's
ranking, no Redis on the path), the mirror's memory and snapshot time, how stale it is
(a replica's publish until a router sees it), and what Redis spends per routed request
when ``routers`` mirrors follow the log: the booking's scripts, the events they append
and every follower reading them. Redis's own CPU time (``commandstats``) is what bounds
routed requests per second, as in ``index_scale``.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
import tracemalloc
from typing import Any

import redis

from kvindex.config import IndexConfig
from kvindex.mirror import IndexMirror
from kvindex.reader import IndexReader
from kvindex.records import Booking, RoutingRequest
from kvindex.writer import IndexWriter
from replica.engine.stats import percentile
from router.config import make_policy, routing_config
from router.core import RoutingCore

MODEL = "bench-model"


def measure_mirror(
    url: str, config: IndexConfig, chains: dict[str, list[bytes]], n: int, args: Any
) -> dict[str, Any]:
    mirror, memory, snapshot_s = _snapshot(config)
    rids = [f"replica-{r}" for r in range(n)]
    decisions = {
        layout: _decisions(mirror, rids, chain, args.block_size, args.queries)
        for layout, chain in chains.items()
    }
    staleness = _staleness(config, mirror)
    mirror.stop()
    routed = _routed_with_followers(url, config, chains["tenant"], args.routers)
    blocks = n * args.blocks_per_replica
    return {
        "decision_p50_ms": decisions["tenant"]["decision_p50_ms"],
        "decision_p99_ms": decisions["tenant"]["decision_p99_ms"],
        "routed_per_s": routed["routed_per_s"],
        "decisions": decisions,
        "mirror_memory_mb": memory / 2**20,
        "mirror_bytes_per_block": memory / blocks,
        "snapshot_s": snapshot_s,
        "staleness_p50_ms": percentile(staleness, 50) * 1e3,
        "staleness_p99_ms": percentile(staleness, 99) * 1e3,
        "followers": routed,
    }


def _snapshot(config: IndexConfig) -> tuple[IndexMirror, int, float]:
    """A mirror's snapshot of the filled index: its memory (Python's allocations, traced
    in a second snapshot) and the time an untraced one takes."""
    mirror = IndexMirror(config, MODEL)
    start = time.perf_counter()
    mirror.step()
    snapshot_s = time.perf_counter() - start
    gc.collect()
    tracemalloc.start()
    traced = IndexMirror(config, MODEL)
    traced.resync()
    memory = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    traced.stop()
    mirror.start()
    return mirror, memory, snapshot_s


def _decisions(
    mirror: IndexMirror, rids: list[str], chain: list[bytes], block_size: int, queries: int
) -> dict[str, float]:
    """The mirror's answer, and a whole decision (answer, states, ``prefill_cost``'s rank)."""
    core = RoutingCore(make_policy(routing_config(policy="prefill_cost")))
    request = RoutingRequest("bench", chain, chain[0], len(chain) * block_size + 7, block_size, 64)
    answers, decisions = [], []
    for _ in range(max(50, min(queries, 2000))):
        t0 = time.perf_counter()
        answer = mirror.query(chain)
        t1 = time.perf_counter()
        core.decide(request, core.states(rids, answer, chain))
        t2 = time.perf_counter()
        answers.append(t1 - t0)
        decisions.append(t2 - t0)
    assert answer is not None and len(answer) == len(rids)
    return {
        "answer_p50_ms": percentile(answers, 50) * 1e3,
        "answer_p99_ms": percentile(answers, 99) * 1e3,
        "decision_p50_ms": percentile(decisions, 50) * 1e3,
        "decision_p99_ms": percentile(decisions, 99) * 1e3,
    }


def _staleness(config: IndexConfig, mirror: IndexMirror, repeats: int = 200) -> list[float]:
    """From a replica's publish call until the mirror (following on its thread) holds it."""
    writer = IndexWriter(config, MODEL)
    seconds = []
    for _ in range(repeats):
        block = os.urandom(16)
        start = time.perf_counter()
        writer.publish("replica-0", "epoch-1", [block])
        while block not in mirror.state.holders:
            time.sleep(0)
        seconds.append(time.perf_counter() - start)
        writer.publish("replica-0", "epoch-1", [], [block])
    writer.close()
    return seconds


def _routed_with_followers(
    url: str, config: IndexConfig, chain: list[bytes], routers: int, requests: int = 400
) -> dict[str, Any]:
    """Redis time per routed request (book, first token, release) while ``routers``
    mirrors follow the log; their liveness polls are timed apart (they cost per second,
    not per request)."""
    client = redis.Redis.from_url(url)
    mirrors = [IndexMirror(config, MODEL, live_poll_s=3600.0).start() for _ in range(routers)]
    reader = IndexReader(config, MODEL)
    for m in mirrors:
        assert m.wait_for(0, timeout_s=120)
    seq_before = int(client.get(f"{reader.namespace}:evseq") or 0)
    client.config_resetstat()
    loop = asyncio.new_event_loop()
    for i in range(requests):
        booking = Booking(f"replica-{i % 4}", f"r{i}", 512, 4, tuple(chain))
        loop.run_until_complete(_book_cycle(reader, booking))
    seq = int(client.get(f"{reader.namespace}:evseq") or 0)
    for m in mirrors:
        assert m.wait_for(seq, timeout_s=120)
    stats = client.info("commandstats")
    scripts_us = stats.get("cmdstat_evalsha", {}).get("usec", 0)
    reads_us = stats.get("cmdstat_xread", {}).get("usec", 0)
    client.config_resetstat()
    for m in mirrors[:1]:
        for _ in range(20):
            m._poll_live()
    live_us = client.info("commandstats").get("cmdstat_evalsha", {}).get("usec", 0) / 20
    loop.close()
    for m in mirrors:
        m.stop()
    reader.close()
    per_request_us = (scripts_us + reads_us) / requests
    polls_per_s = routers / config.heartbeat_interval_s
    return {
        "routers": routers,
        "redis_us_per_routed_request": per_request_us,
        "scripts_us_per_request": scripts_us / requests,
        "log_reads_us_per_request": reads_us / requests,
        "events_per_routed_request": (seq - seq_before) / requests,
        "liveness_poll_us": live_us,
        "liveness_share_of_redis": polls_per_s * live_us / 1e6,
        "routed_per_s": (1e6 - polls_per_s * live_us) / per_request_us,
    }


async def _book_cycle(reader: IndexReader, booking: Booking) -> None:
    await reader.abook(booking, predict_ttl_s=5.0, booking_ttl_s=60.0)
    await reader.aprefill_done(booking.replica_id, booking.request_id)
    await reader.arelease(booking.replica_id, booking.request_id)
