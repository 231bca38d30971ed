"""Routing policies as plain Python: used by the Ray Serve router and by the simulator.

A policy ranks the live replicas for one request, best first. The caller tries them in that
order, so a full first choice spills over to the next instead of queueing forever.
"""

from __future__ import annotations

import abc
import bisect
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RoutingRequest:
    """What a policy may know about a request: its block hash chain, nothing else."""

    block_hashes: Sequence[bytes]  # full prompt blocks, from replica.hashing
    affinity_key: bytes  # BlockHasher.affinity_key: the first K blocks (or the partial block)
    num_prompt_tokens: int
    block_size: int


@dataclass(frozen=True)
class ReplicaLoad:
    """A live replica and its load as the router sees it, now: requests routed to it and
    not finished. (Replicas also report queued prefill tokens and free blocks, but those
    reach the router a stats period late, and a stale queue misroutes: see README.)"""

    replica_id: str
    in_flight: int = 0


class RoutingPolicy(abc.ABC):
    """Ranks replicas for a request. ``index_answer`` maps replica id to the number of
    leading blocks of the request's chain it holds, or is None when the index is unknown."""

    name: str

    def on_routed(self, replica_id: str) -> None:  # noqa: B027 (optional hook)
        """The request ranked last went to ``replica_id`` (not always the first choice)."""

    @abc.abstractmethod
    def rank(
        self,
        request: RoutingRequest,
        replicas: Sequence[ReplicaLoad],
        index_answer: Mapping[str, int] | None = None,
    ) -> list[str]:
        """Every replica id exactly once, the preferred first."""


def rendezvous_order(key: bytes, replica_ids: Sequence[str]) -> list[str]:
    """Highest-random-weight order of replicas for a key.

    Stable across processes (BLAKE2b, never ``hash()``). Adding or removing one of N
    replicas moves only the keys whose first choice it is or becomes: about 1/N of them.
    """

    def weight(rid: str) -> bytes:
        return hashlib.blake2b(key + b"\x00" + rid.encode(), digest_size=8).digest()

    return sorted(replica_ids, key=weight, reverse=True)


@dataclass(frozen=True)
class BoundedLoad:
    """Consistent hashing with bounded loads: a replica may take one more request while its
    in-flight count, the new request included, stays within ``ceil((1 + epsilon) x mean)``.
    A hot key fills its replica to that bound, then spills to its next choice."""

    epsilon: float = 0.25

    def overloaded(self, replicas: Sequence[ReplicaLoad]) -> set[str]:
        if not replicas:
            return set()
        mean = (sum(r.in_flight for r in replicas) + 1) / len(replicas)
        capacity = math.ceil((1 + self.epsilon) * mean)
        return {r.replica_id for r in replicas if r.in_flight + 1 > capacity}


class RoundRobin(RoutingPolicy):
    """The baseline: each request to the replica after the one the last request went to.

    It advances on placements (``on_routed``), not on rankings, so a caller that asks twice
    for one request, or spills it over, does not skip a replica.
    """

    name = "round_robin"

    def __init__(self) -> None:
        self._last = ""

    def on_routed(self, replica_id: str) -> None:
        self._last = replica_id

    def rank(
        self,
        request: RoutingRequest,
        replicas: Sequence[ReplicaLoad],
        index_answer: Mapping[str, int] | None = None,
    ) -> list[str]:
        ids = sorted(r.replica_id for r in replicas)
        start = bisect.bisect_right(ids, self._last) % len(ids) if ids else 0
        return ids[start:] + ids[:start]


class PrefixAffinity(RoutingPolicy):
    """Rendezvous hashing on the first K prompt blocks, with bounded load.

    Requests that share their first K blocks (a system prompt) go to the same replica unless
    it is over the load bound; then to the next in rendezvous order, so one hot prompt
    spreads over a stable, small set of replicas instead of swamping one.
    """

    name = "prefix_affinity"

    def __init__(self, bound: BoundedLoad = BoundedLoad()) -> None:
        self.bound = bound

    def rank(
        self,
        request: RoutingRequest,
        replicas: Sequence[ReplicaLoad],
        index_answer: Mapping[str, int] | None = None,
    ) -> list[str]:
        order = rendezvous_order(request.affinity_key, [r.replica_id for r in replicas])
        full = self.bound.overloaded(replicas)
        return [r for r in order if r not in full] + [r for r in order if r in full]


class CacheAware(RoutingPolicy):
    """Lowest estimated cost, where cost = prefill tokens left after the cache credit plus
    queued work, from the index's answer of how much of this prompt each replica holds.

    Queued work is ``load_cost_tokens`` per request in flight on the replica. Replicas over
    the bounded-load cap go last; ties follow rendezvous order.

    The cache is only worth steering for when it holds a real part of the prompt: if no
    replica holds at least ``min_cached_fraction`` of it (a new prompt that shares only a chat
    template's first blocks, say), or the index is unknown, this is ``PrefixAffinity``, which
    spreads distinct prompts and lands the followers of a new prompt together.
    """

    name = "cache_aware"

    def __init__(
        self,
        bound: BoundedLoad = BoundedLoad(),
        load_cost_tokens: int = 256,
        min_cached_fraction: float = 0.5,
    ) -> None:
        self.affinity = PrefixAffinity(bound)
        self.bound = bound
        self.load_cost_tokens = load_cost_tokens
        self.min_cached_fraction = min_cached_fraction

    def rank(
        self,
        request: RoutingRequest,
        replicas: Sequence[ReplicaLoad],
        index_answer: Mapping[str, int] | None = None,
    ) -> list[str]:
        base = self.affinity.rank(request, replicas)
        if not index_answer:
            return base
        usable = (request.num_prompt_tokens - 1) // request.block_size * request.block_size

        def credit(r: ReplicaLoad) -> int:
            return min(index_answer.get(r.replica_id, 0) * request.block_size, usable)

        best = max((credit(r) for r in replicas), default=0)
        if best == 0 or best < self.min_cached_fraction * request.num_prompt_tokens:
            return base
        position = {rid: i for i, rid in enumerate(base)}
        full = self.bound.overloaded(replicas)

        def cost(r: ReplicaLoad) -> tuple[bool, int, int]:
            cached = credit(r)
            work = request.num_prompt_tokens - cached + self.load_cost_tokens * r.in_flight
            return r.replica_id in full, work, position[r.replica_id]

        return [r.replica_id for r in sorted(replicas, key=cost)]


def make_policy(
    name: str,
    bound: BoundedLoad = BoundedLoad(),
    load_cost_tokens: int = 256,
    min_cached_fraction: float = 0.5,
) -> RoutingPolicy:
    if name == "round_robin":
        return RoundRobin()
    if name == "prefix_affinity":
        return PrefixAffinity(bound)
    if name == "cache_aware":
        return CacheAware(bound, load_cost_tokens, min_cached_fraction)
    raise ValueError(f"unknown routing policy {name!r}")
