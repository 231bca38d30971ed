"""Which way of a full set a node store put replaces (``replica.store.node_store``).

Two rules on top of the set's LRU order: a tenant's share (each slot names the tenant whose
pool released the block: ``layout.owner_id``; the tenant holding the most ways of the set
gives one up, so a flood replaces its own blocks) and a session's keep (a block stored with
``keep_until_ns`` is never replaced before then: ``replica.store.tier.keep_session``).
"""

from __future__ import annotations

import numpy as np

from replica.store.layout import VALID, WRITTEN


def victim_way(ways: np.ndarray, owner: int, now_ns: int) -> int:
    """The way a put takes: a free one (a written one first: its pages exist), else the
    least recently used way that no session keeps past ``now_ns`` of the owner holding the
    most ways of the set (kept ones too: a session's blocks count in its tenant's share),
    counting the new block as ``owner``'s. So a tenant flooding the store replaces its own
    blocks once it holds as many as any other, and never takes another tenant's below that;
    with one owner it is the least recently used. -1: every way is kept."""
    free = np.flatnonzero((ways["flags"] & VALID) == 0)
    if free.size:
        written = free[(ways["flags"][free] & WRITTEN) != 0]
        return int(written[0] if written.size else free[0])
    open_ = ways["keep_until_ns"] <= now_ns
    owners, counts = np.unique(ways["owner"], return_counts=True)
    counts = counts + (owners == owner)
    for level in np.unique(counts)[::-1]:  # the heaviest owners first (ties together)
        candidates = np.flatnonzero(open_ & np.isin(ways["owner"], owners[counts == level]))
        if candidates.size:
            return int(candidates[np.argmin(ways["used_ns"][candidates])])
    return -1
