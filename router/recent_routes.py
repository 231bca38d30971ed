"""What this router itself sent where, block by block: its fallback when the index does
not answer in time.

The Redis index knows what every replica holds and what every router just booked, but a
router in a CPU-starved process can miss its answer, and without it a request was placed
blind (docs/decisions.md has the numbers). Ray's
prefix router keeps only a local record of the text it routed and never waits; this keeps
the same kind of record, by block hash, and is read only when the index answers
"unknown". An entry is a guess (the replica may have evicted the block, another router's
decisions are not in it): a wrong guess costs a cache miss, never a wrong answer.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

from kvindex.records import leading_runs


class RecentRoutes:
    """Block hash -> replicas this router sent it to, each until ``horizon_s`` after that;
    at most ``max_blocks`` hashes, the least recently routed dropped first."""

    def __init__(self, max_blocks: int = 100_000, horizon_s: float = 120.0) -> None:
        if max_blocks < 1 or horizon_s <= 0:
            raise ValueError("max_blocks must be >= 1 and horizon_s > 0")
        self.max_blocks = max_blocks
        self.horizon_s = horizon_s
        self._by_block: OrderedDict[bytes, dict[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_block)

    def record(
        self, replica_id: str, block_hashes: Sequence[bytes], now: float | None = None
    ) -> None:
        """The request with this chain was sent to ``replica_id``."""
        until = (time.monotonic() if now is None else now) + self.horizon_s
        for block in block_hashes:
            self._by_block.setdefault(block, {})[replica_id] = until
            self._by_block.move_to_end(block)
        while len(self._by_block) > self.max_blocks:
            self._by_block.popitem(last=False)

    def held(self, block_hashes: Sequence[bytes], now: float | None = None) -> dict[str, int]:
        """For each replica, how many leading blocks of the chain were routed to it (and
        have not expired): the same leading-run rule as the index's answer."""
        now = time.monotonic() if now is None else now

        def holders(block: bytes) -> set[str]:
            return {rid for rid, until in self._by_block.get(block, {}).items() if until > now}

        first = holders(block_hashes[0]) if block_hashes else set()
        runs = leading_runs(block_hashes, first, holders)
        return {rid: n for rid, n in runs.items() if n}

    def forget(self, replica_id: str) -> None:
        """A replica died: nothing it held is there any more."""
        for holders in self._by_block.values():
            holders.pop(replica_id, None)
