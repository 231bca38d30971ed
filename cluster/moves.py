"""An operator's order to move streams off an engine replica now (``replica.moves``): before
maintenance, or to see a replica's load go elsewhere, without dropping a token.

``POST /cluster/replicas/{replica_id}/moves`` reaches exactly that replica (its ``MoveOrder``
names it, as a pull names its holder) and answers with each move: where the stream went,
the tokens and bytes of KV that went with it, how long it took. The streams go on as
continuations from the ingress, token-exact (``cluster.engine_stream``).
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Any

from ray.serve.handle import DeploymentHandle

from cluster.api.errors import APIError
from replica.messages import Move, MoveOrder

ORDER_TIMEOUT_S = 60.0  # every move pushes within its own timeout; this bounds the order


async def order_moves(
    engine: DeploymentHandle,
    live: set[str],
    replica_id: str,
    to: str | None,
    max_streams: int | None,
    push_timeout_s: float | None = None,
) -> dict[str, Any]:
    """Move ``replica_id``'s streams (to ``to``, else where the router sends each); 404 for
    a replica Serve does not run, 400 for a move to itself."""
    for name, value in (("replica_id", replica_id), ("to", to)):
        if value is not None and value not in live:
            raise APIError(404, f"{name}: no engine replica {value!r}", param=name)
    if to == replica_id:
        raise APIError(400, "to: a replica cannot take its own streams", param="to")
    order = MoveOrder(replica_id, to, max_streams, "operator", push_timeout_s)
    call = engine.options(stream=False).move_streams.remote(order)
    moves: list[Move] = await asyncio.wait_for(call, ORDER_TIMEOUT_S)
    return {"replica_id": replica_id, "moves": [asdict(m) for m in moves]}
