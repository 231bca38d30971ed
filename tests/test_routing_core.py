"""One routing core: the Serve router and the simulator decide through the same calls.

The same index state (replicas holding the same blocks) is put into Redis (the Serve router
reads it through ``IndexReader``) and into the simulator's in-memory index; the same twelve
requests are then routed by the real ``PrefixAwareRequestRouter`` (Serve's adapter, driven
without Serve) and by the real ``Simulation`` placement. Every decision and every booking
must be the same: rankings, cache credits, predicted prefill tokens, decode blocks. Each
request's booking feeds the next decision on both sides (Redis and the simulated index).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import tiny
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve._private.request_router.common import ReplicaQueueLengthCache

from bench.harness.redis_server import LocalRedis
from bench.sim.cost_model import CostModel
from bench.sim.simulator import Simulation, _Pending
from bench.workloads import TraceRequest
from kvindex.config import IndexConfig
from kvindex.hashing import BlockHasher
from kvindex.records import Booking, ReplicaTable, RoutingRequest
from kvindex.writer import IndexWriter
from replica.engine.blocks.prefix_cache import CacheEvents
from router import routing_stats
from router.config import make_policy, routing_config
from router.core import Decision, RoutingCore
from router.serve.queue_lengths import QueueLengths
from router.serve.router import PrefixAwareRequestRouter

MODEL = "tiny-llama-6m"
REPLICAS = ["sim-0000", "sim-0001", "sim-0002"]
HASHER = BlockHasher(16, MODEL)
PREFIXES = [[256] + [(7 * p + i) % 256 for i in range(16 * (2 + p) - 1)] for p in range(3)]
HELD = {"sim-0000": PREFIXES[0], "sim-0001": PREFIXES[1][:48], "sim-0002": []}


def requests() -> list[tuple[RoutingRequest, list[int]]]:
    out = []
    for i in range(12):
        ids = PREFIXES[i % 3] + [i, i + 1, i + 2]
        chain = HASHER.chain(ids)
        key = HASHER.affinity_key(ids, 4, chain=chain)
        out.append((RoutingRequest(f"q{i}", chain, key, len(ids), 16, 8), ids))
    return out


class Recorder:
    """Wraps a core's ``decide`` and ``routed``, keeping what they returned, and the merge
    steps every ``states`` call took (``path``)."""

    def __init__(self, core: RoutingCore) -> None:
        self.decisions: list[Decision] = []
        self.bookings: list[Booking] = []
        self.path: list[str] = []
        decide, routed = core.decide, core.routed
        for step in ("_unknown", "_taken", "_added"):
            self._trace(core, step)

        def record_decide(*args: Any) -> Decision:
            self.decisions.append(decide(*args))
            return self.decisions[-1]

        def record_routed(*args: Any) -> Booking:
            self.bookings.append(routed(*args))
            return self.bookings[-1]

        core.decide, core.routed = record_decide, record_routed  # type: ignore[method-assign]

    def _trace(self, core: RoutingCore, step: str) -> None:
        method = getattr(core, step)

        def traced(*args: Any, **kwargs: Any) -> Any:
            answer = method(*args, **kwargs)
            self.path.append(f"{step}:{type(args[0]).__name__}")
            return answer

        setattr(core, step, traced)


@dataclass(frozen=True)
class FakeId:
    unique_id: str


@dataclass
class FakeReplica:
    replica_id: FakeId


class Unserved(PrefixAwareRequestRouter):
    """The Serve router without Serve: no queue lengths reported yet, no running replicas."""

    _replica_queue_len_cache: dict = {}  # noqa: RUF012 (read through Serve's property)
    _replicas: dict = {}  # noqa: RUF012


def serve_side(redis: LocalRedis, cluster: str, mirror: bool) -> Recorder:
    # with a mirror, the test shares after each decision (not the router's share loop)
    index = IndexConfig(url=redis.url, cluster=cluster, mirror=mirror, share_interval_s=3600)
    writer = IndexWriter(index, MODEL)
    for rid, tokens in HELD.items():
        writer.register(rid, "e1")
        writer.publish(rid, "e1", HASHER.chain(tokens))
    router = Unserved.__new__(Unserved)
    router.initialize_state(
        routing={"policy": "prefill_cost"}, model_id=MODEL, index=index.model_dump()
    )
    recorder = Recorder(router.core)
    candidates = [FakeReplica(FakeId(rid)) for rid in REPLICAS]

    async def drive() -> None:
        if mirror:
            assert router.mirror.wait_for(0)  # synced: no decision falls back to Redis
        for n, (route, _) in enumerate(requests()):
            pending = SimpleNamespace(
                args=[SimpleNamespace(route=route)],
                metadata=SimpleNamespace(internal_request_id=f"internal-{n}"),
            )
            ranked = await router.choose_replicas(candidates, pending)  # type: ignore[arg-type]
            first = ranked[0][0].replica_id
            router.on_request_routed(pending, first, None)  # type: ignore[arg-type]
            await asyncio.gather(*router.channel.tasks)  # the booking in Redis before the next
            if mirror:  # and shared, and in the mirror (the share loop would, within 20 ms)
                assert router.mirror.wait_for(await router.share())

    asyncio.run(drive())
    return recorder


def sim_side() -> Recorder:
    cost = CostModel(base_s=0.01, prefill_token_s=0.0005, decode_seq_s=0.002)
    sim = Simulation(make_policy(routing_config(policy="prefill_cost")), 3, tiny(), cost)
    assert list(sim.replicas) == REPLICAS
    for rid, tokens in HELD.items():
        sim.index.listener(rid)(CacheEvents(stored=tuple(HASHER.chain(tokens)), removed=()))
    recorder = Recorder(sim.core)
    trace = [TraceRequest(route.request_id, 0.0, "", 8) for route, _ in requests()]
    sim.reset(trace)
    for request, (route, ids) in zip(trace, requests(), strict=True):
        assert sim._place(_Pending(request, route, ids), 0.0)
    return recorder


@pytest.mark.parametrize("mirror", [True, False])
def test_the_serve_router_and_the_simulator_make_the_same_decisions(fresh_redis, mirror) -> None:
    serve, sim = serve_side(fresh_redis, "core-test", mirror), sim_side()
    assert len(serve.decisions) == len(sim.decisions) == 12
    for ours, theirs in zip(serve.decisions, sim.decisions, strict=True):
        assert ours.ranking == theirs.ranking
        assert ours.credits == theirs.credits
    assert serve.bookings == sim.bookings
    # one merge path, whatever answered (Redis, a mirror, the simulator's index): the
    # answer's table taken for the candidates, then this router's bookings added
    assert serve.path == sim.path == ["_taken:ReplicaTable", "_added:ReplicaTable"] * 12
    # and the case is not trivial: hits, a spread of first choices, credits that differ
    assert len({b.replica_id for b in serve.bookings}) >= 2
    assert any(b.prefill_tokens < 40 for b in serve.bookings)


def test_queue_lengths_read_as_a_column_equal_serves_cache_read_entry_by_entry() -> None:
    """Random updates, invalidations, removals and time: the column reads what Ray's own
    cache (same calls, public ``get``) reads, candidate by candidate."""
    rng = random.Random(5)
    clock = [1000.0]
    kwargs = {"staleness_timeout_s": 10.0, "get_curr_time_s": lambda: clock[0]}
    theirs, ours = ReplicaQueueLengthCache(**kwargs), ReplicaQueueLengthCache(**kwargs)
    ours = QueueLengths.replacing(ours)
    deployment = DeploymentID(name="EngineReplica", app_name="llm")
    ids = [ReplicaID(f"r{i}", deployment) for i in range(80)]  # past the first 64 rows
    candidates = [rid.unique_id for rid in ids[:70]]  # some the cache knows are not listed
    for step in range(400):
        replica_id, move, length = rng.choice(ids), rng.random(), rng.randrange(5)
        active = set(rng.sample(ids, 60))
        for cache in (theirs, ours):
            if move < 0.7:
                cache.update(replica_id, length)
            elif move < 0.8:
                cache.invalidate_key(replica_id)
            elif move < 0.82:
                cache.remove_inactive_replicas(active_replica_ids=active)
        clock[0] += rng.choice([0.0, 0.1, 0.5, 3.0])
        if step % 7 == 0:
            listed = candidates if step % 2 else list(reversed(candidates))
            want = [theirs.get(rid) or 0 for rid in ids[:70]]
            got = dict(zip(listed, ours.column(listed).tolist(), strict=True))
            assert [got[rid] for rid in candidates] == want, step
            ours.check()
    assert any(theirs.get(rid) for rid in ids) and not all(theirs.get(rid) for rid in ids)


@pytest.mark.parametrize("busy", REPLICAS)
def test_the_serve_router_reads_serves_queue_lengths_as_a_column(fresh_redis, busy) -> None:
    """``initialize_state`` swaps Serve's cache for a ``QueueLengths`` with its entries, and
    a decision counts them: of three idle replicas the one with requests queued goes last."""
    deployment = DeploymentID(name="EngineReplica", app_name="llm")
    serves = ReplicaQueueLengthCache()
    serves.update(ReplicaID(busy, deployment), 3)
    router = Unserved.__new__(Unserved)
    router._replica_queue_len_cache = serves
    index = IndexConfig(url=fresh_redis.url, cluster="queued")
    router.initialize_state(
        routing={"policy": "prefill_cost"}, model_id=MODEL, index=index.model_dump()
    )
    cache = router.replica_queue_len_cache
    assert isinstance(cache, QueueLengths) and cache.get(ReplicaID(busy, deployment)) == 3
    route, _ = requests()[0]
    pending = SimpleNamespace(args=[SimpleNamespace(route=route)])
    candidates = [FakeReplica(FakeId(rid)) for rid in REPLICAS]
    ranked = asyncio.run(router.choose_replicas(candidates, pending))  # type: ignore[arg-type]
    assert [rank[0].replica_id.unique_id for rank in ranked][-1] == busy


def test_a_mirror_that_knows_no_replica_yet_answers_zeros_for_each_candidate() -> None:
    """A mirror synced before any replica registered answers an empty table; Serve's
    candidates are then all unknown (zeros), not an IndexError in ``take`` that left the
    request waiting for a replica forever (seen on a cluster's first request)."""
    empty = ReplicaTable.of([])
    taken = empty.take(REPLICAS)
    assert taken.ids == REPLICAS and not taken.column("cached_blocks").any()
    core = RoutingCore(make_policy(routing_config(policy="prefill_cost")))
    route, _ = requests()[0]
    states = core.states(REPLICAS, empty, route.block_hashes)
    assert sorted(core.decide(route, states).ranking) == REPLICAS


def test_a_decision_that_raises_sends_the_request_to_any_replica(fresh_redis) -> None:
    """A defect in a decision is logged and counted, and the request goes to any replica:
    Serve would otherwise call ``choose_replicas`` again and again, the request stuck."""
    router = Unserved.__new__(Unserved)
    index = IndexConfig(url=fresh_redis.url, cluster="raises")
    router.initialize_state(
        routing={"policy": "prefill_cost"}, model_id=MODEL, index=index.model_dump()
    )

    def broken(*args: Any) -> Decision:
        raise IndexError("a defect")

    router.core.decide = broken  # type: ignore[method-assign]
    route, _ = requests()[0]
    pending = SimpleNamespace(args=[SimpleNamespace(route=route)])
    candidates = [FakeReplica(FakeId(rid)) for rid in REPLICAS]
    before = routing_stats.ROUTING_ERRORS._value.get()
    ranked = asyncio.run(router.choose_replicas(candidates, pending))  # type: ignore[arg-type]
    assert ranked == [candidates]
    assert routing_stats.ROUTING_ERRORS._value.get() == before + 1
    assert router.stats.snapshot({})["routing_errors"] == 1


def test_a_request_reported_completed_before_routed_leaves_no_booking(fresh_redis) -> None:
    """Serve reports a completion from another thread and a routing from the routing task:
    a request cancelled as its replica accepted it can be reported completed first. It
    must leave no booking behind (one that stayed would load its replica until the
    booking's TTL); in the usual order the booking is made, then released."""
    index = IndexConfig(url=fresh_redis.url, cluster="early-done", mirror=False)
    router = Unserved.__new__(Unserved)
    router.initialize_state(
        routing={"policy": "prefill_cost"}, model_id=MODEL, index=index.model_dump()
    )
    candidates = [FakeReplica(FakeId(rid)) for rid in REPLICAS]

    async def route(n: int, completed_first: bool) -> None:
        route, _ = requests()[n]
        pending = SimpleNamespace(
            args=[SimpleNamespace(route=route)],
            metadata=SimpleNamespace(internal_request_id=f"internal-{n}"),
        )
        first = (await router.choose_replicas(candidates, pending))[0][0].replica_id  # type: ignore[arg-type]
        if completed_first:
            router.on_request_completed(first, f"internal-{n}")  # type: ignore[arg-type]
            router.on_request_routed(pending, first, None)  # type: ignore[arg-type]
        else:
            router.on_request_routed(pending, first, None)  # type: ignore[arg-type]
            assert len(router.core.bookings) == 1
            router.on_request_completed(first, f"internal-{n}")  # type: ignore[arg-type]
        assert len(router.core.bookings) == 0 and not router._decisions
        await asyncio.gather(*router.channel.tasks)

    async def drive() -> None:
        await route(0, completed_first=False)
        await route(1, completed_first=True)
        await route(2, completed_first=False)  # the early record was for another request

    asyncio.run(drive())
