"""The mirror's block -> holders table (``kvindex.mirror.holder_table``) against a dict of sets,
after random adds, removes and purges that grow it past its window, fill its overflow and
shrink it again."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from kvindex.mirror import cells, holder_table
from kvindex.mirror.holder_table import HolderTable, block_keys


def model_runs(model: dict[int, set[int]], keys: list[int], live: set[int]) -> dict[int, int]:
    runs = {}
    for s in live:
        n = 0
        while n < len(keys) and s in model.get(keys[n], set()):
            n += 1
        if n:
            runs[s] = n
    return runs


def table_runs(table: HolderTable, keys: list[int], live: set[int]) -> dict[int, int]:
    mask = sum(1 << s for s in live)
    runs = {}
    for run, slots in table.leading_runs(np.array(keys, np.uint64), mask):
        for s in range(slots.bit_length()):
            if slots >> s & 1:
                runs[s] = run
    return runs


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("few", [0, holder_table.FEW, 10_000], ids=["numpy", "mixed", "python"])
@pytest.mark.parametrize("few_keys", [0, cells.FEW_KEYS], ids=["home-first", "windows"])
def test_the_table_holds_what_a_dict_of_sets_holds_after_random_changes(
    seed: int, few: int, few_keys: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches of 1-39 keys: with ``few`` 0 every change takes the numpy path, with 10,000
    the one-key path, by default both; ``few_keys`` 0: every lookup of many keys looks in
    the home cells first (a batch's way), else in whole windows (a chain's)."""
    monkeypatch.setattr(holder_table, "FEW", few)
    monkeypatch.setattr(cells, "FEW_KEYS", few_keys)
    rng = random.Random(seed)
    table, model = HolderTable(capacity=16, slots=2), {}
    universe = block_keys([os.urandom(16) for _ in range(3000)]).tolist()
    for step in range(300):
        slot = rng.randrange(12)
        op = rng.random()
        keys = rng.sample(universe[: rng.choice((40, 3000))], rng.randrange(1, 40))
        if op < 0.6:
            table.add(slot, np.array(keys, np.uint64))
            for k in keys:
                model.setdefault(k, set()).add(slot)
        elif op < 0.95:
            table.remove(slot, np.array(keys, np.uint64))
            for k in keys:
                model.get(k, set()).discard(slot)
        else:
            table.purge(slot)
            for holders in model.values():
                holders.discard(slot)
        model = {k: v for k, v in model.items() if v}
        if step % 25 == 0:
            table.check()
    table.check()
    assert len(table) == len(model)
    for key in rng.sample(universe, 500):
        assert table.holders_of(key) == model.get(key, set())
    for s in range(12):
        assert table.count[s] == sum(s in v for v in model.values())
    chain = rng.sample(universe[:40], 20)
    live = set(rng.sample(range(12), 8))
    assert table_runs(table, chain, live) == model_runs(model, chain, live)


def test_keys_crowding_one_window_overflow_and_still_answer() -> None:
    """Keys with one home cell: the window's 16 cells fill, the rest go to the overflow."""
    table = HolderTable(capacity=1 << 12)
    keys = (np.arange(40, dtype=np.uint64) << np.uint64(13)) | np.uint64(1)  # home cell 0
    table.add(3, keys)
    assert len(table.overflow) == 40 - 16
    table.add(5, keys[-4:])
    table.remove(3, keys[:30])
    table.check()
    assert table.holders_of(int(keys[0])) == set()
    assert table.holders_of(int(keys[-1])) == {3, 5}
    assert table.count[3] == 10 and table.count[5] == 4
    table.purge(3)
    table.check()
    assert len(table) == 4 and table.holders_of(int(keys[-1])) == {5}


def test_a_chains_runs_stop_at_each_holders_first_missing_block() -> None:
    table = HolderTable()
    chain = block_keys([os.urandom(16) for _ in range(6)])
    table.add(0, chain)  # the whole chain
    table.add(1, chain[:3])
    table.add(2, chain[1:])  # not the first block: no run
    runs = table.leading_runs(chain, 0b111)
    assert runs == [(3, 0b10), (6, 0b1)]
    assert table.leading_runs(chain, 0b110) == [(3, 0b10)]  # slot 0 not live


def test_block_keys_need_16_byte_hashes() -> None:
    with pytest.raises(ValueError):
        block_keys([b"short"])
