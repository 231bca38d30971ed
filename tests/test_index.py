"""The Redis block index against a real redis-server, alone and fed by a real engine."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import threading
import time
from dataclasses import dataclass

import pytest
import redis
from conftest import tiny

from bench.harness.redis_server import LocalRedis
from bench.sim.index import SimIndex
from kvindex.config import IndexConfig
from kvindex.hashing import BlockHasher
from kvindex.reader import TRIP_AFTER_FAILURES, IndexReader
from kvindex.records import Booking, ReplicaState
from kvindex.scripts import QUERY_FIELDS
from kvindex.writer import IndexWriter, StaleEpochError
from replica.engine.blocks.prefix_cache import CacheEvents
from replica.model.runner import build_engine
from replica.publisher import IndexPublisher
from replica.sampling.params import SamplingParams

MODEL = "tiny-llama-6m"
H = [bytes([i]) * 16 for i in range(8)]  # a stand-in chain of 8 block hashes


@dataclass
class Index:
    """Both halves of one Redis index: a replica's writer and a router's reader."""

    writer: IndexWriter
    reader: IndexReader

    @property
    def namespace(self) -> str:
        return self.writer.namespace


def index_for(server: LocalRedis, model: str = MODEL, **overrides) -> Index:
    config = IndexConfig(url=server.url, **overrides)
    return Index(IndexWriter(config, model), IndexReader(config, model))


def state(replica_id: str, *values: int) -> ReplicaState:
    """What the index answers for a replica, in QUERY's order."""
    return ReplicaState(replica_id, **dict(zip(QUERY_FIELDS, values, strict=True)))


def test_the_query_reply_names_replica_state_fields() -> None:
    fields = {f.name for f in dataclasses.fields(ReplicaState)}
    assert set(QUERY_FIELDS) <= fields and len(set(QUERY_FIELDS)) == len(QUERY_FIELDS)
    # the answer fills every field but what the router derives from the others' runs
    assert set(QUERY_FIELDS) == fields - {"replica_id", "pullable_blocks", "stored_blocks"}


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[256] + [rng.randrange(256) for _ in range(16 * k + 5)] for k in (2, 4, 6)]
    return [systems[i % 3] + [rng.randrange(256) for _ in range(9)] for i in range(n)]


def test_query_gives_each_live_replica_its_longest_consecutive_prefix(fresh_redis) -> None:
    index = index_for(fresh_redis)
    holdings = {"a": H[:4], "b": [H[0], H[1], H[3]], "c": H[1:4], "d": []}
    for rid, blocks in holdings.items():
        index.writer.register(rid, "e1")
        index.writer.publish(rid, "e1", blocks)
    assert index.reader.cached(H[:4]) == {"a": 4, "b": 2, "c": 0, "d": 0}
    assert index.reader.cached(H[:2]) == {"a": 2, "b": 2, "c": 0, "d": 0}
    index.writer.publish("a", "e1", stored=[], removed=[H[2]])
    assert index.reader.cached(H[:4])["a"] == 2
    assert index.reader.cached([]) == {"a": 0, "b": 0, "c": 0, "d": 0}
    assert index.reader.counters.query_failures == 0


def test_an_expired_heartbeat_removes_a_replica_from_answers_and_reap_purges_it(
    fresh_redis,
) -> None:
    index = index_for(fresh_redis, heartbeat_ttl_s=0.3)
    for rid in ("alive", "silent"):
        index.writer.register(rid, "e1")
        index.writer.publish(rid, "e1", H[:3])
    deadline = time.monotonic() + 0.6
    while time.monotonic() < deadline:
        assert index.writer.heartbeat("alive", "e1", stats={"hit_rate": 0.5})
        time.sleep(0.05)
    assert index.reader.cached(H[:3]) == {"alive": 3}
    assert set(index.reader.live_replicas()) == {"alive"}
    assert index.reader.replica_stats() == {"alive": {"hit_rate": 0.5}}
    assert index.writer.reap() == 1
    assert index.reader.replica_blocks("silent") == set()
    client = redis.Redis.from_url(fresh_redis.url)
    assert client.smembers(f"{index.namespace}:b:".encode() + H[0]) == {b"alive"}


def test_a_new_epoch_purges_the_old_entries_and_fences_the_old_writer(fresh_redis) -> None:
    index = index_for(fresh_redis)
    index.writer.register("r", "old")
    index.writer.publish("r", "old", H[:5])
    assert index.writer.register("r", "new") == 5  # purged
    assert index.reader.replica_blocks("r") == set()
    assert index.reader.cached(H[:5]) == {"r": 0}
    with pytest.raises(StaleEpochError):
        index.writer.publish("r", "old", H[:5])
    assert not index.writer.heartbeat("r", "old")
    assert index.writer.register("r", "new") == 0  # same epoch again: nothing purged


def test_deregistration_purges(fresh_redis) -> None:
    index = index_for(fresh_redis)
    index.writer.register("r", "e")
    index.writer.publish("r", "e", H)
    index.writer.deregister("r", "e")
    assert index.reader.cached(H) == {}
    assert index.reader.replica_blocks("r") == set()
    # the namespace's event log (kvindex.mirror) stays, nothing of the replica
    assert keys_left(fresh_redis, index.namespace) == log_keys(index.namespace)


def keys_left(server, namespace: str) -> set[str]:
    client = redis.Redis.from_url(server.url)
    return {k.decode() for k in client.keys(f"{namespace}*".encode())}


def log_keys(namespace: str) -> set[str]:
    return {f"{namespace}:{name}" for name in ("ev", "evseq", "evid")}


def test_namespaces_isolate_two_clusters_on_one_redis(fresh_redis) -> None:
    blue = index_for(fresh_redis, cluster="blue")
    green = index_for(fresh_redis, cluster="green")
    other_model = index_for(fresh_redis, "other-model", cluster="blue")
    blue.writer.register("r1", "e")
    blue.writer.publish("r1", "e", H[:3])
    green.writer.register("r1", "e")
    green.writer.publish("r1", "e", H[:1])
    assert blue.reader.cached(H[:3]) == {"r1": 3}
    assert green.reader.cached(H[:3]) == {"r1": 1}
    assert other_model.reader.cached(H[:3]) == {}
    green.writer.deregister("r1", "e")
    assert blue.reader.cached(H[:3]) == {"r1": 3}


def test_the_index_equals_the_engine_cached_set_through_evictions(fresh_redis) -> None:
    engine = build_engine(tiny(num_blocks=48))
    index = index_for(fresh_redis)
    publisher = IndexPublisher(index.writer, "replica-0").start()
    engine.subscribe(publisher.on_events)
    steps_with_events = 0
    for seed in range(5):
        before = engine.stats().steps
        engine.generate(prompts(6, seed), SamplingParams(max_tokens=20, ignore_eos=True))
        steps_with_events += engine.stats().steps - before
        assert publisher.wait_in_sync(5.0)
        assert index.reader.replica_blocks("replica-0") == engine.cached_block_hashes()
    assert engine.stats().evictions > 0
    # one round trip per step at most, however many blocks changed
    c = publisher.counters
    assert c.batches + c.resyncs <= steps_with_events + 1
    # the router's view: the replica holds the full cached prefix of a prompt it served
    chain = engine.hasher.chain(prompts(6, 4)[0])
    expected = len(engine.block_manager.prefix_cache.lookup(prompts(6, 4)[0]))
    assert index.reader.cached(chain) == {"replica-0": expected}
    publisher.close()
    assert index.reader.cached(chain) == {}


def test_killing_redis_never_stops_the_engine_and_a_resync_repairs_the_index(
    fresh_redis,
) -> None:
    engine = build_engine(tiny(num_blocks=48))
    index = index_for(fresh_redis, retry_after_s=0.1)
    publisher = IndexPublisher(index.writer, "replica-0").start()
    engine.subscribe(publisher.on_events)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    engine.generate(prompts(6, 0), params)
    assert publisher.wait_in_sync(5.0)

    fresh_redis.stop()
    t0 = time.monotonic()
    outs = engine.generate(prompts(6, 1), params)  # evicts and publishes while Redis is gone
    assert all(len(o.token_ids) == 16 for o in outs)
    # unknown, not an error
    assert index.reader.cached(engine.hasher.chain(prompts(6, 1)[0])) is None
    assert time.monotonic() - t0 < 30
    deadline = time.monotonic() + 5
    while publisher.counters.failures == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert publisher.counters.failures > 0
    assert not publisher.in_sync

    fresh_redis.start()  # empty: every entry and the registration are gone
    assert publisher.wait_in_sync(10.0)
    assert index.reader.replica_blocks("replica-0") == engine.cached_block_hashes()
    assert publisher.counters.resyncs >= 2
    assert publisher.counters.registrations >= 2
    publisher.close()


def test_too_many_unsent_changes_fall_back_to_one_resync(fresh_redis) -> None:
    """``IndexConfig.max_pending_hashes`` bounds the changes a publisher keeps while Redis
    does not answer: one more, and it drops them all and owes Redis one resync (the whole
    mirror), which repairs the index once Redis answers again.

    Redis is frozen (SIGSTOP), not down: the publisher's batch waits (``write_timeout_s`` is
    long) instead of failing, so no error can be what causes the resync; only the overflow
    can. Heartbeats are spaced out so that the batch is the publisher's only round trip."""
    engine = build_engine(tiny(num_blocks=48))
    index = index_for(
        fresh_redis,
        write_timeout_s=30.0,
        heartbeat_interval_s=60.0,
        heartbeat_ttl_s=120.0,
        max_pending_hashes=8,
    )
    publisher = IndexPublisher(index.writer, "replica-0").start()
    engine.subscribe(publisher.on_events)
    assert publisher.wait_in_sync(5.0)  # registered, and its (empty) entry sent
    deadline = time.monotonic() + 5
    while not publisher.counters.heartbeats:  # its first heartbeat follows the first send
        assert time.monotonic() < deadline
        time.sleep(0.01)
    pid = redis.Redis.from_url(fresh_redis.url).info("server")["process_id"]
    os.kill(pid, signal.SIGSTOP)
    try:
        engine.generate([[256, *range(40)]], SamplingParams(max_tokens=1))  # 2 blocks: sent
        deadline = time.monotonic() + 5
        while not publisher._in_flight:  # its batch is out, waiting on frozen Redis
            assert time.monotonic() < deadline, "the publisher never sent the first batch"
            time.sleep(0.01)
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        engine.generate(prompts(6, 1), params)  # dozens of changes, none sendable
        assert publisher.counters.overflows == 1
        assert not publisher.in_sync
    finally:
        os.kill(pid, signal.SIGCONT)
    assert publisher.wait_in_sync(10.0)
    assert index.reader.replica_blocks("replica-0") == engine.cached_block_hashes()
    c = publisher.counters
    # the frozen batch went through, then one resync replaced the dropped changes
    assert (c.registrations, c.batches, c.resyncs, c.overflows) == (1, 1, 2, 1)
    assert c.failures == c.dropped_batches == 0
    publisher.close()


def test_queries_answer_unknown_quickly_when_redis_is_down_or_slow(fresh_redis) -> None:
    index = index_for(fresh_redis, timeout_s=0.05, retry_after_s=0.5)
    index.writer.register("r", "e")
    index.writer.publish("r", "e", H[:2])

    def debug_sleep() -> None:
        redis.Redis.from_url(fresh_redis.url).execute_command("DEBUG", "SLEEP", "1.5")

    sleeper = threading.Thread(target=debug_sleep)
    sleeper.start()
    deadline = time.monotonic() + 5
    while True:  # ask until the stall has reached Redis (the sleeper runs on its own thread)
        t0 = time.monotonic()
        answer = index.reader.cached(H[:2])
        if answer is None:  # slow: timed out
            break
        assert answer == {"r": 2} and t0 < deadline, "DEBUG SLEEP never stalled Redis"
    assert time.monotonic() - t0 < 0.3
    # one slow answer does not trip the breaker: the next queries still ask (and time out),
    # until TRIP_AFTER_FAILURES in a row; then, within retry_after_s, nobody asks at all
    for failures in range(2, TRIP_AFTER_FAILURES + 1):
        assert index.reader.cached(H[:2]) is None
        assert index.reader.counters.query_failures == failures
    assert sleeper.is_alive()  # answered "unknown" while Redis was still stalled
    assert index.reader.cached(H[:2]) is None  # within retry_after_s: not even asked...
    assert index.reader.counters.query_failures == TRIP_AFTER_FAILURES  # ...(it would time out)
    assert index.reader.counters.queries_skipped == 1
    sleeper.join()
    deadline = time.monotonic() + 5
    while (answer := index.reader.cached(H[:2])) is None:  # skipped until retry_after_s has passed
        assert time.monotonic() < deadline, "queries never resumed after retry_after_s"
        time.sleep(0.05)
    assert answer == {"r": 2}
    assert index.reader.counters.query_failures == TRIP_AFTER_FAILURES

    fresh_redis.stop()
    down = index_for(fresh_redis)
    t0 = time.monotonic()
    assert down.reader.cached(H[:2]) is None  # down: connection refused
    assert time.monotonic() - t0 < 0.3
    assert down.reader.counters.query_failures == 1


def test_a_keyed_index_stores_only_keyed_hashes(fresh_redis) -> None:
    engine = build_engine(tiny(hash_secret="cluster-secret"))
    index = index_for(fresh_redis)
    publisher = IndexPublisher(index.writer, "replica-0").start()
    engine.subscribe(publisher.on_events)
    batch = prompts(3, 9)
    engine.generate(batch, SamplingParams(max_tokens=4))
    assert publisher.wait_in_sync(5.0)
    stored = index.reader.replica_blocks("replica-0")
    assert stored
    unkeyed = BlockHasher(16, MODEL)
    guesses = {h for p in batch for h in unkeyed.chain(p)}
    client = redis.Redis.from_url(fresh_redis.url)
    keys = set(client.keys(b"*"))
    assert stored.isdisjoint(guesses)
    assert not any(k.endswith(g) for k in keys for g in guesses)
    assert index.reader.cached(unkeyed.chain(batch[0])) == {"replica-0": 0}
    publisher.close()


def test_bookings_from_two_routers_add_up_and_release_exactly(fresh_redis) -> None:
    first, second = index_for(fresh_redis), index_for(fresh_redis)  # two ingress replicas
    for rid in ("r0", "r1"):
        first.writer.register(rid, "e")

    async def scenario() -> list[dict[str, ReplicaState]]:
        seen = []
        await first.reader.abook(Booking("r0", "q1", 100, 10, H[:3]), 5.0, 60.0)
        await second.reader.abook(Booking("r0", "q2", 50, 5, H[:1]), 5.0, 60.0)
        seen.append(second.reader.query(H[:4]).as_dict())
        await first.reader.aprefill_done("r0", "q1")  # its first token: no longer prefill
        seen.append(first.reader.query(H[:4]).as_dict())
        await second.reader.arelease("r0", "q1")
        await first.reader.arelease("r0", "q1")  # a second release changes nothing
        seen.append(first.reader.query(H[:4]).as_dict())
        await first.reader.arelease("r0", "q2")
        seen.append(second.reader.query(H[:4]).as_dict())
        return seen

    booked, prefilled, released, empty = asyncio.run(scenario())
    # predicted: q1 booked H[0..2] there, q2 H[0]: the longest run counts
    assert booked["r0"] == state("r0", 0, 3, 0, 150, 2, 15)
    assert booked["r1"] == state("r1", 0, 0, 0, 0, 0, 0)
    assert prefilled["r0"] == state("r0", 0, 3, 0, 50, 2, 15)
    assert released["r0"] == state("r0", 0, 3, 0, 50, 1, 5)
    assert empty["r0"] == state("r0", 0, 3, 0, 0, 0, 0)


def test_a_lost_release_and_a_prediction_expire(fresh_redis) -> None:
    index = index_for(fresh_redis)
    index.writer.register("r0", "e")
    index.writer.publish("r0", "e", H[:2])

    async def scenario() -> tuple[ReplicaState, ReplicaState]:
        # its ingress dies: no release will ever come for "lost"
        await index.reader.abook(Booking("r0", "lost", 64, 4, H[:6]), 0.3, 0.3)
        before = index.reader.query(H[:6]).state_of("r0")
        deadline = time.monotonic() + 10
        while index.reader.query(H[:6]).state_of("r0").predicted_blocks:  # expire by Redis' clock
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await index.reader.abook(Booking("r0", "next", 32, 2, H[:1]), 60.0, 60.0)
        return before, index.reader.query(H[:6]).state_of("r0")

    before, after = asyncio.run(scenario())
    assert before == state("r0", 2, 6, 2, 64, 1, 4)
    # the next booking on r0 dropped the expired one: only its own load is left
    assert after == state("r0", 2, 1, 2, 32, 1, 2)


def test_deregistration_purges_bookings_and_predictions(fresh_redis) -> None:
    index = index_for(fresh_redis)
    index.writer.register("r0", "e")
    asyncio.run(index.reader.abook(Booking("r0", "q", 10, 1, H[:2]), 60.0, 60.0))
    index.writer.deregister("r0", "e")
    assert keys_left(fresh_redis, index.namespace) == log_keys(index.namespace)


def test_booking_failures_are_counted_never_raised(fresh_redis) -> None:
    index = index_for(fresh_redis)
    fresh_redis.stop()
    assert (
        asyncio.run(index.reader.abook(Booking("r0", "q", 10, 1, H[:2]), 5.0, 60.0)) == 0
    )  # not taken
    assert index.reader.counters.booking_failures == 1


def test_an_evicted_block_is_no_longer_predicted_on_its_replica(fresh_redis) -> None:
    """A prediction stands in for blocks a booked prefill will publish; once the replica
    evicts them they are gone there, however long the prediction had to live (other
    replicas' predictions of the same blocks stay)."""
    index = index_for(fresh_redis)
    for rid in ("r0", "r1"):
        index.writer.register(rid, "e")
    index.writer.publish("r0", "e", H[:4])

    async def book() -> None:
        await index.reader.abook(Booking("r0", "q0", 0, 4, H[:4]), 60.0, 60.0)
        await index.reader.abook(Booking("r1", "q1", 64, 4, H[:4]), 60.0, 60.0)

    asyncio.run(book())
    assert index.reader.query(H[:4]).state_of("r0").predicted_blocks == 4
    index.writer.publish("r0", "e", [], removed=H[2:4])  # evicted
    answer = index.reader.query(H[:4]).as_dict()
    assert (answer["r0"].cached_blocks, answer["r0"].predicted_blocks) == (2, 2)
    assert answer["r1"].predicted_blocks == 4
    left = fresh_redis_members(fresh_redis, f"{index.namespace}:pr:r0")
    assert left == set(H[:2])
    # the simulator's index keeps the same rule
    sim = SimIndex()
    sim.listener("r0")(CacheEvents(tuple(H[:4]), ()))
    sim.book(Booking("r0", "q0", 0, 4, H[:4]), 0.0)
    sim.book(Booking("r1", "q1", 64, 4, H[:4]), 0.0)
    sim.listener("r0")(CacheEvents((), tuple(H[2:4])))
    simulated = sim.query(H[:4], ["r0", "r1"], 1.0).as_dict()
    for rid in ("r0", "r1"):
        assert (simulated[rid].cached_blocks, simulated[rid].predicted_blocks) == (
            answer[rid].cached_blocks,
            answer[rid].predicted_blocks,
        )


def fresh_redis_members(server: LocalRedis, key: str) -> set[bytes]:
    return set(redis.Redis.from_url(server.url).zrange(key, 0, -1))
