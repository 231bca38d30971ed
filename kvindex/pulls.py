"""The pull rule, written once: when a replica pulls a prompt's blocks from another replica
instead of recomputing them, from which one, and what the router charges for it.

A replica about to admit a request asks the index what every live replica has *published*
of the prompt's chain; the one that has published the most is the source, if it holds at
least ``min_blocks`` more leading blocks than the replica has without it, in its own pool
or in its node's store (``pull_source``). The
replica (``replica.pull``), the router pricing a pull (``router.prefill_cost``) and the
simulator (``bench.sim``) all call these functions, so they agree on when a pull happens.

Prices are in prefill tokens, the routing policy's unit: a pulled token costs
``token_cost`` of a computed one (bytes per token over the copy's bandwidth, in units of a
prefill token's compute time) and each pull ``call_cost_tokens`` more (the index query and
the call to the holder). Both defaults are fitted to pulls on a real 2-replica cluster
(``python -m bench pull --where cluster --prefix-tokens 256,1024``, docs/results.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from kvindex.records import ReplicaState, ReplicaTable, RoutingRequest, is_store


class PullPrices(BaseModel):
    """What a router needs of pulls (``pull:`` in the Serve config): whether replicas pull,
    from how many missing blocks, and the price. The replica's own settings extend it
    (``replica.pull_config.PullConfig``); the router is handed only these."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    min_blocks: int = Field(4, ge=1, description="pull only when this many blocks are missing")
    token_cost: float = Field(
        0.046, ge=0, le=1, description="the router's price of a pulled token, in prefill tokens"
    )
    call_cost_tokens: int = Field(
        31, ge=0, description="the router's price of one pull's calls, in prefill tokens"
    )


def pull_source(
    states: Iterable[ReplicaState], replica_id: str, min_blocks: int, own_store: str = ""
) -> str | None:
    """The replica ``replica_id`` would pull from: the one that has published the most of
    the chain (ties: the first listed), if that is ``min_blocks`` or more beyond what
    ``replica_id`` has without a pull: what it has published itself, or what its node's
    store (``own_store``, its index entry) holds, which it restores at admission without
    a call into another replica; else None."""
    own, best = 0, None
    for state in states:
        held = state.cached_blocks or 0
        if is_store(state.replica_id):
            if state.replica_id == own_store:
                own = max(own, held)
            continue  # a node's store is read by its node's replicas, not pulled from
        if state.replica_id == replica_id:
            own = max(own, held)
        elif best is None or held > (best.cached_blocks or 0):
            best = state
    if best is None or (best.cached_blocks or 0) - own < min_blocks:
        return None
    return best.replica_id


def with_pullable(states: Sequence[ReplicaState]) -> Any:
    """``states`` with ``pullable_blocks`` set: for each replica, the most any *other*
    replica has published of the chain (what it could pull). A ``ReplicaTable`` in, a
    table out; a list in, a list out."""
    table = ReplicaTable.of(states)
    if len(table) < 2:
        return states
    cached = table.column("cached_blocks")
    top = int(np.argmax(cached))
    first, second = cached[top], np.max(np.delete(cached, top))
    pullable = np.full(len(table), first, np.int64)
    pullable[top] = second
    pulled = table.with_columns(pullable_blocks=pullable)
    return pulled if isinstance(states, ReplicaTable) else list(pulled)


def pulled_tokens(request: RoutingRequest, state: ReplicaState, min_blocks: int) -> int:
    """Prompt tokens ``state``'s replica would pull for ``request``: what another replica
    has published beyond what this one holds, if ``min_blocks`` or more (0 otherwise)."""
    return int(pulled_token_column(request, ReplicaTable.of([state]), min_blocks)[0])


def pulled_token_column(
    request: RoutingRequest, table: ReplicaTable, min_blocks: int
) -> np.ndarray:
    """``pulled_tokens`` of every replica of a table."""
    usable_blocks = request.usable_tokens // request.block_size
    pullable = np.minimum(table.column("pullable_blocks"), usable_blocks)
    missing = pullable - np.minimum(table.held, usable_blocks)
    return np.where(missing >= min_blocks, missing * request.block_size, 0)


def pull_price(config: PullPrices, tokens: int) -> int:
    """What pulling ``tokens`` costs, in prefill tokens (0 for no pull)."""
    return int(pull_prices(config, np.array([tokens], np.int64))[0])


def pull_prices(config: PullPrices, tokens: np.ndarray) -> np.ndarray:
    """What pulling each count of ``tokens`` costs: the call's price plus each token's,
    rounded up (0 for no pull). The one price rule; ``pull_price`` is it for one count."""
    price = config.call_cost_tokens + np.ceil(tokens * config.token_cost).astype(np.int64)
    return np.where(tokens > 0, price, 0)
