"""``prefill_cost``, the default policy: one cost in prefill tokens, sticky per request.

What the peers learned (Dynamo's, llm-d's, Ray's and SGLang's routers; docs/decisions.md),
in one rule set:

* **Cost** (Dynamo's, in tokens): for each replica, the prompt tokens it would still have
  to prefill for this request (after the cache credit: what it holds, published or booked
  by a recent decision) plus the uncached prompt tokens already booked on it, plus
  ``decode_cost_tokens`` per request it is running. Load is booked by the routers at each
  decision (shared in Redis), so it is fresh, never a stats period late.
* **Sticky per request** (llm-d's, not SGLang's fleet-wide gate): the replica holding the
  most of the prompt keeps it unless its cost exceeds the cheapest replica's by more than
  ``sticky_budget_tokens``. Then the request spills to the cheapest, which is booked as a
  holder of the prefix, so a hot prompt is replicated onto a second, third... replica as
  its demand grows, instead of queueing behind one (Ray's collapse on a hot tenant).
* **New prefixes** (Ray's sharding, without SGLang's death spiral): when no replica holds
  at least ``min_hit_fraction`` of the prompt (a new tenant shares only a chat template's
  head with the others), it goes to the replica owning the fewest cached blocks among
  those within ``new_prefix_slack`` prefills of the cheapest, so tenants spread over
  disjoint caches, but never onto a busy replica (load here leaves out the credit for a
  short held head). The default slack is 0: the least loaded, footprint breaking ties
  (docs/decisions.md says why).
* **Pulls** (``pull.enabled``; ours alone): a replica that lacks a prefix another replica
  has published pulls it instead of recomputing it, so its cost counts those tokens at the
  pull's price (``kvindex.pulls``), a few percent of a prefill. A busy holder then loses a
  hot prefix's overflow, or a conversation, to an idle replica early, at little cost.
* **Ties** break in rendezvous order of the prompt's affinity key: two ingress routers
  make the same choice for the same new prefix, and different prefixes spread.

The ranking lists every replica, the chosen one first and then by cost, so a full replica
spills to the next instead of making the request wait.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvindex.pulls import PullConfig, pull_price, pulled_tokens
from kvindex.records import ReplicaState, RoutingRequest
from router.policies import RoutingPolicy, cache_credit, rendezvous_order


@dataclass(frozen=True)
class CostKnobs:
    """The policy's knobs (``RoutingConfig`` fields of the same names)."""

    decode_cost_tokens: int = 16
    sticky_budget_tokens: int = 512
    new_prefix_slack: float = 0.0
    min_hit_fraction: float = 0.5
    pull: PullConfig | None = None  # the replicas pull prefixes: price a pull, not a prefill


class PrefillCost(RoutingPolicy):
    name = "prefill_cost"
    uses_index = True

    def __init__(self, knobs: CostKnobs = CostKnobs()) -> None:
        self.knobs = knobs
        self._last = ""

    def costs(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> dict[str, int]:
        """Each replica's cost for this request, in prefill tokens: a token it would pull
        from another replica costs the pull's price, not a prefill."""
        k = self.knobs
        return {
            r.replica_id: r.booked_prefill_tokens
            + request.num_prompt_tokens
            - cache_credit(request, r)
            - self._pull_saving(request, r)
            + k.decode_cost_tokens * r.in_flight
            for r in replicas
        }

    def _pull_saving(self, request: RoutingRequest, replica: ReplicaState) -> int:
        """Prefill tokens a pull saves ``replica`` for this request, net of its price."""
        pull = self.knobs.pull
        if pull is None or not pull.enabled:
            return 0
        tokens = pulled_tokens(request, replica, pull.min_blocks)
        return max(0, tokens - pull_price(pull, tokens))

    def rank(self, request: RoutingRequest, replicas: Sequence[ReplicaState]) -> list[str]:
        if not replicas:
            return []
        costs = self.costs(request, replicas)
        order = rendezvous_order(request.affinity_key, [r.replica_id for r in replicas])
        position = {rid: i for i, rid in enumerate(order)}
        by_cost = sorted(costs, key=lambda rid: (costs[rid], position[rid]))
        cheapest = costs[by_cost[0]]
        holder = max(replicas, key=lambda r: (r.held_blocks, -costs[r.replica_id]))
        if cache_credit(request, holder) >= max(
            request.block_size, self.knobs.min_hit_fraction * request.usable_tokens
        ):
            sticky = costs[holder.replica_id] <= cheapest + self.knobs.sticky_budget_tokens
            choice = holder.replica_id if sticky else by_cost[0]
            reason = "sticky" if sticky else "spill"
        else:
            choice = self._new_prefix(request, replicas, costs, position)
            reason = "new prefix"
        self._last = f"{reason}: {choice} " + " ".join(
            f"{rid}={costs[rid]}" for rid in sorted(costs)
        )
        return [choice] + [rid for rid in by_cost if rid != choice]

    def _new_prefix(
        self,
        request: RoutingRequest,
        replicas: Sequence[ReplicaState],
        costs: dict[str, int],
        position: dict[str, int],
    ) -> str:
        """The replica owning the fewest cached blocks among the near-cheapest ones.

        Cost here is load only: the credit for a held head below ``min_hit_fraction`` (a
        chat template's first blocks, which every replica soon holds) is left out, and so
        is what a pull of it would save, or with
        slack 0 the first replica to hold the template would win every new tenant while the
        others sat idle.
        """
        slack = self.knobs.new_prefix_slack * request.num_prompt_tokens
        load = {
            r.replica_id: costs[r.replica_id]
            + cache_credit(request, r)
            + self._pull_saving(request, r)
            for r in replicas
        }
        cheapest = min(load.values())
        near = [r for r in replicas if load[r.replica_id] <= cheapest + slack]
        best = min(near, key=lambda r: (r.footprint_blocks, position[r.replica_id]))
        return best.replica_id

    def explain(self) -> str:
        return f"{self.name} {self._last}"
