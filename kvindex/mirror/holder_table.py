"""Which replicas hold each block, for a router's mirror of the index at a thousand replicas:
a numpy hash table, ~13 bytes per (replica, block) instead of a Python dict and set's ~210.

A block is keyed by the first 8 bytes of its 16-byte hash (low bit forced to 1, so 0 marks
an empty cell). A router only ranks replicas by these keys; a replica verifies every hit
against tokens and parent, so a collision of two blocks' keys (about 3 in 10,000 at 100
million blocks) costs at most a routing guess, never a wrong token.

Layout: ``keys`` (uint64) and ``holder`` (int16) in parallel arrays, any length (so it grows
by a quarter, not double: 10 bytes a cell at 60-75% full). A key lives in one of the
``WINDOW`` cells from its home cell on (else in ``overflow``, a plain dict), so a lookup
reads one window and a deletion just empties its cell (no tombstones): ``kvindex.mirror.
cells``. ``holder`` is the one holder's slot, or ``SHARED``: then ``shared[key]`` is the
holders' bitmask (two or more). Changes of up to ``FEW`` keys (a replica's event names a
few blocks) run one key at a time in plain Python: numpy calls sized for a snapshot's
thousands cost ~0.15 ms for one key.

Invariants (``check``): every key is in its window or in ``overflow``, never both, never
twice; a ``shared`` mask has two bits or more and its cell says ``SHARED``; ``count[s]`` is
the number of keys slot ``s`` holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvindex.mirror.cells import WINDOW, cells_holding, cells_of, place

SHARED = -1
MAX_LOAD = 0.75
GROWTH = 1.25  # a full table grows by a quarter: 60-75% of its cells hold keys
RESERVED_LOAD = 0.7  # how full ``reserve`` leaves the table
FEW = 8  # keys an ``add`` or ``remove`` applies one at a time, in plain Python


def block_keys(blocks: Sequence[bytes]) -> np.ndarray:
    """The table's keys of 16-byte block hashes (``kvindex.hashing``), in order."""
    if not blocks:
        return np.zeros(0, np.uint64)
    raw = np.frombuffer(b"".join(blocks), dtype=np.uint64)
    if raw.size != 2 * len(blocks):
        raise ValueError("block hashes are 16 bytes each")
    return raw[0::2] | np.uint64(1)


class HolderTable:
    def __init__(self, capacity: int = 1024, slots: int = 64) -> None:
        self._allocate(max(WINDOW, capacity))
        self.shared: dict[int, int] = {}  # key -> bitmask of holders' slots (two or more)
        self.overflow: dict[int, int] = {}  # key -> holder (slot or SHARED): no room in window
        self.count = np.zeros(slots, np.int64)  # keys held, per slot
        self.used = 0  # keys in cells

    def _allocate(self, capacity: int) -> None:
        self.keys = np.zeros(capacity, np.uint64)
        self.holder = np.zeros(capacity, np.int16)

    def __len__(self) -> int:
        return self.used + len(self.overflow)

    @property
    def nbytes(self) -> int:
        """The arrays' bytes (the dicts, holding few keys, are left out)."""
        return self.keys.nbytes + self.holder.nbytes + self.count.nbytes

    # --- lookups ---

    def holders_of(self, key: int) -> set[int]:
        """The slots holding one key."""
        mask = self._mask(key, self._holders(np.array([key], np.uint64))[0])
        return {s for s in range(mask.bit_length()) if mask >> s & 1}

    def _holders(self, keys: np.ndarray) -> list[int]:
        """Each key's cell's holder (a slot or ``SHARED``), -2 where it is in no cell."""
        cells = cells_of(self.keys, keys)
        return np.where(cells >= 0, self.holder[cells], -2).tolist()

    def _mask(self, key: int, holder: int) -> int:
        if holder == -2:
            holder = self.overflow.get(key, -2)
            if holder == -2:
                return 0
        return self.shared[key] if holder == SHARED else 1 << holder

    def leading_runs(self, keys: np.ndarray, live: int) -> list[tuple[int, int]]:
        """``(run, mask)`` pairs: the slots in ``mask`` (of ``live``, a bitmask) hold exactly
        ``run`` leading keys of the chain (slots with none are left out)."""
        runs, alive, shared = [], live, self.shared
        for i, (key, holder) in enumerate(zip(keys.tolist(), self._holders(keys), strict=True)):
            # ``_mask`` inlined but for the overflow: this loop is most of a decision's
            held = (
                1 << holder
                if holder >= 0
                else shared[key]
                if holder == SHARED
                else self._mask(key, holder)
            )
            still = alive & held
            if still != alive:
                if i:
                    runs.append((i, alive & ~still))
                if not still:
                    return runs
                alive = still
        if alive and keys.size:
            runs.append((keys.size, alive))
        return runs

    # --- changes ---

    def add(self, slot: int, keys: np.ndarray) -> None:
        """``slot`` holds ``keys`` (some it may hold already)."""
        self.ensure_slot(slot)
        if keys.size <= FEW:
            for key in dict.fromkeys(keys.tolist()):
                self._add_one(slot, key)
            return
        keys = np.unique(keys)
        cells = cells_of(self.keys, keys)
        found = cells >= 0
        mine = found & (self.holder[np.maximum(cells, 0)] == slot)
        others = found & ~mine
        for key, cell in zip(keys[others].tolist(), cells[others].tolist(), strict=True):
            self.holder[cell] = self._joined(key, int(self.holder[cell]), slot)
        rest = keys[~found]
        in_overflow = np.zeros(rest.size, bool)
        if self.overflow:
            in_overflow = np.isin(rest, np.fromiter(self.overflow, np.uint64, len(self.overflow)))
        for key in rest[in_overflow].tolist():
            self.overflow[key] = self._joined(key, self.overflow[key], slot)
        self._insert(rest[~in_overflow], slot)

    def _add_one(self, slot: int, key: int) -> None:
        """``add`` for one key, in plain Python (see the module)."""
        cells = cells_holding(self.keys, key, key)
        if cells:
            self.holder[cells[0]] = self._joined(key, int(self.holder[cells[0]]), slot)
        elif key in self.overflow:
            self.overflow[key] = self._joined(key, self.overflow[key], slot)
        else:
            if self.used + 1 > MAX_LOAD * self.keys.size:
                self._rebuild(int(GROWTH * self.keys.size), 1)
            self.count[slot] += 1
            free = cells_holding(self.keys, key, 0)
            if not free:
                self.overflow[key] = slot
            else:
                self.keys[free[0]], self.holder[free[0]] = key, slot
                self.used += 1

    def _joined(self, key: int, holder: int, slot: int) -> int:
        """A key's holder once ``slot`` joins (counted if it is new)."""
        bit = 1 << slot
        if holder == SHARED:
            if not self.shared[key] & bit:
                self.shared[key] |= bit
                self.count[slot] += 1
            return SHARED
        if holder == slot:
            return slot
        self.shared[key] = (1 << holder) | bit
        self.count[slot] += 1
        return SHARED

    def _insert(self, keys: np.ndarray, slot: int) -> None:
        """New keys (not in the table), held by ``slot`` alone."""
        if self.used + keys.size > MAX_LOAD * self.keys.size:
            self._rebuild(int(GROWTH * self.keys.size), keys.size)
        self.count[slot] += keys.size
        self._place(keys, np.full(keys.size, slot, np.int16))

    def _place(self, keys: np.ndarray, holders: np.ndarray) -> None:
        """New keys into free cells of their windows, the overflow where none is free."""
        placed, overflow = place(self.keys, self.holder, keys, holders)
        self.used += placed
        self.overflow.update(overflow)

    def reserve(self, more: int) -> None:
        """Room for ``more`` new keys without growing meanwhile (a snapshot knows how many
        blocks it brings: one rebuild instead of one per quarter grown)."""
        if self.used + more > MAX_LOAD * self.keys.size:
            self._rebuild(int((self.used + more) / RESERVED_LOAD) + 1, more)

    def remove(self, slot: int, keys: np.ndarray) -> None:
        """``slot`` no longer holds ``keys`` (those it does not hold are ignored)."""
        self.ensure_slot(slot)
        if keys.size <= FEW:
            for key in dict.fromkeys(keys.tolist()):
                self._remove_one(slot, key)
            return
        keys = np.unique(keys)
        cells = cells_of(self.keys, keys)
        found = cells >= 0
        holder = self.holder[np.maximum(cells, 0)]
        alone = found & (holder == slot)
        self.keys[cells[alone]] = 0
        self.used -= int(alone.sum())
        self.count[slot] -= int(alone.sum())
        shared = found & (holder == SHARED)
        for key, cell in zip(keys[shared].tolist(), cells[shared].tolist(), strict=True):
            self.holder[cell] = self._left(key, slot)
        for key in [k for k in keys[~found].tolist() if k in self.overflow]:
            self._leave_overflow(key, slot)

    def _remove_one(self, slot: int, key: int) -> None:
        """``remove`` for one key in plain Python (see ``_add_one``)."""
        cells = cells_holding(self.keys, key, key)
        if cells:
            cell, holder = cells[0], int(self.holder[cells[0]])
            if holder == slot:
                self.keys[cell] = 0
                self.used -= 1
                self.count[slot] -= 1
            elif holder == SHARED:
                self.holder[cell] = self._left(key, slot)
        elif key in self.overflow:
            self._leave_overflow(key, slot)

    def _leave_overflow(self, key: int, slot: int) -> None:
        """``slot`` no longer holds ``key``, which lives in the overflow."""
        holder = self.overflow[key]
        if holder == slot:
            del self.overflow[key]
            self.count[slot] -= 1
        elif holder == SHARED:
            self.overflow[key] = self._left(key, slot)

    def _left(self, key: int, slot: int) -> int:
        """A shared key's holder once ``slot`` leaves it (counted if it held it)."""
        mask = self.shared[key]
        if mask >> slot & 1:
            mask ^= 1 << slot
            self.count[slot] -= 1
        if mask & (mask - 1):
            self.shared[key] = mask
            return SHARED
        del self.shared[key]
        return mask.bit_length() - 1

    def purge(self, slot: int) -> None:
        """``slot`` holds nothing any more."""
        self.ensure_slot(slot)
        alone = np.flatnonzero((self.holder == slot) & (self.keys != 0))
        self.keys[alone] = 0
        self.used -= alone.size
        self.count[slot] -= alone.size
        bit = 1 << slot
        rest = [k for k, mask in self.shared.items() if mask & bit]
        rest += [k for k, h in self.overflow.items() if h == slot]
        self.remove(slot, np.array(rest, np.uint64))
        if self.used < MAX_LOAD * self.keys.size / 8 and self.keys.size > 1024:
            self._rebuild(self.keys.size // 4, 0)

    def _rebuild(self, capacity: int, extra: int) -> None:
        """Re-place every key in ``capacity`` cells (or more: room for ``extra`` new ones)."""
        while self.used + extra > MAX_LOAD * capacity:
            capacity = int(GROWTH * capacity) + 1
        live = self.keys != 0
        keys, holders = self.keys[live], self.holder[live]
        overflow = self.overflow
        self._allocate(capacity)
        self.overflow, self.used = {}, 0
        self._place(keys, holders)
        if overflow:
            self._place(
                np.array(list(overflow), np.uint64), np.array(list(overflow.values()), np.int16)
            )

    def ensure_slot(self, slot: int) -> None:
        if slot >= self.count.size:
            self.count = np.concatenate([self.count, np.zeros(slot + 1, np.int64)])

    def check(self) -> None:
        """The invariants of the module docstring."""
        cells = np.flatnonzero(self.keys)
        keys = self.keys[cells]
        assert cells.size == self.used and np.unique(keys).size == keys.size
        cap = np.uint64(self.keys.size)
        home = (keys >> np.uint64(1)) % cap
        assert np.all(((cells.astype(np.uint64) + cap - home) % cap) < WINDOW)
        assert not set(keys.tolist()) & set(self.overflow)
        holders = dict(zip(keys.tolist(), self.holder[cells].tolist(), strict=True))
        holders.update(self.overflow)
        counts = np.zeros(self.count.size, np.int64)
        for key, holder in holders.items():
            if holder == SHARED:
                mask = self.shared[key]
                assert mask & (mask - 1), key
                for s in range(mask.bit_length()):
                    counts[s] += mask >> s & 1
            else:
                counts[holder] += 1
        assert set(self.shared) == {k for k, h in holders.items() if h == SHARED}
        assert np.array_equal(counts, self.count), (counts, self.count)
