"""Which way of a full set a node store put replaces (``replica.store.node_store``).

Two rules on top of the set's LRU order: a tenant's weighted share (each slot names the
tenant whose pool released the block, ``layout.owner_id``, and its weight then; the tenant
holding the most ways for its weight gives one up, so a flood replaces its own blocks) and
a session's keep (a block stored with ``keep_until_ns`` is never replaced before then:
``replica.store.tier.keep_session``).
"""

from __future__ import annotations

import numpy as np

from replica.store.layout import VALID, WRITTEN


def victim_way(ways: np.ndarray, owner: int, weight: float, now_ns: int) -> int:
    """The way a put takes: a free one (a written one first: its pages exist), else the
    least recently used way that no session keeps past ``now_ns`` of the owner holding the
    most ways for its weight (ways over weight; kept ones count too: a session's blocks
    count in its tenant's share), counting the new block as ``owner``'s at ``weight``. An
    owner's weight is the one its latest put in the set recorded (``weight`` for
    ``owner``). So a tenant flooding the store replaces its own blocks once its ways reach
    its weighted share of the set, and never takes another tenant's below that (weights
    1 and 3 hold 1:3 of a contended set); with one owner it is the least recently used.
    -1: every way is kept."""
    free = np.flatnonzero((ways["flags"] & VALID) == 0)
    if free.size:
        written = free[(ways["flags"][free] & WRITTEN) != 0]
        return int(written[0] if written.size else free[0])
    load = _loads(ways, owner, weight)
    open_ = ways["keep_until_ns"] <= now_ns
    for level in np.unique(load)[::-1]:  # the heaviest owners first (ties together)
        candidates = np.flatnonzero(open_ & (load == level))
        if candidates.size:
            return int(candidates[np.argmin(ways["used_ns"][candidates])])
    return -1


def _loads(ways: np.ndarray, owner: int, weight: float) -> np.ndarray:
    """Each way's owner's ways over its weight (the new block counted as ``owner``'s)."""
    load = np.zeros(len(ways))
    for who in np.unique(ways["owner"]):
        mine = ways["owner"] == who
        latest = float(ways["weight"][mine][np.argmax(ways["used_ns"][mine])])
        w = weight if who == owner else latest
        load[mine] = (int(mine.sum()) + (who == owner)) / (w if w > 0 else 1.0)
    return load
