"""The store rule, written once: the second cache tier's settings (``store:`` in the Serve
config), which of a prompt's blocks a replica restores from its node's store, and what the
router charges for them.

A replica about to admit a request restores the leading blocks its node's store holds
beyond what it holds itself (``replica.store.tier``). The index knows the store as an
entry of its own (``kvindex.records.store_id``); a router that knows each candidate's node
reads that entry's leading run as the candidate's ``stored_blocks`` (``with_stored``) and
counts a restored token at ``token_cost`` of a computed one (a copy out of shared memory:
docs/results.md has the measurement). The replica (``replica.store``), the router
(``router.prefill_cost``) and the simulator (``bench.sim``) call these functions.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from kvindex.config import IndexConfig
from kvindex.records import ReplicaTable, RoutingRequest, store_id


class StoreConfig(BaseModel):
    """A node-shared store of evicted KV blocks, then (if set) a disk directory.

    On by default: the store takes memory only as blocks fill it (up to ``memory_bytes``),
    and a block is spilled when it is released, behind the step. Disk is off unless
    ``disk_directory`` is set.
    """

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    directory: str = Field("/dev/shm", description="where the shared-memory file lives")
    memory_bytes: int | None = Field(
        None, gt=0, description="the store's size; None: 1/16 of the node's RAM, at most "
        "a quarter of the directory's free space",
    )  # fmt: skip
    ways: int = Field(16, gt=0, le=256, description="slots per set (LRU within a set)")
    disk_directory: str | None = Field(None, description="the disk tier's directory; None: off")
    disk_bytes: int = Field(8 * 2**30, gt=0, description="the disk tier's size")
    disk_after_uses: int = Field(
        2, ge=1, description="a block the store evicts goes to disk if used this often"
    )
    stale_after_s: float = Field(
        3600.0, ge=0, description="an unused store of another cluster is removed after this"
    )
    token_cost: float = Field(
        0.01, ge=0, le=1, description="the router's price of a restored token, in prefill tokens"
    )

    def size_bytes(self) -> int:
        """``memory_bytes``, or the default (see the field)."""
        if self.memory_bytes is not None:
            return self.memory_bytes
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        st = os.statvfs(self.directory)
        return max(1, min(ram // 16, st.f_bavail * st.f_frsize // 4))


def store_namespace(index: IndexConfig) -> str:
    """What names a cluster's stores on a node: its index's cluster name and Redis (two
    clusters of one name on different Redis servers are two clusters)."""
    where = hashlib.blake2b(index.url.encode(), digest_size=4).hexdigest()
    return f"{index.cluster}.{where}"


def with_stored(
    table: ReplicaTable, answer: ReplicaTable, nodes: Mapping[str, str]
) -> ReplicaTable:
    """``table`` with ``stored_blocks`` set: for each replica whose node is known, the
    leading run of the prompt that its node's store holds (the index's answer)."""
    runs = {}
    for node in set(nodes.values()):
        entry = answer.state_of(store_id(node))
        runs[node] = (entry.cached_blocks or 0) if entry is not None else 0
    if not any(runs.values()):
        return table
    stored = np.array([runs.get(nodes.get(rid, ""), 0) for rid in table.ids], np.int64)
    return table.with_columns(stored_blocks=stored)


def stored_token_column(request: RoutingRequest, table: ReplicaTable) -> np.ndarray:
    """Prompt tokens each replica would restore from its node's store for ``request``:
    the store's run beyond what the replica holds."""
    usable_blocks = request.usable_tokens // request.block_size
    stored = np.minimum(table.column("stored_blocks"), usable_blocks)
    missing = stored - np.minimum(table.held, usable_blocks)
    return np.maximum(missing, 0) * request.block_size


def restore_prices(config: StoreConfig, tokens: np.ndarray) -> np.ndarray:
    """What restoring each count of ``tokens`` costs, in prefill tokens, rounded up."""
    return np.ceil(tokens * config.token_cost).astype(np.int64)
