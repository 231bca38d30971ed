"""Pulls by reference (``replica.kv.shared_pool``): the receiver copies blocks straight
from a same-node holder's shared pool, and keeps a block only if it is still what the
holder exported when the copy ends. A pulled prefix equals a local hit bitwise; a block
evicted before or during the copy, a holder gone, a pool that is not the one exported or
not this format's version: each ends in a verified miss and a right answer, with both
engines' block accounting adding up."""

from __future__ import annotations

import multiprocessing
import os
import signal
import struct
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import tiny

from replica.engine.engine import Engine
from replica.kv import transfer
from replica.kv.shared_pool import GEN_OFFSET, read_blocks, shared_memory_available
from replica.kv.transfer import PrefixExport, export_prefix, import_prefix
from replica.model.runner import build_engine
from replica.sampling.params import SamplingParams

pytestmark = pytest.mark.skipif(not shared_memory_available(), reason="needs memfd (Linux)")

BS = 16
PROMPT = [(5 * i + 11) % 250 for i in range(8 * BS + 3)]  # 8 full blocks and 3 tokens
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def shared(**fields) -> Engine:
    return build_engine(tiny(num_blocks=64, shared_kv_pool=True, **fields))


def served(engine: Engine, prompt=PROMPT, salt=None):
    (out,) = engine.generate([prompt], GREEDY, cache_salt=salt)
    engine.check_invariants(idle=True)
    return out


def by_reference(holder: Engine, prompt=PROMPT, salt=None) -> PrefixExport:
    export = export_prefix(holder.kv, prompt, salt, by_reference=True)
    assert export.pool is not None and export.kv.size == 0  # no bytes travel
    return export


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prefix_pulled_by_reference_gives_what_a_local_hit_gives(dtype: str) -> None:
    holder, puller = shared(dtype=dtype), shared(dtype=dtype)
    first = served(holder)
    export = by_reference(holder)
    assert export.num_bytes == 8 * holder.runner.kv_cache.data[0].nbytes
    result = import_prefix(puller.kv, PROMPT, None, export)
    assert (result.imported, result.rejected) == (8, [])
    puller.check_invariants(idle=True)
    mine = puller.block_manager.prefix_cache.lookup(PROMPT, None)
    theirs = [b.block_id for b in export.blocks]
    kv_mine, kv_theirs = puller.runner.kv_cache.data, holder.runner.kv_cache.data
    assert kv_mine[mine].view(torch.uint8).equal(kv_theirs[theirs].view(torch.uint8))
    pulled = served(puller)
    alone = served(build_engine(tiny(num_blocks=64, dtype=dtype)))  # nothing cached, not shared
    assert pulled.num_cached_tokens == 8 * BS
    assert pulled.token_ids == served(holder).token_ids == alone.token_ids == first.token_ids


def evict(engine: Engine, block_id: int) -> None:
    """The holder's memory taken back, as its allocator does when it needs the block."""
    engine.block_manager.allocator.evict(block_id)


def test_a_block_evicted_after_the_export_ends_the_import_there() -> None:
    holder, puller = shared(), shared()
    want = served(holder)
    export = by_reference(holder)
    evict(holder, export.blocks[7].block_id)  # a leaf: nothing is stranded
    result = import_prefix(puller.kv, PROMPT, None, export)
    assert result.imported == 7 and result.rejected == ["block 7: changed or gone mid-copy"]
    puller.check_invariants(idle=True)
    holder.check_invariants(idle=True)
    got = served(puller)
    assert got.num_cached_tokens == 7 * BS and got.token_ids == want.token_ids


class EvictingRows(list):
    """The receiver's destination rows; handing out row ``at`` first evicts the holder's
    block ``victim``, i.e. the holder reuses a block while the copy is under way."""

    def __init__(self, rows, at: int, holder: Engine, victim: int) -> None:
        super().__init__(rows)
        self.at, self.holder, self.victim = at, holder, victim

    def __getitem__(self, i):
        if i == self.at:
            evict(self.holder, self.victim)
            self.holder.runner.kv_cache.data[self.victim].fill_(1.0)  # and rewrites it
        return super().__getitem__(i)


def test_a_block_reused_mid_copy_is_refused_even_after_its_bytes_arrived() -> None:
    holder, puller = shared(), shared()
    served(holder)
    export = by_reference(holder)
    sources = [b.block_id for b in export.blocks]
    flat = puller.runner.kv_cache.data.view(-1).view(64, -1)
    rows = [np.empty(flat.shape[1] * flat.element_size(), np.uint8) for _ in sources]
    # block 3 already copied when the holder reuses it (at row 6): only 0-2 are kept
    rows = EvictingRows(rows, at=6, holder=holder, victim=sources[3])
    gens = [b.generation for b in export.blocks]
    assert read_blocks(export.pool, sources, gens, rows) == 3


def test_a_pool_that_is_not_the_exported_one_gives_nothing() -> None:
    holder, puller = shared(), shared()
    served(holder)
    export = by_reference(holder)
    other = replace(export, pool=replace(export.pool, nonce=b"\0" * 16))  # a recycled fd
    assert import_prefix(puller.kv, PROMPT, None, other).imported == 0
    gone = replace(export, pool=replace(export.pool, pid=2**22 + 7))  # no such process
    assert import_prefix(puller.kv, PROMPT, None, gone).imported == 0
    puller.check_invariants(idle=True)
    assert puller.block_manager.allocator.num_free == 64  # nothing kept, nothing leaked


def test_a_pool_of_another_format_version_is_ignored_not_misread() -> None:
    holder, puller = shared(), shared()
    served(holder)
    export = by_reference(holder)
    pool = holder.runner.kv_cache._pool
    pool._map[8:12] = struct.pack("<I", 2)  # a newer writer's header
    result = import_prefix(puller.kv, PROMPT, None, export)
    assert result.imported == 0 and result.rejected == ["block 0: changed or gone mid-copy"]
    assert served(puller).num_cached_tokens == 0


def test_a_tenants_blocks_are_lent_only_under_its_salt() -> None:
    holder, puller = shared(), shared()
    served(holder, salt="tenant-a")
    assert export_prefix(holder.kv, PROMPT, "tenant-b", by_reference=True).blocks == ()
    export = by_reference(holder, salt="tenant-a")
    assert import_prefix(puller.kv, PROMPT, "tenant-b", export).imported == 0
    assert import_prefix(puller.kv, PROMPT, "tenant-a", export).imported == 8


def _hold_and_export(conn) -> None:
    holder = shared()
    served(holder)
    conn.send(export_prefix(holder.kv, PROMPT, None, by_reference=True))
    conn.recv()  # killed while waiting here


def test_a_holder_killed_before_the_copy_costs_a_miss_and_leaks_nothing() -> None:
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    process = ctx.Process(target=_hold_and_export, args=(theirs,))
    process.start()
    export = ours.recv()
    os.kill(process.pid, signal.SIGKILL)
    process.join(30)
    puller = shared()
    result = import_prefix(puller.kv, PROMPT, None, export)
    assert result.imported == 0 and result.rejected == ["block 0: changed or gone mid-copy"]
    puller.check_invariants(idle=True)
    want = served(build_engine(tiny(num_blocks=64)))
    assert served(puller).token_ids == want.token_ids
    # a memfd dies with the last process holding it: nothing named is left behind
    assert not [n for n in os.listdir("/dev/shm") if "prefix-serve-kv" in n]


class KillingRows(list):
    """The receiver's destination rows; handing out row ``at`` first SIGKILLs the holder's
    process (and reaps it): the holder dies while the copy is under way."""

    def __init__(self, rows, at: int, process) -> None:
        super().__init__(rows)
        self.at, self.process = at, process

    def __getitem__(self, i):
        if i == self.at and self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.join(30)
        return super().__getitem__(i)


def test_a_holder_sigkilled_mid_copy_gives_its_last_blocks_or_nothing_never_a_wrong_token(
    monkeypatch,
) -> None:
    """SIGKILL after 4 of 8 blocks were read. The descriptor the puller opened keeps the
    holder's memfd alive until the copy ends, and a dead process writes nothing, so the
    rest arrives as it was exported (generations unchanged): every block is kept only
    after that check, and each holds exactly what a local computation holds."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    process = ctx.Process(target=_hold_and_export, args=(theirs,))
    process.start()
    export = ours.recv()
    real = transfer.read_blocks

    def killed_at_block_4(locator, sources, generations, rows):
        return real(locator, sources, generations, KillingRows(rows, 4, process))

    monkeypatch.setattr(transfer, "read_blocks", killed_at_block_4)
    puller = shared()
    result = import_prefix(puller.kv, PROMPT, None, export)
    assert not process.is_alive() and process.exitcode == -signal.SIGKILL
    assert result.imported == 8 and result.rejected == []
    puller.check_invariants(idle=True)
    local = shared()
    served(local)
    pulled, computed = (
        [e.block_id for e in export_prefix(engine.kv, PROMPT, None, by_reference=True).blocks]
        for engine in (puller, local)
    )
    kv_pulled = puller.runner.kv_cache.data.view(torch.uint8)
    kv_local = local.runner.kv_cache.data.view(torch.uint8)
    for mine, theirs_ in zip(pulled, computed, strict=True):
        assert kv_pulled[mine].equal(kv_local[theirs_])
    got = served(puller)
    assert got.num_cached_tokens == 8 * BS
    assert got.token_ids == served(build_engine(tiny(num_blocks=64))).token_ids
    puller.check_invariants(idle=True)
    assert not [n for n in os.listdir("/dev/shm") if "prefix-serve-kv" in n]


def test_evictions_bump_the_pools_generations() -> None:
    engine = shared()
    served(engine)
    kv = engine.runner.kv_cache
    cached = engine.block_manager.allocator.eviction_order()
    before = kv.generations.copy()
    engine.block_manager.allocator.evict_all()
    after = np.frombuffer(kv._pool._map, np.int64, 64, GEN_OFFSET)  # what a peer reads
    assert all(after[b] == before[b] + 1 for b in cached)
    assert sum(after) - sum(before) == len(cached)
