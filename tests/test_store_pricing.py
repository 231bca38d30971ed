"""The store rule (``kvindex.stored``) as the router uses it, and the store's index entry
(``replica.store_publisher``) on a real Redis: a replica whose node's store holds a prefix
is credited for it at a copy's price, a store is never a pull source or a replica, and
one replica per node publishes what the store holds."""

from __future__ import annotations

import threading
import time

import numpy as np
from test_policies import request, state

from kvindex.config import IndexConfig
from kvindex.pulls import pull_source
from kvindex.reader import IndexReader
from kvindex.records import ReplicaTable, store_id
from kvindex.stored import restore_prices, stored_token_column, with_stored
from kvindex.writer import IndexWriter
from replica.pull_config import PullConfig
from replica.store.config import StoreConfig
from replica.store.files import open_node_store
from replica.store.layout import StoreGeometry
from replica.store.node_store import NodeStore
from replica.store_publisher import StorePublisher
from router.core import RoutingCore
from router.prefill_cost import CostKnobs, PrefillCost

STORE = StoreConfig(token_cost=0.05)


def test_a_replica_is_credited_with_its_nodes_store_run_beyond_what_it_holds() -> None:
    table = ReplicaTable.of([state("a", cached_blocks=2), state("b"), state("c")])
    answer = ReplicaTable.of([state("a", cached_blocks=2), state(store_id("n1"), cached_blocks=6)])
    nodes = {"a": "n1", "b": "n1", "c": "n2"}
    stored = with_stored(table, answer, nodes)
    assert stored.column("stored_blocks").tolist() == [6, 6, 0]
    req = request(1, num_blocks=8, extra=0)  # 7 usable blocks
    assert stored_token_column(req, stored).tolist() == [4 * 16, 6 * 16, 0]
    assert restore_prices(STORE, np.array([96, 0])).tolist() == [5, 0]  # ceil(96 x 0.05)


def test_the_router_prefers_a_replica_that_restores_over_one_that_recomputes() -> None:
    req = request(1, num_blocks=8, extra=0)
    replicas = [state("a", in_flight=1), state("b", in_flight=1)]
    answer = ReplicaTable.of([*replicas, state(store_id("n2"), cached_blocks=8)])
    nodes = {"a": "n1", "b": "n2"}
    plain = RoutingCore(PrefillCost(CostKnobs(decode_cost_tokens=10)))
    core = RoutingCore(PrefillCost(CostKnobs(decode_cost_tokens=10, store=STORE)), stores=STORE)
    table = core.states(["a", "b"], answer, [], None, nodes)
    decision = core.decide(req, table)
    assert decision.ranking[0] == "b" and decision.credit("b") == 7 * 16
    assert decision.credit("a") == 0
    costs = core.policy.costs(req, table)
    assert costs["a"] - costs["b"] == 7 * 16 - int(np.ceil(7 * 16 * 0.05))
    # without the store rule, the stored run is worth nothing
    flat = plain.states(["a", "b"], ReplicaTable.of(replicas), [], None, nodes)
    assert plain.decide(req, flat).credit("b") == 0


def test_a_prefix_its_nodes_store_keeps_is_every_node_replicas_so_the_cheapest_takes_it() -> None:
    """Replica a computed the prefix and is a little dearer (one request more); b, on the
    same node, restores it from the store: b takes the request, where without a store a
    keeps it within the sticky budget. A replica of another node, without the store's
    copy, is no holder."""
    req = request(1, num_blocks=8, extra=0)
    replicas = [state("a", cached_blocks=7, in_flight=2), state("b", in_flight=1), state("c")]
    answer = ReplicaTable.of([*replicas, state(store_id("n1"), cached_blocks=7)])
    nodes = {"a": "n1", "b": "n1", "c": "n2"}
    knobs = {"decode_cost_tokens": 10, "sticky_budget_tokens": 512}
    core = RoutingCore(PrefillCost(CostKnobs(**knobs, store=STORE)), stores=STORE)
    table = core.states(["a", "b", "c"], answer, [], None, nodes)
    assert core.decide(req, table).ranking[0] == "b"
    plain = RoutingCore(PrefillCost(CostKnobs(**knobs)))
    flat = plain.states(["a", "b", "c"], answer, [], None, nodes)
    assert plain.decide(req, flat).ranking[0] == "a"  # sticky: 10 tokens dearer
    # the store's copy on another node than the cheapest: the holder keeps it
    nodes = {"a": "n1", "b": "n2", "c": "n2"}
    table = core.states(["a", "b", "c"], answer, [], None, nodes)
    assert core.decide(req, table).ranking[0] == "a"


def test_a_store_is_never_a_pull_source() -> None:
    states = [state("a"), state(store_id("n1"), cached_blocks=8)]
    assert pull_source(states, "a", min_blocks=1) is None
    assert PullConfig().enabled is False


def test_a_replica_pulls_only_what_its_own_nodes_store_cannot_restore() -> None:
    """What the replica's node store holds it restores at admission without calling the
    holder, so a pull needs ``min_blocks`` beyond the longer of its pool and its store;
    another node's store is not its own."""
    states = [
        state("a", cached_blocks=2),
        state("b", cached_blocks=10),
        state(store_id("n1"), cached_blocks=8),
        state(store_id("n2"), cached_blocks=10),
    ]
    assert pull_source(states, "a", min_blocks=2) == "b"  # no store of its own: 10 - 2
    assert pull_source(states, "a", min_blocks=2, own_store=store_id("n1")) == "b"  # 10 - 8
    assert pull_source(states, "a", min_blocks=3, own_store=store_id("n1")) is None
    assert pull_source(states, "a", min_blocks=1, own_store=store_id("n2")) is None


def _store() -> NodeStore:
    return NodeStore.anonymous(StoreGeometry(4, 8, 4, 2))


def _key(i: int) -> bytes:
    return (i * 4).to_bytes(8, "little") + bytes([i] * 8)


def test_one_replica_per_node_publishes_the_store_and_the_index_follows(
    fresh_redis, tmp_path
) -> None:
    config = IndexConfig(url=fresh_redis.url, cluster="stores")
    store = _store()
    lock = str(tmp_path / "store.publisher")
    stats = dict
    first = StorePublisher(store, lock, "n1", lambda: IndexWriter(config, "m"), stats, 0.05).start()
    second = StorePublisher(
        store, lock, "n1", lambda: IndexWriter(config, "m"), stats, 0.05
    ).start()
    reader = IndexReader(config, "m")
    try:
        store.put(_key(1), None, [1] * 4, np.ones(8, np.uint8))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and reader.replica_blocks(store_id("n1")) != {_key(1)}:
            time.sleep(0.05)
        assert reader.replica_blocks(store_id("n1")) == {_key(1)}
        assert [first.leading, second.leading].count(True) == 1
        assert store_id("n1") not in reader.live_replicas()  # not a replica
        assert store_id("n1") in reader.live_replicas(stores=True)
        store.discard(_key(1))
        store.put(_key(2), _key(1), [2] * 4, np.ones(8, np.uint8))
        while time.monotonic() < deadline and reader.replica_blocks(store_id("n1")) != {_key(2)}:
            time.sleep(0.05)
        assert reader.replica_blocks(store_id("n1")) == {_key(2)}
        leader = first if first.leading else second
        leader.close()  # its lock goes to the other, which publishes the whole store again
        other = second if leader is first else first
        while time.monotonic() < deadline and not other.leading:
            time.sleep(0.05)
        assert other.leading
        other.close()  # not the node's last replica: the entry stays for the next holder
        assert store_id("n1") in reader.live_replicas(stores=True)
        never_led = StorePublisher(store, lock, "n1", lambda: IndexWriter(config, "m"), stats)
        never_led.close(last=True)  # the node's last replica takes the entry out
        assert store_id("n1") not in reader.live_replicas(stores=True)
        assert reader.replica_blocks(store_id("n1")) == set()
    finally:
        first.close()
        second.close()
        reader.close()


def test_the_last_replica_takes_the_entry_out_while_the_leader_is_still_stopping(
    fresh_redis, tmp_path
) -> None:
    """Two replicas of a node stopping together: the leader (not the last) may still be
    heartbeating when the last one deregisters the entry, and a heartbeat that finds the
    entry gone registers it again with the whole store. The last one must wait for the
    leader's lock, else the entry (and every block of it) is left in the index for good."""
    config = IndexConfig(url=fresh_redis.url, cluster="stores", heartbeat_interval_s=0.05)
    store = _store()
    store.put(_key(1), None, [1] * 4, np.ones(8, np.uint8))
    lock = str(tmp_path / "store.publisher")
    leader = StorePublisher(store, lock, "n1", lambda: IndexWriter(config, "m"), dict, 0.05)
    leader.start()
    reader = IndexReader(config, "m")
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and reader.replica_blocks(store_id("n1")) != {_key(1)}:
            time.sleep(0.05)
        assert leader.leading
        last = StorePublisher(store, lock, "n1", lambda: IndexWriter(config, "m"), dict, 0.05)
        closing = threading.Thread(target=last.close, kwargs={"last": True})
        closing.start()
        time.sleep(0.5)  # ten of the leader's heartbeats
        leader.close()  # not the last: it leaves the entry to the lock's next holder
        closing.join(timeout=30)
        assert not closing.is_alive()
        time.sleep(0.3)
        assert store_id("n1") not in reader.live_replicas(stores=True)
        assert reader.replica_blocks(store_id("n1")) == set()
    finally:
        leader.close()
        reader.close()


def test_the_last_process_to_leave_a_store_knows_it(tmp_path) -> None:
    g = StoreGeometry(4, 8, 1, 2)
    a = open_node_store(str(tmp_path), "c", b"p" * 16, g)
    b = open_node_store(str(tmp_path), "c", b"p" * 16, g)
    assert not a.leave()  # b still has it open
    assert b.leave() and not b.leave()  # the last; and only once
    a.close()
    b.close()
