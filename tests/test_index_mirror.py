"""A router's mirror of the index (``kvindex.mirror``) answers what Redis answers: after
random publish/evict/replace/deregister/reap sequences with bookings and predictions, after
a dropped connection, after Redis restarted empty and rebuilt, after the log was trimmed
past it, with two mirrors following at once; and a routing decision from the mirror is the
decision from Redis."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time

import pytest
import redis

from kvindex.config import IndexConfig
from kvindex.hashing import BlockHasher
from kvindex.mirror import SNAPSHOT_CHUNK, IndexMirror
from kvindex.mirror.state import MirrorState
from kvindex.reader import IndexReader
from kvindex.records import Booking, Load, RoutingRequest
from kvindex.writer import IndexWriter
from router.config import make_policy, routing_config
from router.core import RoutingCore

MODEL = "mirror-model"
CHAINS = [BlockHasher(16, MODEL).chain([k] * 4 + list(range(k, k + 12 * 16))) for k in range(6)]
CHAINS += [CHAINS[0][:3] + c[3:] for c in CHAINS[1:3]]  # prompts sharing a head


class Index:
    def __init__(self, url: str, cluster: str = "mirror") -> None:
        self.config = IndexConfig(url=url, cluster=cluster, heartbeat_ttl_s=30.0)
        self.writer = IndexWriter(self.config, MODEL)
        self.reader = IndexReader(self.config, MODEL)
        self.client = redis.Redis.from_url(url)
        self.loop = asyncio.new_event_loop()

    def mirror(self, start: bool = False) -> IndexMirror:
        """A mirror that has taken its snapshot (predictions are followed from then on)."""
        mirror = IndexMirror(self.config, MODEL, block_ms=10, live_poll_s=0.0)
        return mirror.start() if start else caught_up(mirror, self)

    def last_seq(self) -> int:
        return int(self.client.get(f"{self.writer.namespace}:evseq") or 0)

    def book(self, booking: Booking, predict_ttl_s: float = 30.0) -> None:
        self.loop.run_until_complete(self.reader.abook(booking, predict_ttl_s, 60.0))

    def run(self, coro):
        return self.loop.run_until_complete(coro)


def caught_up(mirror: IndexMirror, index: Index) -> IndexMirror:
    """Step the mirror until it has applied every event and polled liveness since."""
    target = index.last_seq()
    deadline = time.monotonic() + 10
    while True:
        mirror.step()
        if mirror.seq >= target and mirror.synced():
            mirror.step()  # a liveness poll after the last event
            return mirror
        assert time.monotonic() < deadline, (mirror.seq, target)


def followed(index: Index, seed: int, steps: int) -> IndexMirror:
    """A mirror that followed ``steps`` random changes from the start."""
    mirror = index.mirror()
    random_changes(index, random.Random(seed), steps)
    return caught_up(mirror, index)


def assert_same(mirror: IndexMirror, index: Index) -> None:
    for chain in CHAINS + [CHAINS[0][:1], []]:
        assert mirror.query(chain).as_dict() == index.reader.query(chain).as_dict(), chain[:1]
    mirror.state.check()


def random_changes(index: Index, rng: random.Random, steps: int) -> None:
    """Registrations, publishes, evictions, resyncs, deregistrations, reaps, bookings,
    first tokens and releases, in random order."""
    w = index.writer
    epochs: dict[str, str] = {}
    for _ in range(steps):
        rid = f"r{rng.randrange(5)}"
        op = rng.random()
        if rid not in epochs or op < 0.05:
            epochs[rid] = f"e{rng.randrange(3)}"
            w.register(rid, epochs[rid])
        elif op < 0.45:
            chain = rng.choice(CHAINS)
            w.publish(rid, epochs[rid], chain[: rng.randrange(1, len(chain))])
        elif op < 0.6:
            w.publish(rid, epochs[rid], [], rng.choice(CHAINS)[rng.randrange(6) :])
        elif op < 0.65:
            w.publish(rid, epochs[rid], rng.choice(CHAINS)[:4], replace=True)
        elif op < 0.7:
            w.deregister(rid, epochs.pop(rid))
        elif op < 0.85:
            chain = rng.choice(CHAINS)
            index.book(Booking(rid, f"q{rng.randrange(8)}", rng.randrange(200), 3, chain[:5]))
        elif op < 0.93:
            index.run(index.reader.aprefill_done(rid, f"q{rng.randrange(8)}"))
        else:
            index.run(index.reader.arelease(rid, f"q{rng.randrange(8)}"))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_mirror_answers_what_redis_answers_after_random_changes(fresh_redis, seed) -> None:
    index = Index(fresh_redis.url)
    mirror = index.mirror()
    rng = random.Random(seed)
    for _ in range(6):
        random_changes(index, rng, 40)
        caught_up(mirror, index)
        assert_same(mirror, index)
    assert_same(index.mirror(), index)  # a mirror that starts now: a snapshot, no history
    assert mirror.counters.resyncs == 1 and mirror.counters.gaps == 0


def test_a_dead_replica_drops_out_with_its_heartbeat_and_its_blocks_with_the_reap(
    fresh_redis,
) -> None:
    index = Index(fresh_redis.url)
    short = IndexConfig(url=fresh_redis.url, cluster="mirror", heartbeat_ttl_s=1.5)
    IndexWriter(short, MODEL).register("dying", "e")
    index.writer.register("alive", "e")
    for rid in ("dying", "alive"):
        IndexWriter(short, MODEL).publish(rid, "e", CHAINS[0])
    mirror = index.mirror()
    caught_up(mirror, index)
    assert set(mirror.query(CHAINS[0]).ids) == {"dying", "alive"}
    time.sleep(1.6)
    caught_up(mirror, index)
    assert set(mirror.query(CHAINS[0]).ids) == {"alive"} == set(index.reader.query(CHAINS[0]).ids)
    assert index.writer.reap() == 1
    caught_up(mirror, index)
    assert mirror.state.blocks_held("dying") == 0
    assert_same(mirror, index)


def test_two_mirrors_following_at_once_converge(fresh_redis) -> None:
    index = Index(fresh_redis.url)
    mirrors = [index.mirror(start=True), index.mirror(start=True)]
    try:
        random_changes(index, random.Random(7), 150)
        seq = index.last_seq()
        for mirror in mirrors:
            assert mirror.wait_for(seq)
        time.sleep(0.1)  # a liveness poll after the last event
        for mirror in mirrors:
            assert_same(mirror, index)
    finally:
        for mirror in mirrors:
            mirror.stop()


def test_a_dropped_connection_costs_no_resync(fresh_redis) -> None:
    index = Index(fresh_redis.url)
    mirror = followed(index, 4, 30)
    assert index.client.client_kill_filter(_id=mirror._redis.client_id()) == 1  # the mirror's
    random_changes(index, random.Random(5), 30)
    with contextlib.suppress(redis.ConnectionError):
        mirror.step()  # a cut connection: redis-py reconnects, or the step fails once
    caught_up(mirror, index)
    assert_same(mirror, index)
    assert mirror.counters.resyncs == 1


def test_redis_restarted_empty_and_rebuilt(fresh_redis) -> None:
    index = Index(fresh_redis.url)
    mirror = followed(index, 6, 60)
    first_synced = mirror.synced_at
    fresh_redis.stop()
    fresh_redis.start()  # empty, on the same port
    assert mirror.query(CHAINS[0])  # stale, but not stale for long yet
    for _ in range(3):
        with contextlib.suppress(redis.ConnectionError):
            mirror.step()  # the old connection
    index = Index(fresh_redis.url)
    caught_up(mirror, index)
    assert len(mirror.query(CHAINS[0])) == 0 and mirror.counters.restarts == 1
    # when it synced again: what a restarted router's convergence is timed by (faults)
    assert first_synced is not None and first_synced < mirror.synced_at <= time.time()
    random_changes(index, random.Random(8), 60)  # the replicas register and publish again
    caught_up(mirror, index)
    assert_same(mirror, index)


def test_a_mirror_that_fell_behind_the_trimmed_log_resyncs(fresh_redis) -> None:
    index = Index(fresh_redis.url)
    mirror = followed(index, 9, 30)
    random_changes(index, random.Random(10), 30)
    index.client.xtrim(f"{index.writer.namespace}:ev", maxlen=2)  # what it had not read
    caught_up(mirror, index)
    assert mirror.counters.gaps == 1 and mirror.counters.resyncs == 2
    assert_same(mirror, index)


def test_a_decision_from_the_mirror_is_the_decision_from_redis(fresh_redis) -> None:
    index = Index(fresh_redis.url)
    mirror = followed(index, 11, 120)
    replicas = sorted(index.reader.live_replicas())
    policy = routing_config(policy="prefill_cost")
    for i, chain in enumerate(CHAINS):
        request = RoutingRequest(f"d{i}", chain, chain[0], len(chain) * 16 + 5, 16, 32)
        decisions = []
        for answer in (index.reader.query(chain), mirror.query(chain)):
            core = RoutingCore(make_policy(policy))
            decisions.append(core.decide(request, core.states(replicas, answer, chain)))
        assert decisions[0] == decisions[1]


def test_mirror_state_slots_are_reused_only_after_a_purge() -> None:
    state = MirrorState()
    block = os.urandom(16)
    state.add("a", [block])
    state.apply({b"o": b"dereg", b"r": b"a", b"a": b"", b"b": b""})
    state.add("b", [os.urandom(16)])  # takes a's slot, which holds nothing any more
    state.set_live(["b"])
    assert state.answer([block], 0.0).state_of("b").cached_blocks == 0
    state.check()


def test_routers_see_each_others_shared_bookings_until_they_lapse(fresh_redis) -> None:
    """Two mirroring routers: each one's answers carry the other's shared load (and the
    prompts it routed, as predicted), never its own (it adds its own bookings itself); a
    router that stops sharing drops out after the share's ttl."""
    index = Index(fresh_redis.url)
    index.writer.register("r0", "e")
    index.writer.register("r1", "e")
    mirrors = {
        name: caught_up(IndexMirror(index.config, MODEL, 10, name, live_poll_s=0.0), index)
        for name in ("a", "b")
    }
    share = index.reader.ashare("a", 0.5, {"r0": Load(100, 2, 9)}, [("r1", CHAINS[1][:4])], 30.0)
    assert index.run(share)
    for mirror in mirrors.values():
        caught_up(mirror, index)
    seen_by_b = mirrors["b"].query(CHAINS[1]).as_dict()
    seen_by_a = mirrors["a"].query(CHAINS[1]).as_dict()
    assert (seen_by_b["r0"].prefill_tokens, seen_by_b["r0"].in_flight) == (100, 2)
    assert seen_by_b["r0"].decode_blocks == 9
    assert seen_by_a["r0"].in_flight == 0  # its own: the router counts those itself
    assert (mirrors["b"].state.shared_in_flight, mirrors["a"].state.shared_in_flight) == (2, 0)
    assert seen_by_a["r1"].predicted_blocks == seen_by_b["r1"].predicted_blocks == 4
    again = index.reader.ashare("a", 0.5, {"r1": Load(5, 1, 1)}, [], 30.0)  # replaces the last
    assert index.run(again)
    caught_up(mirrors["b"], index)
    answer = mirrors["b"].query(CHAINS[1]).as_dict()
    assert (answer["r0"].in_flight, answer["r1"].in_flight) == (0, 1)
    late = caught_up(IndexMirror(index.config, MODEL, 10, "c", live_poll_s=0.0), index)
    assert late.query(CHAINS[1]).state_of("r1").in_flight == 1  # a new router's snapshot has it
    time.sleep(0.6)  # a's share lapses: it stopped sharing (died)
    for mirror in (mirrors["b"], late):
        caught_up(mirror, index)
        assert mirror.query(CHAINS[1]).state_of("r1").in_flight == 0
        assert mirror.state.shared_in_flight == 0  # what an ingress's admission reads


def test_a_router_stopping_cleanly_withdraws_its_shared_bookings_at_once(fresh_redis) -> None:
    """``unshare`` (a router's ``close``, as its ingress stops): the other mirrors drop its
    load now, not a TTL later, and nothing of it is left in Redis."""
    index = Index(fresh_redis.url)
    index.writer.register("r0", "e")
    other = caught_up(IndexMirror(index.config, MODEL, 10, "b", live_poll_s=0.0), index)
    assert index.run(index.reader.ashare("a", 60.0, {"r0": Load(100, 2, 9)}, [], 30.0))
    assert caught_up(other, index).query(CHAINS[0]).state_of("r0").in_flight == 2
    assert index.reader.unshare("a")
    assert caught_up(other, index).query(CHAINS[0]).state_of("r0").in_flight == 0
    assert other.state.shared_in_flight == 0
    ns = index.reader.namespace
    assert not index.client.exists(f"{ns}:rl:a") and not index.client.hexists(f"{ns}:routers", "a")
    late = caught_up(IndexMirror(index.config, MODEL, 10, "c", live_poll_s=0.0), index)
    assert late.state.shared_in_flight == 0  # a snapshot after it has none of it either


def test_a_snapshot_of_more_replicas_than_one_round_trip_reads(fresh_redis) -> None:
    index = Index(fresh_redis.url)
    for r in range(SNAPSHOT_CHUNK * 2 + 5):
        index.writer.register(f"s{r}", "e")
        index.writer.publish(f"s{r}", "e", CHAINS[r % len(CHAINS)][: 1 + r % 9])
    assert_same(index.mirror(), index)


def test_a_core_skips_comparing_candidates_only_while_both_lists_are_the_same() -> None:
    """The routing core remembers that Serve's candidate list and the mirror's live list
    were one set (``RoutingCore._taken``): the same two lists again are not compared, a
    new list of either is."""
    state = MirrorState()
    chain = CHAINS[0]
    for rid in "abc":
        state.register(rid, "e")
    state.add("a", chain)
    state.add("b", chain[:4])
    state.set_live(["c", "b", "a"])
    core = RoutingCore(make_policy(routing_config(policy="prefill_cost")))
    candidates = ["a", "b", "c"]

    def held(ids: list[str]) -> dict[str, int | None]:
        table = core.states(ids, state.answer(chain, 0.0), chain)
        return {s.replica_id: s.cached_blocks for s in table}

    everyone = {"a": len(chain), "b": 4, "c": 0}
    assert held(candidates) == everyone
    assert core._same_lists == (candidates, state.live)  # remembered
    assert held(candidates) == everyone
    assert held(["a", "b"]) == {"a": len(chain), "b": 4}  # another candidate list
    state.set_live(["a", "c"])  # b left: another live list
    assert held(candidates) == {"a": len(chain), "b": 0, "c": 0}


def test_a_router_alone_shares_once_a_heartbeat_and_fast_once_another_shares(
    fresh_redis,
) -> None:
    """The Serve router's share loop: with no other router's share in its mirror it shares
    only every heartbeat interval, however often its bookings change; once another
    router's share arrives it shares every ``share_interval_s`` while they change."""
    from test_routing_core import Unserved

    config = IndexConfig(
        url=fresh_redis.url,
        cluster="alone",
        mirror=True,
        share_interval_s=0.01,
        heartbeat_interval_s=0.25,
        heartbeat_ttl_s=30.0,
    )
    router = Unserved.__new__(Unserved)
    router.initialize_state(
        routing={"policy": "prefill_cost"}, model_id=MODEL, index=config.model_dump()
    )
    assert router.mirror.wait_for(0, timeout_s=10)
    shares = []
    channel = router.channel
    real_share = channel.share

    async def counted() -> int:
        shares.append(time.monotonic())
        return await real_share()

    channel.share = counted  # type: ignore[method-assign]

    async def drive(seconds: float) -> int:
        before, end = len(shares), time.monotonic() + seconds
        while time.monotonic() < end:
            router.channel.due()  # bookings change all the time
            await asyncio.sleep(0.005)
        return len(shares) - before

    async def both() -> tuple[int, int]:
        loop = asyncio.create_task(channel._share_loop())
        alone = await drive(1.0)
        other = IndexReader(config, MODEL)
        assert await other.ashare("other-router", 30.0, {"r0": Load(1, 1, 1)}, [], 5.0)
        deadline = time.monotonic() + 5
        while not router.mirror.state.shares and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        together = await drive(1.0)
        loop.cancel()
        await other.aclose()
        return alone, together

    alone, together = asyncio.run(both())
    router.close()
    assert 3 <= alone <= 6, alone  # every 0.25 s, not every 0.01 s
    assert together >= 12, together  # every 0.01 s while they change (a loaded machine: fewer)
