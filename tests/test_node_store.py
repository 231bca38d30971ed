"""The node store (``replica.store``): a set-associative shared-memory cache of KV blocks
that every replica of a node reads and writes, its file (versioned, swept), and its disk
tier. Exact slot-level checks on tiny stores; every way a read can go wrong is a miss."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import signal

import numpy as np
import pytest

from replica.store.disk import DiskBlock, DiskTier
from replica.store.files import (
    open_node_store,
    publisher_lock_path,
    remove_cluster_stores,
    sweep,
)
from replica.store.layout import VALID, file_name, fingerprint
from replica.store.node_store import NodeStore, StoreGeometry

BS, NBYTES = 4, 64
PRINT = fingerprint("m", BS, b"", ("torch.uint8", (NBYTES,)))


def key(i: int, set_index: int = 0, num_sets: int = 1) -> bytes:
    """A 16-byte hash whose set in a store of ``num_sets`` sets is ``set_index``."""
    h0 = i * num_sets + set_index
    return h0.to_bytes(8, "little") + bytes([i % 251] * 8)


def block(i: int) -> np.ndarray:
    return np.full(NBYTES, i % 256, np.uint8)


def store(sets: int = 1, ways: int = 2) -> NodeStore:
    return NodeStore.anonymous(StoreGeometry(BS, NBYTES, sets, ways), PRINT)


def test_a_chain_put_is_found_and_read_back_whole() -> None:
    s = store(sets=4, ways=4)
    parents = [None, key(0, 0, 4), key(1, 1, 4)]
    for i, parent in enumerate(parents):
        assert s.put(key(i, i, 4), parent, [i] * BS, block(i)).stored
    found = s.find_chain([key(0, 0, 4), key(1, 1, 4), key(2, 2, 4), key(9, 3, 4)])
    assert [b.parent_hash for b in found] == parents
    assert [b.token_ids for b in found] == [(i,) * BS for i in range(3)]
    rows = [np.zeros(NBYTES, np.uint8) for _ in found]
    assert s.read_blocks(found, rows) == 3
    assert all((row == i).all() for i, row in enumerate(rows))
    assert s.num_blocks == 3 and not s.put(key(0, 0, 4), None, [0] * BS, block(0)).stored
    s.check()


def test_a_full_set_gives_up_its_least_recently_used_block() -> None:
    s = store(ways=2)
    s.put(key(1), None, [1] * BS, block(1))
    s.put(key(2), None, [2] * BS, block(2))
    first = s.find(key(1))
    assert first is not None and s.read_blocks([first], [np.zeros(NBYTES, np.uint8)]) == 1
    result = s.put(key(3), None, [3] * BS, block(3), keep_evicted_after_uses=2)
    assert result.evicted is not None and result.evicted.block_hash == key(2)
    assert result.evicted_bytes is None  # used once: not for the disk
    assert s.find(key(2)) is None and s.find(key(1)) and s.find(key(3))
    again = s.put(key(4), None, [4] * BS, block(4), keep_evicted_after_uses=2)
    assert again.evicted.block_hash == key(1) and again.evicted_bytes == block(1).tobytes()
    s.check()


def test_a_block_replaced_after_it_was_found_is_a_miss() -> None:
    s = store(ways=1)
    s.put(key(1), None, [1] * BS, block(1))
    found = s.find(key(1))
    s.put(key(2), None, [2] * BS, block(2))  # the same slot, rewritten
    row = np.zeros(NBYTES, np.uint8)
    assert s.read_blocks([found], [row]) == 0 and s.counters.torn == 1


def test_a_slot_a_dead_writer_left_odd_is_never_read_and_the_next_put_repairs_it() -> None:
    s = store(ways=1)
    s.put(key(1), None, [1] * BS, block(1))
    s.meta["seq"][0] += 1  # a writer died between its two bumps
    assert s.find(key(1)) is None
    assert s.put(key(2), None, [2] * BS, block(2)).stored
    assert s.find(key(2)) is not None and s.meta["seq"][0] % 2 == 0
    s.check()


def test_puts_must_be_one_full_block_of_the_layout() -> None:
    with pytest.raises(ValueError, match="one full block"):
        store().put(key(1), None, [1] * (BS - 1), block(1))
    with pytest.raises(ValueError, match="one full block"):
        store().put(key(1), None, [1] * BS, np.zeros(NBYTES + 1, np.uint8))


def _put_in_child(directory: str, i: int) -> None:
    s = open_node_store(directory, "c", PRINT, StoreGeometry(BS, NBYTES, 8, 2))
    s.put(key(i, i % 8, 8), None, [i] * BS, block(i))
    s.close()


def test_processes_of_a_node_share_one_store_file(tmp_path) -> None:
    d = str(tmp_path)
    mine = open_node_store(d, "c", PRINT, StoreGeometry(BS, NBYTES, 8, 2))
    ctx = multiprocessing.get_context("spawn")
    children = [ctx.Process(target=_put_in_child, args=(d, i)) for i in range(4)]
    for p in children:
        p.start()
    for p in children:
        p.join(60)
    assert [p.exitcode for p in children] == [0] * 4
    found = [mine.find(key(i, i % 8, 8)) for i in range(4)]
    assert all(f is not None for f in found) and mine.num_blocks == 4
    rows = [np.zeros(NBYTES, np.uint8) for _ in found]
    assert mine.read_blocks(found, rows) == 4 and all((r == i).all() for i, r in enumerate(rows))
    # another geometry asked of an existing store: the store's own is kept
    other = open_node_store(d, "c", PRINT, StoreGeometry(BS, NBYTES, 64, 2))
    assert other.geometry.num_sets == 8 and other.num_blocks == 4
    other.close()
    mine.close()


def _die_holding_the_lock(directory: str) -> None:
    s = open_node_store(directory, "c", PRINT, StoreGeometry(BS, NBYTES, 1, 2))
    s._locked().__enter__()  # take the flock, then die with it
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_writer_killed_holding_the_lock_blocks_nobody(tmp_path) -> None:
    d = str(tmp_path)
    p = multiprocessing.get_context("spawn").Process(target=_die_holding_the_lock, args=(d,))
    p.start()
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    s = open_node_store(d, "c", PRINT, StoreGeometry(BS, NBYTES, 1, 2))
    assert s.put(key(1), None, [1] * BS, block(1)).stored  # the kernel dropped its flock
    s.close()


def test_a_store_of_another_version_is_replaced_never_read(tmp_path) -> None:
    d = str(tmp_path)
    s = open_node_store(d, "c", PRINT, StoreGeometry(BS, NBYTES, 1, 2))
    s.put(key(1), None, [1] * BS, block(1))
    s.close()
    path = os.path.join(d, file_name("c", PRINT))
    with open(path, "r+b") as f:
        f.seek(8)
        f.write((99).to_bytes(4, "little"))  # an older (or newer) version's header
    again = open_node_store(d, "c", PRINT, StoreGeometry(BS, NBYTES, 1, 2))
    assert again.num_blocks == 0 and again.find(key(1)) is None
    again.close()


def test_sweep_removes_unused_stores_no_replica_here_can_use(tmp_path) -> None:
    d = str(tmp_path)
    g = StoreGeometry(BS, NBYTES, 1, 2)
    other_model = fingerprint("other", BS, b"", ("torch.uint8", (NBYTES,)))
    other_secret = fingerprint("m", BS, b"s", ("torch.uint8", (NBYTES,)))
    assert other_secret != PRINT and other_model != PRINT
    open_node_store(d, "c", other_model, g).close()  # unused: removed
    in_use = open_node_store(d, "c", other_secret, g)  # in use: kept
    open_node_store(d, "elsewhere", PRINT, g).close()  # another cluster's, fresh: kept
    removed = sweep(d, "c", PRINT, stale_after_s=3600)
    assert removed == [os.path.join(d, file_name("c", other_model))]
    assert sweep(d, "c", PRINT, stale_after_s=0) == [os.path.join(d, file_name("elsewhere", PRINT))]
    in_use.close()
    assert remove_cluster_stores(d, "c") == [os.path.join(d, file_name("c", other_secret))]


def test_a_sweep_leaves_the_publisher_lock_of_a_store_in_use(tmp_path) -> None:
    """A replica starting on a node sweeps; it must not take the store's publisher lock
    file for a store and unlink it, or its own publisher locks a new file and the node
    gets two publishers of one index entry (CI: blocks left in the index after a stop)."""
    d = str(tmp_path)
    g = StoreGeometry(BS, NBYTES, 1, 2)
    first = open_node_store(d, "c", PRINT, g)
    lock = publisher_lock_path(first.path)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the first replica leads
    inode = os.fstat(fd).st_ino
    second = open_node_store(d, "c", PRINT, g)
    assert sweep(d, "c", PRINT, stale_after_s=0) == []
    assert remove_cluster_stores(d, "c") == []  # in use
    assert os.stat(lock).st_ino == inode
    other = os.open(lock, os.O_RDWR)
    with pytest.raises(BlockingIOError):  # the second replica cannot lead as well
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(other)
    os.close(fd)
    first.close()
    second.close()
    assert remove_cluster_stores(d, "c") == [first.path]  # and its side files with it
    assert os.listdir(d) == []


def flip(path: str, at: int, change) -> None:
    with open(path, "r+b") as f:
        raw = bytearray(f.read())
        raw[at] = change(raw[at])
        f.seek(0)
        f.write(bytes(raw))


def test_the_disk_tier_gives_back_whole_blocks_and_refuses_wrong_files(tmp_path) -> None:
    tier = DiskTier(str(tmp_path), "c-x", PRINT, BS, NBYTES, max_bytes=10**6)
    blocks = [
        DiskBlock(key(i), key(i - 1) if i else None, (i,) * BS, block(i).tobytes())
        for i in range(3)
    ]
    assert all(tier.write(b) for b in blocks)
    assert tier.read_chain([key(0), key(1), key(2), key(7)]) == blocks
    path = tier._path(key(1))
    flip(path, -1, lambda b: b ^ 0xFF)  # a flipped bit
    assert tier.read(key(1)) is None and not os.path.exists(path)
    assert tier.read_chain([key(0), key(1), key(2)]) == blocks[:1]
    flip(tier._path(key(2)), 8, lambda b: 9)  # another version
    assert tier.read(key(2)) is None and tier.counters.rejected == 2


def test_the_disk_tier_stays_under_its_size(tmp_path) -> None:
    one = DiskTier(str(tmp_path), "c-x", PRINT, BS, NBYTES, max_bytes=10**6)._file_bytes
    tier = DiskTier(str(tmp_path), "c-y", PRINT, BS, NBYTES, max_bytes=10 * one)
    for i in range(25):
        tier.write(DiskBlock(key(i), None, (i,) * BS, block(i).tobytes()))
    assert len(tier._files()) <= 10 and tier.counters.removed >= 15
    assert tier.read(key(24)) is not None  # the newest stay


def test_a_discarded_block_is_gone() -> None:
    s = store()
    s.put(key(1), None, [1] * BS, block(1))
    assert s.discard(key(1)) and s.find(key(1)) is None and not s.discard(key(1))
    assert not s.meta["flags"][0] & VALID


def test_a_store_outlives_a_restart_only_for_the_same_weights_and_code(tmp_path) -> None:
    """The fingerprint covers what computed the blocks (``ModelRunner.kv_source``): the
    weights' files as this machine knows them (a rewritten file is other weights), the
    random weights' seed, and the code's numerics (kernels or torch)."""
    from conftest import tiny

    from replica.checkpoints.registry import file_identity
    from replica.model.runner import ModelRunner, numerics

    layout = ("torch.float32", (NBYTES,))
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"one")
    before = file_identity(weights)
    assert file_identity(weights) == before  # the same file, read again
    weights.write_bytes(b"two")
    os.utime(weights, ns=(1, 1))
    assert file_identity(weights) != before
    prints = {
        fingerprint("m", BS, b"", layout, source)
        for source in (before, file_identity(weights), numerics(True), numerics(False))
    }
    assert len(prints) == 4 and PRINT not in prints
    seeded = {ModelRunner(tiny(seed=seed, num_blocks=8)).kv_source for seed in (0, 1)}
    assert len(seeded) == 2
    assert ModelRunner(tiny(num_blocks=8)).kv_source in seeded  # the same engine, again


def test_clear_removes_every_store_nobody_has_open(tmp_path, capsys) -> None:
    from replica.store.__main__ import main

    d = str(tmp_path)
    g = StoreGeometry(BS, NBYTES, 1, 2)
    open_node_store(d, "a", PRINT, g).close()
    kept = open_node_store(d, "b", PRINT, g)
    assert main(["clear", "--directory", d]) == 0
    assert sorted(os.listdir(d)) == sorted(
        os.path.basename(p) for p in (kept.path, kept.users_path)
    )
    assert "1 store(s) removed" in capsys.readouterr().out
    kept.close()
