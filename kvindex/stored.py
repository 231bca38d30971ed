"""The store rule, written once: which of a prompt's blocks a replica restores from its
node's store, and what the router charges for them (the store's own settings:
``replica.store.config``).

A replica about to admit a request restores the leading blocks its node's store holds
beyond what it holds itself (``replica.store.tier``). The index knows the store as an
entry of its own (``kvindex.records.store_id``); a router that knows each candidate's node
reads that entry's leading run as the candidate's ``stored_blocks`` (``with_stored``) and
counts a restored token at ``token_cost`` of a computed one (a copy out of shared memory:
docs/results.md has the measurement). The replica (``replica.store``), the router
(``router.prefill_cost``) and the simulator (``bench.sim``) call these functions.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from kvindex.records import ReplicaTable, RoutingRequest, store_id


class StorePrices(BaseModel):
    """What a router needs of the node stores (``store:`` in the Serve config): whether
    replicas restore from them, and the price of a restored token. The store's own settings
    extend it (``replica.store.config.StoreConfig``); the router is handed only these."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    token_cost: float = Field(
        0.01, ge=0, le=1, description="the router's price of a restored token, in prefill tokens"
    )


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


def restore_prices(config: StorePrices, tokens: np.ndarray) -> np.ndarray:
    """What restoring each count of ``tokens`` costs, in prefill tokens, rounded up."""
    return np.ceil(tokens * config.token_cost).astype(np.int64)
