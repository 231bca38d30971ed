"""The second cache tier in an engine (``replica.store.tier``): released blocks spill into
the node store, a prompt's stored blocks come back before admission, verified like a local
hit; greedy tokens are bitwise those of a never-evicted prefix, in bfloat16 as in float32,
and the block accounting adds up in the pool and in the store."""

from __future__ import annotations

import errno
import os
import time

import numpy as np
import pytest
from conftest import tiny

from replica.engine.engine import Engine
from replica.messages import Retention
from replica.model.runner import build_engine
from replica.sampling.params import SamplingParams
from replica.store.disk import DiskTier
from replica.store.layout import fingerprint
from replica.store.node_store import NodeStore, StoreGeometry
from replica.store.tier import StoreTier

BS = 16
PROMPT = [(7 * i + 3) % 250 for i in range(8 * BS + 5)]  # 8 full blocks and 5 tokens
OTHERS = [[(11 * i + k) % 250 for i in range(8 * BS + 5)] for k in range(1, 4)]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def node_store(engine_config, sets: int = 64, ways: int = 4) -> NodeStore:
    probe = build_engine(engine_config)
    data = probe.runner.kv_cache.data
    layout = (str(data.dtype), tuple(data.shape[1:]))
    print_ = fingerprint(engine_config.model_id, BS, b"", layout)
    return NodeStore.anonymous(StoreGeometry(BS, data[0].nbytes, sets, ways), print_)


def with_tier(config, store: NodeStore, **tier) -> Engine:
    engine = build_engine(config)
    engine.attach_store(StoreTier(store, background=False, **tier))
    return engine


def served(engine: Engine, prompt=PROMPT, salt=None):
    (out,) = engine.generate([prompt], GREEDY, cache_salt=salt)
    engine.check_invariants(idle=True)
    return out


def evict_everything(engine: Engine) -> None:
    """Serve other prompts until none of ``PROMPT``'s blocks is left in the pool."""
    for other in OTHERS:
        served(engine, other)
    assert engine.block_manager.prefix_cache.lookup(PROMPT) == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_spilled_then_restored_prefix_gives_the_never_evicted_tokens(dtype: str) -> None:
    config = tiny(num_blocks=12, dtype=dtype)  # one prompt's blocks and a few more
    store = node_store(config)
    engine = with_tier(config, store)
    first = served(engine)
    assert engine.store.counters.spilled_blocks >= 8
    evict_everything(engine)
    again = served(engine)
    assert again.num_cached_tokens == 8 * BS and engine.store.counters.restored_blocks == 8
    big = build_engine(tiny(num_blocks=64, dtype=dtype))  # never evicts
    served(big)
    hit = served(big)
    assert hit.num_cached_tokens == 8 * BS
    assert again.token_ids == hit.token_ids == first.token_ids
    store.check()


def test_a_neighbour_or_a_replacement_finds_the_prefix_in_the_store() -> None:
    config = tiny(num_blocks=64)
    store = node_store(config)
    first = served(with_tier(config, store))  # then it is gone (killed): the store stays
    replacement = with_tier(config, store)
    again = served(replacement)
    assert again.num_cached_tokens == 8 * BS and again.token_ids == first.token_ids


def test_a_tenants_stored_blocks_go_only_to_its_own_salt() -> None:
    config = tiny(num_blocks=64)
    store = node_store(config)
    served(with_tier(config, store), salt="tenant-a")
    assert served(with_tier(config, store), salt="tenant-b").num_cached_tokens == 0
    assert served(with_tier(config, store)).num_cached_tokens == 0
    assert served(with_tier(config, store), salt="tenant-a").num_cached_tokens == 8 * BS


def test_a_block_changed_mid_read_is_a_miss_and_the_answer_stays_right() -> None:
    config = tiny(num_blocks=64)
    store = node_store(config)
    first = served(with_tier(config, store))
    reader = with_tier(config, store)
    real_read = store.read_blocks

    def torn(blocks, rows):  # a writer rewrites block 3's slot while it is copied
        store.meta["seq"][blocks[3].slot] += 2
        return real_read(blocks, rows)

    store.read_blocks = torn  # type: ignore[method-assign]
    again = served(reader)
    assert again.num_cached_tokens == 3 * BS and again.token_ids == first.token_ids
    assert reader.store.counters.restore_rejected == 5


def test_a_forged_block_under_the_right_hash_is_refused() -> None:
    config = tiny(num_blocks=64)
    store = node_store(config)
    engine = with_tier(config, store)
    hashes = engine.hasher.chain(PROMPT[: 8 * BS])
    row = np.zeros(store.geometry.block_bytes, np.uint8)
    store.put(hashes[0], None, [1] * BS, row)  # a colliding hash, someone else's tokens
    out = served(engine)
    assert out.num_cached_tokens == 0 and engine.store.counters.restore_rejected == 1
    assert out.token_ids == served(build_engine(tiny(num_blocks=64))).token_ids


def test_a_block_evicted_before_its_spill_is_dropped_not_stored() -> None:
    config = tiny(num_blocks=64)
    store = node_store(config)
    engine = with_tier(config, store)
    spill = engine.store.spill

    def late(items, pool, generations):  # each block is evicted before its copy
        for item in items:
            generations[item.block_id] += 1
        spill(items, pool, generations)

    engine.store.spill = late  # type: ignore[method-assign]
    served(engine)
    assert store.num_blocks == 0 and engine.store.counters.spill_dropped >= 8


def test_blocks_used_twice_go_to_disk_and_come_back(tmp_path) -> None:
    config = tiny(num_blocks=12)
    store = node_store(config, sets=1, ways=2)  # two blocks: everything else is evicted
    disk = DiskTier(str(tmp_path), "t", store.fingerprint, BS, store.geometry.block_bytes, 10**9)
    engine = with_tier(config, store, disk=disk, disk_after_uses=1)
    first = served(engine)
    evict_everything(engine)
    assert disk.counters.writes > 0
    again = served(engine)
    restored = engine.store.counters.restored_blocks + engine.store.counters.restored_disk_blocks
    assert restored == 8 and again.num_cached_tokens == 8 * BS
    assert again.token_ids == first.token_ids
    store.check()


def test_a_full_store_refuses_puts_and_serving_goes_on() -> None:
    config = tiny(num_blocks=64)
    store = node_store(config)
    store._has_room = lambda: False  # type: ignore[method-assign]  # no memory for new pages
    engine = with_tier(config, store)
    first = served(engine)
    assert store.num_blocks == 0 and store.counters.full >= 8
    assert served(engine).token_ids == first.token_ids


def test_a_full_disk_skips_the_write_and_serving_goes_on(tmp_path, monkeypatch) -> None:
    config = tiny(num_blocks=12)
    store = node_store(config, sets=1, ways=2)
    disk = DiskTier(str(tmp_path), "t", store.fingerprint, BS, store.geometry.block_bytes, 10**9)
    real_replace = os.replace

    def no_space(src, dst):  # the rename fails as a full disk's write would
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)
    engine = with_tier(config, store, disk=disk, disk_after_uses=1)
    first = served(engine)
    evict_everything(engine)
    monkeypatch.setattr(os, "replace", real_replace)
    assert disk.counters.write_failures > 0 and disk.counters.writes == 0
    assert not [n for n in os.listdir(disk.directory)]  # no temporary file left behind
    again = served(engine)
    assert again.token_ids == first.token_ids


def test_a_ticket_is_spilled_once_every_spill_handed_over_before_it_is_stored() -> None:
    """What a replica waits on before a finished answer leaves (``wait_spilled``): after
    it, the answer's released blocks are in the store, for any replica of the node."""
    config = tiny(num_blocks=64)
    store = node_store(config)
    engine = build_engine(config)
    tier = StoreTier(store, background=True)
    engine.attach_store(tier)
    assert tier.spilled(tier.ticket())  # nothing handed over: nothing to wait for
    served(engine)
    ticket = tier.ticket()
    assert ticket >= 1
    assert tier.wait_spilled(ticket, timeout_s=10.0)
    assert tier.spilled(ticket) and tier.counters.spill_wait_timeouts == 0
    neighbour = with_tier(config, store)
    assert served(neighbour).num_cached_tokens == 8 * BS  # all of it, from the store


@pytest.mark.parametrize("kept", [True, False])
def test_a_session_released_early_for_room_stays_in_the_store_until_its_ttl(kept: bool) -> None:
    """A session's pin (6 of the prompt's 8 blocks: ``max_pinned_fraction`` 0.5 of 12)
    yields to a prompt that cannot fit beside it, which reuses most of them in that very
    step. Kept: their rows are copied into a one-set store of 8 ways before that, marked
    kept until the pin's TTL, so the flood of other prompts replaces only the other ways and
    the session's next turn restores its 6 blocks. Not kept: only the 2 blocks the pool did
    not reuse at once reach the store, and the next turn gets those 2."""
    config = tiny(num_blocks=12, max_pinned_fraction=0.5)
    store = node_store(config, sets=1, ways=8)
    engine = with_tier(config, store)
    if not kept:
        engine.block_manager.pins.on_early_release = None
    engine.add_request("turn1", PROMPT, GREEDY, retention=Retention("t:s", "t", 60.0))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.pins.held == 6
    for other in OTHERS:
        served(engine, other)
    assert engine.stats().retention_released_for_room == 1
    pinned = engine.hasher.chain(PROMPT, None)[:6]
    stored = [store.find(h) is not None for h in pinned]
    again = served(engine)
    assert stored == [True] * 6 if kept else [True, True] + [False] * 4
    assert again.num_cached_tokens == (6 if kept else 2) * BS
    store.check()


def test_a_set_whose_every_way_is_kept_refuses_a_put_until_the_keep_passes() -> None:
    store = NodeStore.anonymous(StoreGeometry(4, 8, 1, 2), fingerprint("m", 4, b"", ("u8", (8,))))
    soon = time.monotonic_ns() + 200_000_000

    def put(i: int, keep: int = 0) -> bool:
        return store.put(
            bytes([i]) * 16, None, [i] * 4, np.zeros(8, np.uint8), keep_until_ns=keep
        ).stored

    assert put(0, soon) and put(1, soon)
    assert not put(9) and store.counters.kept_full == 1
    time.sleep(0.25)
    assert put(9)
