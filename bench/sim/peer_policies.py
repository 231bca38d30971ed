"""The peers' placement rules, as policies of our simulator (same traces, any scale).

Models of what their code does by default (Ray's ``prefix_aware_router.py``, SGLang's
``cache_aware.rs``, Dynamo's KV router), at our block granularity where they match text: a
replica "holds" what was routed to it (their trees are filled at routing time, from prompts),
not what its cache holds.

* ``ray_prefix_sim``: Ray Serve's ``PrefixCacheAffinityRouter``. A match covering at least
  ``match_rate_threshold`` of the prompt goes to the least loaded of the best-matching
  replicas, and waits for them when they are full; otherwise to the replica with the least
  prompt text routed to it so far. ``imbalanced_threshold`` (default: infinite, so never)
  falls back to the least loaded of all when loads differ by more than it.
* ``sglang_cache_aware``: SGLang's model gateway (current defaults: cache threshold 0.5,
  balance 32 absolute and 1.1 relative). A match above the threshold goes to the least
  loaded matching worker unless that one is over both balance limits (then to the least
  loaded worker, which now holds the prefix too); a miss goes to the least loaded.
* ``dynamo_kv``: NVIDIA Dynamo's KV router default cost, ``max(0, (active prefill tokens +
  prompt tokens) / block - overlap blocks) + active decode blocks``, from published and
  predicted blocks, lowest cost first.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from kvindex.records import ReplicaState, ReplicaTable, RoutingRequest, leading_runs
from router.policies import RoutingPolicy, rendezvous_order


class RoutedPrefixes:
    """What a text-tree router knows: the block hashes it routed to each replica."""

    def __init__(self) -> None:
        self.by_block: dict[bytes, set[str]] = {}
        self.sizes: dict[str, int] = {}

    def add(self, request: RoutingRequest, replica_id: str) -> None:
        for h in request.block_hashes:
            holders = self.by_block.setdefault(h, set())
            if replica_id not in holders:
                holders.add(replica_id)
                self.sizes[replica_id] = self.sizes.get(replica_id, 0) + 1

    def matches(self, request: RoutingRequest, replica_ids: Iterable[str]) -> dict[str, int]:
        """Leading prompt blocks already routed to each replica."""
        return leading_runs(request.block_hashes, replica_ids, lambda h: self.by_block.get(h, ()))

    def size(self, replica_id: str) -> int:
        return self.sizes.get(replica_id, 0)


class _TextTreePolicy(RoutingPolicy):
    """A router that matches prompts against what it routed (Ray's and SGLang's trees)."""

    def __init__(self) -> None:
        self.prefixes = RoutedPrefixes()

    def on_routed(
        self, request: RoutingRequest, replica_id: str, work_tokens: int = 0, replicas: int = 1
    ) -> None:
        self.prefixes.add(request, replica_id)

    def loads_and_matches(
        self, request: RoutingRequest, replicas: ReplicaTable
    ) -> tuple[dict[str, int], list[str], dict[str, int]]:
        """In-flight loads, replicas least loaded first, and each one's matched blocks."""
        loads = {r.replica_id: r.in_flight for r in replicas}
        by_load = sorted(loads, key=lambda rid: (loads[rid], rid))
        matches = self.prefixes.matches(request, loads)
        return loads, by_load, matches


class RayPrefixSim(_TextTreePolicy):
    name = "ray_prefix_sim"

    def __init__(
        self, match_rate_threshold: float = 0.1, imbalanced_threshold: float = math.inf
    ) -> None:
        super().__init__()
        self.match_rate_threshold = match_rate_threshold
        self.imbalanced_threshold = imbalanced_threshold

    def rank(self, request: RoutingRequest, replicas: ReplicaTable) -> list[str]:
        loads, by_load, matches = self.loads_and_matches(request, replicas)
        if max(loads.values()) - min(loads.values()) > self.imbalanced_threshold:
            return by_load
        best = max(matches.values())
        rate = best * request.block_size / max(request.num_prompt_tokens, 1)
        if best and rate >= self.match_rate_threshold:
            return [rid for rid in by_load if matches[rid] == best]  # waits for these
        smallest = min(self.prefixes.size(rid) for rid in loads)
        return [rid for rid in by_load if self.prefixes.size(rid) == smallest]


class SGLangCacheAware(_TextTreePolicy):
    name = "sglang_cache_aware"

    def __init__(
        self, cache_threshold: float = 0.5, balance_abs: int = 32, balance_rel: float = 1.1
    ) -> None:
        super().__init__()
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel

    def rank(self, request: RoutingRequest, replicas: ReplicaTable) -> list[str]:
        loads, by_load, matches = self.loads_and_matches(request, replicas)
        best = max(matches.values())
        rate = best * request.block_size / max(request.num_prompt_tokens, 1)
        if not best or rate <= self.cache_threshold:
            return by_load
        choice = next(rid for rid in by_load if matches[rid] == best)
        avg = sum(loads.values()) / len(loads)
        load = loads[choice]
        if load > self.balance_rel * avg and load > avg + self.balance_abs:
            choice = by_load[0]  # spill; the router inserts the prefix there too
        return [choice] + [rid for rid in by_load if rid != choice]


class DynamoKV(RoutingPolicy):
    name = "dynamo_kv"
    uses_index = True

    def rank(self, request: RoutingRequest, replicas: ReplicaTable) -> list[str]:
        bs = request.block_size

        def cost(r: ReplicaState) -> float:
            raw = (r.prefill_tokens + request.num_prompt_tokens) / bs
            return max(0.0, raw - r.held_blocks) + r.decode_blocks

        order = rendezvous_order(request.affinity_key, [r.replica_id for r in replicas])
        position = {rid: i for i, rid in enumerate(order)}
        ranked = sorted(replicas, key=lambda r: (cost(r), position[r.replica_id]))
        return [r.replica_id for r in ranked]
