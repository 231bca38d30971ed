"""Each prefix's share of the requests a router routed lately: when a hot prefix needs a
second replica before its holder's queue says so.

The sticky rule (``router.prefill_cost``) replicates a prefix only once its holder is
dearer than the cheapest replica by the prefix's recompute plus ``sticky_budget_tokens``:
a queue of about twenty booked requests on the hot tenant trace (docs/results.md, "The
hot tenant on an AVX-512 host"). A burst of a tenant that sends most of the traffic
queues behind one replica before that happens. Demand says it sooner: a prefix that more
than ``1 / replicas`` of the requests share needs more than one replica's share of the
fleet, whatever the queues say this instant.

A prefix here is a block of the chain: a request counts once for every full block of its
prompt (each names the whole prefix up to it, ``kvindex.hashing``), so a tenant's system
prompt is counted by all of its requests, a conversation's history by its own turns, a
chat template's head by everyone. The router asks for the block where a holder's run
ends, which is what it would replicate.

"Lately" decays with requests routed, not with time, as ``router.recent_work`` does: a
count halves for every ``half_life_requests`` requests. Each router counts its own
decisions; an ingress sees about its share of every prefix's traffic, so shares agree.
Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.decayed import DecayedCounts

HALF_LIFE_REQUESTS = 64  # where the knob is on by default (vLLM); a share settles in dozens
RESCALE_AT = 2.0**16  # fold the decay back (and forget) every 16 half-lives
FORGOTTEN = 1e-3  # a count decayed below this many requests is dropped at a rescale
# shares are 0 until this many requests were counted: a trace's first requests are all
# new prefixes, and a share of 2 requests in 3 says nothing yet
MIN_REQUESTS = 16
EVERY = b""  # the empty prefix, which every request carries: the count of all requests


class PrefixDemand:
    """Block hash -> requests that carried it, decayed by the requests routed since.

    Invariant: no block's count exceeds ``EVERY``'s, the count of all requests."""

    def __init__(self, half_life_requests: int = HALF_LIFE_REQUESTS) -> None:
        if half_life_requests < 1:
            raise ValueError("half_life_requests must be >= 1")
        self.half_life_requests = half_life_requests
        self.counts: DecayedCounts[bytes] = DecayedCounts(RESCALE_AT, FORGOTTEN)
        self._seen = 0  # requests counted, not decayed

    def __len__(self) -> int:
        """Blocks counted (not the total)."""
        return max(0, len(self.counts) - 1)

    def record(self, block_hashes: Sequence[bytes]) -> None:
        """One request routed with this chain: each of its blocks counts it once (a chain
        never repeats a hash: each covers every token before it)."""
        self.counts.decay(1.0 / self.half_life_requests)
        add = self.counts.add
        for block in block_hashes:
            add(block, 1.0)
        add(EVERY, 1.0)
        self._seen += 1

    def share(self, block_hash: bytes) -> float:
        """The share of recent requests whose prompt holds this block (0 to 1)."""
        if self._seen < MIN_REQUESTS:
            return 0.0
        return self.counts.value(block_hash) / self.counts.value(EVERY)

    def check(self) -> None:
        self.counts.check()
        total = self.counts.value(EVERY)
        slack = 1e-9 * max(1.0, total)
        assert all(v <= total + slack for _, v in self.counts.items())
