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
  head with the others), it goes to the replica that did the least recent work
  (``router.recent_work``) among those within ``new_prefix_slack`` prefills of the
  cheapest, so tenants and conversations spread by the work they bring back, but never
  onto a busy replica (load here leaves out the credit for a short held head). The
  default slack is 0: the least loaded, recent work breaking ties (docs/decisions.md
  says why). A replica keeping more of the prompt than any other keeps that lead as a
  credit (``lead_credit``): a tenant whose tail was evicted stays where its head
  survives unless that replica is busier by more than what survives there.
* **Pulls** (``pull.enabled``; ours alone): a replica that lacks a prefix another replica
  has published pulls it instead of recomputing it, so its cost counts those tokens at the
  pull's price (``kvindex.pulls``), a few percent of a prefill. A busy holder then loses a
  hot prefix's overflow, or a conversation, to an idle replica early, at little cost.
* **Stores** (``store.enabled``; ours alone): a replica restores the blocks its node's
  store holds beyond its own (``kvindex.stored``), so those tokens cost a copy's price.
  A prefix evicted from every pool, or left by a replica that died, is still cheap on
  every replica of the node that kept it, and counts as held by each of them: among a
  node's replicas the cheapest is a stored prefix's holder, not the one that computed
  it (stickiness there would buy no locality, only uneven batches).
* **Ties** break in rendezvous order of the first block of the prompt beyond the longest
  run any replica holds (``tie_key``): the block where this prompt parts from what is
  cached, a new tenant's or a new conversation's first block of its own. Two ingress
  routers make the same choice for the same new prefix, and different prefixes spread even
  when they share a system prompt longer than the affinity key's blocks (keyed by that, all
  of them would break every tie towards one replica).
* **Hot prefixes** (``hot_half_life_requests``; ours alone): a prefix that more of the
  recent requests share than its holders' part of the fleet (``router.prefix_demand``:
  its share times the replicas exceeds its holders) goes to the least loaded replica
  when that is not a holder, paying one recompute for a second copy before a burst
  queues behind the one holder, not after.

The ranking lists every replica, the chosen one first and then by cost, so a full replica
spills to the next instead of making the request wait.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvindex.pulls import PullPrices, pull_prices, pulled_token_column
from kvindex.records import ReplicaTable, RoutingRequest
from kvindex.stored import StorePrices, restore_prices, stored_token_column
from router.policies import (
    Ranking,
    RoutingPolicy,
    cache_credits,
    cheapest,
    cost_order,
    rendezvous_weights,
)
from router.prefix_demand import PrefixDemand
from router.recent_work import HALF_LIFE_TOKENS, RecentWork

EXPLAINED = 8  # replicas an explanation lists (the choice and the cheapest)
# how much dearer than the cheapest the holder of a prefix may be and keep its requests:
# 768 keeps a tenant's repeats together better than 512 with the segmented LRU's protected
# hits, at a tail within 1.1x round robin's (docs/results.md, "Hits that come back")
STICKY_BUDGET_TOKENS = 768


@dataclass(frozen=True)
class CostKnobs:
    """The policy's knobs (``RoutingConfig`` fields of the same names)."""

    decode_cost_tokens: int = 16
    sticky_budget_tokens: int = STICKY_BUDGET_TOKENS
    new_prefix_slack: float = 0.0
    min_hit_fraction: float = 0.5
    work_half_life_tokens: int = HALF_LIFE_TOKENS
    pull: PullPrices | None = None  # the replicas pull prefixes: price a pull, not a prefill
    store: StorePrices | None = None  # node stores: price a restore, not a prefill
    hot_half_life_requests: int = 0  # > 0: replicate hot prefixes (router.prefix_demand)


def tie_key(request: RoutingRequest, held_blocks: int) -> bytes:
    """The key whose rendezvous order breaks ties among replicas of equal cost: the block
    of the chain after the longest run held (``held_blocks``), its last block if all of it
    is held, the affinity key for a prompt shorter than a block."""
    chain = request.block_hashes
    if not chain:
        return request.affinity_key
    return chain[min(held_blocks, len(chain) - 1)]


def lead_credit(request: RoutingRequest, kept: np.ndarray) -> np.ndarray:
    """Prompt tokens the one replica keeping the most leading blocks (``kept``) keeps
    beyond every other replica: its lead, credited to it alone. Zeros when two keep the
    most, or when no other replica keeps any of it: only a lead beyond a head another
    replica keeps too (a chat template) counts, so the head itself attracts no new tenant
    (the first replica to cache a template would win them all), while a tenant's prompt
    whose tail was evicted keeps its surviving part's worth.
    """
    credit = np.zeros(len(kept), np.int64)
    if len(kept) < 2:
        return credit
    second, top = np.partition(kept, -2)[-2:]
    if top > second > 0:
        usable = min(int(top) * request.block_size, request.usable_tokens)
        credit[int(np.argmax(kept))] = max(0, usable - int(second) * request.block_size)
    return credit


class PrefillCost(RoutingPolicy):
    """Ranks a ``ReplicaTable`` with array operations: a thousand replicas in well under a
    millisecond (``python -m bench index --scale``)."""

    name = "prefill_cost"
    uses_index = True

    def __init__(self, knobs: CostKnobs = CostKnobs()) -> None:
        self.knobs = knobs
        self.recent_work = RecentWork(knobs.work_half_life_tokens)
        half_life = knobs.hot_half_life_requests
        self.demand = PrefixDemand(half_life) if half_life > 0 else None
        # the last decision: why, among how many, the first replicas ranked and their costs
        self._last: tuple[str, int, list[str], list[int]] = ("", 0, [], [])

    def costs(self, request: RoutingRequest, replicas: ReplicaTable) -> dict[str, int]:
        """Each replica's cost for this request, in prefill tokens: a token it would pull
        from another replica costs the pull's price, not a prefill."""
        table = ReplicaTable.of(replicas)  # a list of states (a test's) as a table
        return dict(zip(table.ids, self.cost_column(request, table).tolist(), strict=True))

    def cost_column(self, request: RoutingRequest, table: ReplicaTable) -> np.ndarray:
        costs = self._booked(table) + (request.num_prompt_tokens - cache_credits(request, table))
        pulled, stored = self._pull_saving(request, table), self._store_saving(request, table)
        if isinstance(pulled, np.ndarray) or isinstance(stored, np.ndarray):
            costs -= np.maximum(pulled, stored)
        return costs

    def _booked(self, table: ReplicaTable) -> np.ndarray:
        """What each replica has to run already: the prefill booked on it, and
        ``decode_cost_tokens`` per request it runs."""
        return table.column("prefill_tokens") + self.knobs.decode_cost_tokens * table.column(
            "in_flight"
        )

    def _pull_saving(self, request: RoutingRequest, table: ReplicaTable) -> np.ndarray | int:
        """Prefill tokens a pull saves each replica for this request, net of its price."""
        pull = self.knobs.pull
        if pull is None or not pull.enabled:
            return 0
        tokens = pulled_token_column(request, table, pull.min_blocks)
        return np.maximum(0, tokens - pull_prices(pull, tokens))

    def _store_saving(self, request: RoutingRequest, table: ReplicaTable) -> np.ndarray | int:
        """Prefill tokens a restore from its node's store saves each replica, net of its
        price (``kvindex.stored``)."""
        store = self.knobs.store
        if store is None or not store.enabled:
            return 0
        tokens = stored_token_column(request, table)
        return tokens - restore_prices(store, tokens)

    def rank(self, request: RoutingRequest, replicas: ReplicaTable) -> Sequence[str]:
        if not replicas:
            return []
        table = ReplicaTable.of(replicas)  # a list of states (a test's) as a table
        costs = self.cost_column(request, table)
        held = table.held
        most = held.max()
        weights = rendezvous_weights(tie_key(request, int(most)), table)
        by_cost = cost_order(costs, weights)  # cost, then rendezvous order
        credits = cache_credits(request, table)
        kept = self._kept_blocks(table, held)
        # keeps the most; among those the cheapest, then rendezvous: the first in by_cost
        holder = int(by_cost[np.argmax(kept[by_cost] == kept.max())])
        kept_tokens = min(int(kept[holder]) * request.block_size, request.usable_tokens)
        if kept_tokens >= max(
            request.block_size, self.knobs.min_hit_fraction * request.usable_tokens
        ):
            sticky = costs[holder] <= costs[by_cost[0]] + self.knobs.sticky_budget_tokens
            choice = holder if sticky else int(by_cost[0])
            reason = "sticky" if sticky else "spill"
            copy = self._hot_copy(request, table, kept, holder, weights) if sticky else None
            if copy is not None:
                choice, reason = copy, "hot"
        else:
            load = costs + credits - lead_credit(request, kept)
            choice = self._new_prefix(request, table, load, weights)
            reason = "new prefix"
        ranked = by_cost
        if by_cost[0] != choice:  # the choice first, then every other replica by cost
            ranked = np.concatenate(([choice], by_cost[by_cost != choice]))
        shown = ranked[:EXPLAINED]
        names = table.id_array[shown].tolist()
        self._last = (reason, len(table), names, costs[shown].tolist())
        return Ranking(table.id_array, ranked)

    def on_routed(
        self, request: RoutingRequest, replica_id: str, work_tokens: int = 0, replicas: int = 1
    ) -> None:
        self.recent_work.record(replica_id, work_tokens, replicas)
        if self.demand is not None:
            self.demand.record(request.block_hashes)

    def _hot_copy(
        self,
        request: RoutingRequest,
        table: ReplicaTable,
        kept: np.ndarray,
        holder: int,
        weights: np.ndarray,
    ) -> int | None:
        """The replica to copy a hot prefix onto, or None: the least loaded replica, when
        it holds less of the prompt than the holder and is less loaded, and the prefix the
        holder keeps (its run's last block) is shared by more of the recent requests than
        its holders' part of the fleet (share x replicas > holders).

        Load here is what the replica has to run, without this request's prompt: the
        recompute is paid once, then both copies share the prefix's demand."""
        if self.demand is None:
            return None
        holders = int(np.count_nonzero(kept >= kept[holder]))
        share = self.demand.share(request.block_hashes[int(kept[holder]) - 1])
        if share * len(table) <= holders:
            return None
        load = self._booked(table)
        best = int(cheapest(load, weights))
        return best if kept[best] < kept[holder] and load[best] < load[holder] else None

    def _kept_blocks(self, table: ReplicaTable, held: np.ndarray) -> np.ndarray:
        """Leading blocks each replica has without recomputing or calling another replica:
        what it holds, and with node stores what it restores from its node's. A prefix its
        node's store keeps is as much a replica's as one in its pool, so among a node's
        replicas the holder is the cheapest, not the one that last computed it."""
        store = self.knobs.store
        if store is None or not store.enabled:
            return held
        return np.maximum(held, table.column("stored_blocks"))

    def _new_prefix(
        self,
        request: RoutingRequest,
        table: ReplicaTable,
        load: np.ndarray,
        weights: np.ndarray,
    ) -> int:
        """The replica that did the least recent work among the near-cheapest ones
        (``router.recent_work``: a new prefix brings its later requests with it).

        Cost here is load (``load``: the cost with the cache credit added back, less the
        lead credit): the credit for a held head below ``min_hit_fraction`` (a chat
        template's first blocks, which every replica soon holds) is left out, and so is
        what a pull would save, or with slack 0 the first replica to hold the template
        would win every new tenant while the others sat idle. Only the one replica's lead
        over all others counts: pulling that lead elsewhere would save its prefill but
        keep two copies in pools that are already evicting it.
        """
        load = load + self._pull_saving(request, table)
        slack = self.knobs.new_prefix_slack * request.num_prompt_tokens
        near = np.flatnonzero(load <= load.min() + slack)
        work = self.recent_work.column(table.id_array[near].tolist())
        return int(near[cheapest(work, weights[near])])

    def explain(self) -> str:
        reason, among, ranked, costs = self._last
        if not ranked:
            return self.name
        listed = " ".join(f"{rid}={c}" for rid, c in zip(ranked, costs, strict=True))
        more = f" (+{among - len(ranked)} more)" if among > len(ranked) else ""
        return f"{self.name} {reason}: {ranked[0]} {listed}{more}"
