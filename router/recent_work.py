"""The work a router sent each replica lately: what a new prefix's placement balances.

Load now (booked prefill, requests in flight) says who is free this instant; at a light
rate most replicas are, and a new conversation or tenant, placed by that alone, lands
where a tie falls. Once placed it stays (its prefix is cached there), so each later turn
adds work where it landed: the replicas' shares of conversations become a balls-into-bins
draw and work drifts apart (simulator, multi_turn at 32 replicas: max/mean work 1.32,
docs/results.md). Placing a new prefix on the replica that did the least recent work
spreads what will come back.

"Recent" decays with work routed, not with time: a replica's score halves for every
``half_life_tokens`` tokens routed per live replica, so the window is the same share of
the fleet's traffic at any size and any clock (the simulator's or a real one), and a
replica that joins late (score 0) takes new prefixes until it has done its share.

Each router counts only its own decisions (two ingress routers each see about half the
traffic: each balances its half, so the sum balances); nothing here does I/O.

The decay is ``router.decayed.DecayedCounts``: a decision costs O(1) and only the
replicas compared are read.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from router.decayed import DecayedCounts

RESCALE_AT = 1e200  # the decay's factor is folded back before floats overflow
HALF_LIFE_TOKENS = 16384  # the default: about one conversation's life (docs/results.md)
FORGOTTEN = 1e-6  # a score decayed below this many tokens is dropped at a rescale


class RecentWork:
    """Replica id -> tokens sent there to run, decayed by the work routed since."""

    def __init__(self, half_life_tokens: int = HALF_LIFE_TOKENS) -> None:
        if half_life_tokens < 1:
            raise ValueError("half_life_tokens must be >= 1")
        self.half_life_tokens = half_life_tokens
        self.scores: DecayedCounts[str] = DecayedCounts(RESCALE_AT, FORGOTTEN)

    def record(self, replica_id: str, tokens: int, replicas: int) -> None:
        """``tokens`` (prompt tokens to compute and output tokens) went to ``replica_id``,
        one of ``replicas`` live replicas: every score decays by that much work."""
        if tokens <= 0:
            return
        self.scores.decay(tokens / (self.half_life_tokens * max(1, replicas)))
        self.scores.add(replica_id, tokens)

    def score(self, replica_id: str) -> float:
        """The replica's decayed work, in tokens (0 for one never sent anything)."""
        return self.scores.value(replica_id)

    def column(self, replica_ids: Sequence[str]) -> np.ndarray:
        """The scores of ``replica_ids`` in their order, scaled alike (for comparing)."""
        return self.scores.scaled(replica_ids)

    def check(self) -> None:
        self.scores.check()
