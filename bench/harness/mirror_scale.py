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

import numpy as np
import redis
from ray.serve._private.common import DeploymentID, ReplicaID

from kvindex.config import IndexConfig
from kvindex.measure import percentile
from kvindex.mirror import IndexMirror
from kvindex.mirror.holder_table import HolderTable
from kvindex.reader import IndexReader
from kvindex.records import Booking, RoutingRequest
from kvindex.writer import IndexWriter
from router.config import make_policy, routing_config
from router.core import RoutingCore
from router.serve.queue_lengths import QueueLengths

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
    routed = _routed_with_followers(url, config, chains["tenant"], args.routers, n)
    blocks = n * args.blocks_per_replica
    return {
        "decision_p50_ms": decisions["tenant"]["decision_p50_ms"],
        "decision_p99_ms": decisions["tenant"]["decision_p99_ms"],
        "routed_per_s": routed["routed_per_s"],
        "decisions": decisions,
        "mirror_memory_mb": memory / 2**20,
        "mirror_bytes_per_block": memory / blocks,
        "snapshot_s": snapshot_s,
        "mirror_at_full_scale": holders_memory(n, args.full_scale_blocks) if n >= 1024 else None,
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
    """The mirror's answer, and a whole decision as Serve's router takes it (answer, Serve's
    queue lengths, states, ``prefill_cost``'s rank), half the replicas with requests queued
    in Serve's cache of queue lengths (a busy cluster's: each sent request is counted)."""
    core = RoutingCore(make_policy(routing_config(policy="prefill_cost")))
    request = RoutingRequest("bench", chain, chain[0], len(chain) * block_size + 7, block_size, 64)
    queued = QueueLengths()
    deployment = DeploymentID(name="EngineReplica", app_name="bench")
    for k, rid in enumerate(rids[::2]):
        queued.update(ReplicaID(rid, deployment), 1 + k % 3)
    answers, decisions = [], []
    for _ in range(max(50, min(queries, 2000))):
        t0 = time.perf_counter()
        answer = mirror.query(chain)
        t1 = time.perf_counter()
        core.decide(request, core.states(rids, answer, chain, queued))
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
        while not mirror.state.holds("replica-0", block):
            time.sleep(0)
        seconds.append(time.perf_counter() - start)
        writer.publish("replica-0", "epoch-1", [], [block])
    writer.close()
    return seconds


def _routed_with_followers(
    url: str, config: IndexConfig, chain: list[bytes], routers: int, n: int
) -> dict[str, Any]:
    """Redis time per routed request while ``routers`` mirrors follow the log: bookings
    shared (one ``SHARE`` per router every ``share_interval_s``, at the rate of 10,000
    routed requests/s over the routers, so ``per_share`` requests each), and, for
    comparison, written one script per change (``book``, first token, release). The
    followers' liveness polls are timed apart: they cost per second, not per request."""
    client = redis.Redis.from_url(url)
    mirrors = [IndexMirror(config, MODEL, live_poll_s=3600.0).start() for _ in range(routers)]
    reader = IndexReader(config, MODEL)
    for m in mirrors:
        assert m.wait_for(0, timeout_s=120)
    loop = asyncio.new_event_loop()
    per_share = max(1, round(10_000 / routers * config.share_interval_s))
    shared = _redis_time(
        client, reader, mirrors, 400, lambda k: _share_round(reader, loop, chain, n, k, per_share)
    )
    booked = _redis_time(
        client,
        reader,
        mirrors,
        200,
        lambda k: loop.run_until_complete(
            _book_cycle(reader, Booking(f"replica-{k % n}", f"b{k}", 512, 4, tuple(chain)))
        ),
    )
    client.config_resetstat()
    for _ in range(20):
        mirrors[0]._poll_live()
    live_us = client.info("commandstats").get("cmdstat_evalsha", {}).get("usec", 0) / 20
    loop.close()
    for m in mirrors:
        m.stop()
    reader.close()
    polls_per_s = routers / config.heartbeat_interval_s
    budget_us = 1e6 - polls_per_s * live_us  # what Redis has left for routing, per second
    shared["us"] /= per_share
    shared["events"] /= per_share
    return {
        "routers": routers,
        "requests_per_share": per_share,
        "redis_us_per_routed_request": shared["us"],
        "events_per_routed_request": shared["events"],
        "booked_redis_us_per_routed_request": booked["us"],
        "booked_events_per_routed_request": booked["events"],
        "liveness_poll_us": live_us,
        "liveness_share_of_redis": polls_per_s * live_us / 1e6,
        "routed_per_s": budget_us / shared["us"],
        "booked_routed_per_s": budget_us / booked["us"],
    }


def _redis_time(
    client: redis.Redis, reader: IndexReader, mirrors: list[IndexMirror], rounds: int, run: Any
) -> dict[str, float]:
    """Redis microseconds (scripts and the followers' log reads) and events per round."""
    seq_key = f"{reader.namespace}:evseq"
    before = int(client.get(seq_key) or 0)
    client.config_resetstat()
    for k in range(rounds):
        run(k)
    seq = int(client.get(seq_key) or 0)
    for m in mirrors:
        assert m.wait_for(seq, timeout_s=120)
    stats = client.info("commandstats")
    used = sum(stats.get(f"cmdstat_{c}", {}).get("usec", 0) for c in ("evalsha", "xread"))
    return {"us": used / rounds, "events": (seq - before) / rounds}


def _share_round(
    reader: IndexReader, loop: Any, chain: list[bytes], n: int, k: int, per_share: int
) -> None:
    """One router's share after ``per_share`` more requests (as many finished meanwhile)."""
    totals = {f"replica-{r}": (512 * (r % 3), 8 + r % 5, 40 + r % 7) for r in range(min(n, 64))}
    predictions = [(f"replica-{(k * per_share + i) % n}", chain) for i in range(per_share)]
    loop.run_until_complete(reader.ashare(f"router-{k % 8}", 3.0, totals, predictions, 5.0))


async def _book_cycle(reader: IndexReader, booking: Booking) -> None:
    await reader.abook(booking, predict_ttl_s=5.0, booking_ttl_s=60.0)
    await reader.aprefill_done(booking.replica_id, booking.request_id)
    await reader.arelease(booking.replica_id, booking.request_id)


def holders_memory(replicas: int, blocks_per_replica: int, seed: int = 0) -> dict[str, float]:
    """What the mirror's block -> holders table takes at full scale (``replicas`` x
    ``blocks_per_replica``, every replica holding two shared head blocks and the rest its
    own), filled as a snapshot fills it (sized once, then replica by replica); no Redis
    (Redis would need the same index twice over to serve it). Peak: while it fills."""
    rng = np.random.default_rng(seed)
    head = rng.integers(1, 2**63, 2, dtype=np.uint64) | np.uint64(1)
    table = HolderTable()
    gc.collect()
    tracemalloc.start()
    start = time.perf_counter()
    table.reserve(replicas * blocks_per_replica)  # as a snapshot does, from the sets' sizes
    for slot in range(replicas):
        own = rng.integers(1, 2**63, blocks_per_replica - 2, dtype=np.uint64) | np.uint64(1)
        table.add(slot, np.concatenate([head, own]))
    fill_s = time.perf_counter() - start
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    entries = replicas * blocks_per_replica
    return {
        "replicas": replicas,
        "blocks_per_replica": blocks_per_replica,
        "memory_mb": current / 2**20,
        "bytes_per_entry": current / entries,
        "peak_mb": peak / 2**20,
        "fill_s": fill_s,
        "cells_used": len(table) / table.keys.size,
    }
