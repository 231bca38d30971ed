"""Where a key lives in a ``HolderTable``'s arrays (``kvindex.mirror.holder_table``): open
addressing over ``keys`` (uint64, 0 marks an empty cell) with ``holder`` beside it.

A key's home cell is ``(key >> 1) % capacity``; it lives in one of the ``WINDOW`` cells from
its home on (wrapping), else in the table's overflow (a dict the caller keeps). These are
plain functions of the arrays: the table keeps the counts and the holders' meaning.
"""

from __future__ import annotations

import numpy as np

WINDOW = 16
CHUNK = 1 << 16  # keys placed at once (a window is 16 cells: a big batch's would not fit)
_OFFSETS = np.arange(WINDOW, dtype=np.uint64)
_WINDOW_OFFSETS = np.arange(WINDOW, dtype=np.int64)
FEW_KEYS = 512  # keys ``cells_of`` looks up in their whole windows at once


def windows(cells: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Each key's window of cells, a row each (one modulo per key, not per cell)."""
    cap = np.uint64(cells.size)
    window = ((keys >> np.uint64(1)) % cap)[:, None] + _OFFSETS
    return np.where(window >= cap, window - cap, window)


def cells_of(cells: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Each key's cell, or -1 where it is not in a cell. A chain's few keys are looked up in
    their whole windows at once (one gather: each numpy call costs a microsecond whatever its
    size, and a decision looks up 64 keys); a batch's many keys first in their home cells,
    where most of them sit, and only the rest in their windows."""
    home = ((keys >> np.uint64(1)) % np.uint64(cells.size)).astype(np.int64)
    if keys.size <= FEW_KEYS:
        return _in_windows(cells, keys, home)
    away = np.flatnonzero(cells[home] != keys)
    if away.size:
        home[away] = _in_windows(cells, keys[away], home[away])
    return home


def _in_windows(cells: np.ndarray, keys: np.ndarray, home: np.ndarray) -> np.ndarray:
    """Each key's cell in the window from ``home`` on (wrapping), -1 where it is in none."""
    hit = np.take(cells, home[:, None] + _WINDOW_OFFSETS, mode="wrap") == keys[:, None]
    found = home + hit.argmax(axis=1)
    found[found >= cells.size] -= cells.size
    found[~hit.any(axis=1)] = -1
    return found


def cells_holding(cells: np.ndarray, key: int, content: int) -> list[int]:
    """The cells of one key's window that hold ``content`` (the key itself, or 0: the free
    ones), in window order: for one key at a time, in plain Python."""
    cap = cells.size
    home = (key >> 1) % cap
    window = [c - cap if c >= cap else c for c in range(home, home + WINDOW)]
    return [c for c, k in zip(window, cells[window].tolist(), strict=True) if k == content]


def place(
    cells: np.ndarray, holder: np.ndarray, keys: np.ndarray, holders: np.ndarray
) -> tuple[int, dict[int, int]]:
    """Put new keys (in no cell yet) in free cells of their windows, ``CHUNK`` at a time;
    returns how many took a cell and, for the rest (their windows full), key -> holder."""
    placed, overflow = 0, {}
    for first in range(0, keys.size, CHUNK):
        chunk = slice(first, first + CHUNK)
        placed += _place_chunk(cells, holder, keys[chunk], holders[chunk], overflow)
    return placed, overflow


def _place_chunk(
    cells: np.ndarray,
    holder: np.ndarray,
    keys: np.ndarray,
    holders: np.ndarray,
    overflow: dict[int, int],
) -> int:
    home = (keys >> np.uint64(1)) % np.uint64(cells.size)  # first, each key at a free home
    free_home = np.flatnonzero(cells[home] == 0)
    taken_cells, taken = np.unique(home[free_home], return_index=True)
    taken = free_home[taken]
    cells[taken_cells], holder[taken_cells] = keys[taken], holders[taken]
    placed = taken_cells.size
    while True:
        left = np.ones(keys.size, bool)
        left[taken] = False
        keys, holders = keys[left], holders[left]
        if not keys.size:
            return placed
        window = windows(cells, keys)
        free = cells[window] == 0
        room = free.any(axis=1)
        for key, h in zip(keys[~room].tolist(), holders[~room].tolist(), strict=True):
            overflow[key] = h
        keys, holders, window, free = keys[room], holders[room], window[room], free[room]
        first = window[np.arange(keys.size), free.argmax(axis=1)]
        taken_cells, taken = np.unique(first, return_index=True)  # one key per cell a round
        cells[taken_cells], holder[taken_cells] = keys[taken], holders[taken]
        placed += taken_cells.size
