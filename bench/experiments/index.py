"""``index``: Redis index query latency, publish throughput and memory per indexed block;
with ``--scale``, what the index costs as replicas grow (``scale``), queried in Redis and
routed from a mirror (``decision_p50_ms``, ``decision_p99_ms``, ``routed_per_s``)."""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from typing import Any

import redis

from bench.harness.index_scale import measure_scale
from bench.harness.redis_server import LocalRedis
from kvindex.config import IndexConfig
from kvindex.hashing import BlockHasher
from kvindex.measure import percentile
from kvindex.reader import IndexReader
from kvindex.writer import IndexWriter


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", help="use this Redis (default: start a local one)")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=100_000, help="blocks indexed in all")
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=64, help="hashes per publish (one step)")
    parser.add_argument(
        "--scale", default="", help="replica counts to measure one by one, e.g. 16,256,1024"
    )
    parser.add_argument("--blocks-per-replica", type=int, default=1024, help="with --scale")
    parser.add_argument(
        "--full-scale-blocks",
        type=int,
        default=100_000,
        help="with --scale, at 1,024 replicas and more: blocks per replica in the mirror's "
        "memory at full scale (its holder table alone, no Redis)",
    )
    parser.add_argument(
        "--routers", type=int, default=8, help="with --scale: mirrors following the log"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        url = args.redis_url or stack.enter_context(LocalRedis()).url
        result = measure(url, args)
        counts = [int(n) for n in args.scale.split(",") if n]
        if counts:
            result["scale"] = [measure_scale(url, n, args) for n in counts]
        return result


def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    # no heartbeat thread here: a TTL longer than the run keeps every replica live
    config = IndexConfig(
        url=url, cluster=f"bench-{os.getpid()}", timeout_s=1.0, heartbeat_ttl_s=3600
    )
    writer, reader = IndexWriter(config, "bench-model"), IndexReader(config, "bench-model")
    client = redis.Redis.from_url(url)
    mem_before = client.info("memory")["used_memory"]

    hasher = BlockHasher(args.block_size, "bench-model")
    chain = hasher.chain([(i * 31) % 50_000 for i in range(args.prompt_tokens)])
    per_replica = args.blocks // args.replicas
    # replica r holds the first r/replicas of the prompt's chain plus unrelated blocks
    publish_times: list[float] = []
    for r in range(args.replicas):
        rid = f"replica-{r}"
        writer.register(rid, "epoch-1")
        held = chain[: len(chain) * r // args.replicas]
        filler = [os.urandom(16) for _ in range(per_replica - len(held))]
        blocks = held + filler
        for i in range(0, len(blocks), args.batch):
            t0 = time.perf_counter()
            writer.publish(rid, "epoch-1", blocks[i : i + args.batch])
            publish_times.append(time.perf_counter() - t0)
    indexed = sum(len(reader.replica_blocks(f"replica-{r}")) for r in range(args.replicas))
    mem_after = client.info("memory")["used_memory"]

    for _ in range(50):  # warm up the script cache and the connection
        reader.cached(chain)
    latencies = []
    for _ in range(args.queries):
        t0 = time.perf_counter()
        answer = reader.cached(chain)
        latencies.append(time.perf_counter() - t0)
    assert answer is not None and len(answer) == args.replicas
    for r in range(args.replicas):
        writer.deregister(f"replica-{r}", "epoch-1")
    return {
        "replicas": args.replicas,
        "blocks_indexed": indexed,
        "prompt_blocks": len(chain),
        "query_p50_ms": percentile(latencies, 50) * 1e3,
        "query_p99_ms": percentile(latencies, 99) * 1e3,
        "publish_batch": args.batch,
        "publish_p50_ms": percentile(publish_times, 50) * 1e3,
        "publish_blocks_per_s": args.batch * len(publish_times) / sum(publish_times),
        "memory_bytes_per_block": (mem_after - mem_before) / max(indexed, 1),
        "answer": answer,
    }
