"""Routing policies as plain Python, called through ``router.core`` by the Ray Serve router
and by the simulator alike.

A policy ranks the live replicas for one request, best first. The caller tries them in that
order, so a full first choice spills over to the next instead of queueing forever; a policy
that leaves replicas out (a peer that waits for its affine replica) makes the request wait
for one it listed.
"""

from __future__ import annotations

import abc
import bisect
import functools
import hashlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from kvindex.hashing import id_hash
from kvindex.records import ReplicaState, ReplicaTable, RoutingRequest


def cache_credits(request: RoutingRequest, replicas: ReplicaTable) -> np.ndarray:
    """Prompt tokens each replica will not have to compute: what it holds or will hold of
    the chain (published or predicted), capped because at least one token always runs."""
    return replicas.derived(
        ("credits", request.block_size, request.usable_tokens),
        lambda: np.minimum(replicas.held * request.block_size, request.usable_tokens),
    )


class Ranking(Sequence[str]):
    """Replica ids best first, read from a ranking's order (``ids[order]``) only as far as
    the caller reads: a router tries the first and rarely needs the thousandth, so a
    thousand ids are not copied into a list per decision. Equal to any sequence of the
    same ids in the same order."""

    def __init__(self, ids: np.ndarray, order: np.ndarray) -> None:
        self._ids, self._order = ids, order

    def __len__(self) -> int:
        return int(self._order.size)

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return self._ids[self._order[i]].tolist()
        return self._ids[self._order[i]]

    def __iter__(self) -> Iterator[str]:
        for k in self._order[:EAGER].tolist():  # most callers stop at the first
            yield self._ids[k]
        if self._order.size > EAGER:
            yield from self._ids[self._order[EAGER:]].tolist()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(other) == len(self) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"Ranking({list(self)!r})"


EAGER = 4  # ids a ranking's iteration reads one by one before copying the rest at once


class RoutingPolicy(abc.ABC):
    """Ranks replicas for a request; ``explain`` says why the last one went where it did."""

    name: str
    uses_index = False  # whether ``rank`` reads the cache fields (the caller then asks)

    def on_routed(  # noqa: B027
        self, request: RoutingRequest, replica_id: str, work_tokens: int = 0, replicas: int = 1
    ) -> None:
        """The request ranked last went to ``replica_id`` (not always the first choice), to
        run ``work_tokens`` there (uncached prompt and output), one of ``replicas``."""

    @abc.abstractmethod
    def rank(self, request: RoutingRequest, replicas: ReplicaTable) -> Sequence[str]:
        """Replica ids, the preferred first (usually every replica once)."""

    def explain(self) -> str:
        """A line about the last decision, for a debug header or log."""
        return self.name


def rendezvous_weights(key: bytes, replicas: Sequence[str] | ReplicaTable) -> np.ndarray:
    """Each replica's highest-random-weight for a key (uint64; the highest goes first).

    Stable across processes (BLAKE2b, never ``hash()``): the key and each replica id are
    hashed once (an index mirror's answer carries the ids' hashes), then mixed per pair by
    splitmix64's finalizer, so a thousand weights cost a few array operations. Adding or
    removing one of N replicas moves only the keys whose first choice it is or becomes:
    about 1/N of them.
    """
    if isinstance(replicas, ReplicaTable):  # the table's own, else computed once and kept
        table = replicas
        ids_hash = table.id_hashes
        if ids_hash is None:
            ids_hash = table.derived("id_hashes", lambda: _id_hashes(table.ids))
    else:
        ids_hash = _id_hashes(replicas)
    x = ids_hash ^ np.uint64(id_hash(key))  # a new array: the steps below work in place
    shifted = np.empty_like(x)
    with np.errstate(over="ignore"):
        for shift, factor in _SPLITMIX:
            x ^= np.right_shift(x, shift, out=shifted)
            np.multiply(x, factor, out=x)
    x ^= np.right_shift(x, np.uint64(31), out=shifted)
    return x


def cost_order(costs: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """``np.lexsort((~weights, costs))``: cheapest first, equal costs in rendezvous order
    (highest weight first), equal weights by position.

    One ``np.sort`` of one uint64 key where it can be: the cost less the cheapest in the high
    bits, the inverted weight's high bits below, the position in the low bits (so the sorted
    keys are the order; numpy sorts integers with SIMD, an argsort or a lexsort's two sorts
    cost three times as long, and this sort is the biggest step of a decision among a
    thousand replicas). Where two keys share cost and weight bits (rare) or costs span so
    much that fewer than ``MIN_WEIGHT_BITS`` of the weights fit, the lexsort itself, so the
    order is always the lexsort's."""
    n = costs.size
    if n < 2:
        return np.zeros(n, np.int64)
    low = costs.min()
    position_bits = (n - 1).bit_length()
    weight_bits = 64 - position_bits - int(costs.max() - low).bit_length()
    if weight_bits >= MIN_WEIGHT_BITS:
        key = (costs - low).astype(np.uint64) << np.uint64(weight_bits + position_bits)
        key |= (~weights >> np.uint64(64 - weight_bits)) << np.uint64(position_bits)
        key |= _positions(n)
        key.sort()
        ranked = key >> np.uint64(position_bits)
        if not (ranked[1:] == ranked[:-1]).any():  # no two alike: the order is total
            return (key & np.uint64((1 << position_bits) - 1)).astype(np.int64)
    return np.lexsort((~weights, costs))


MIN_WEIGHT_BITS = 24  # fewer, and weights alike in them (a fallback) would be common


@functools.lru_cache(maxsize=8)
def _positions(n: int) -> np.ndarray:
    """0..n-1 as uint64 (a decision's candidates are the same thousand most of the time)."""
    positions = np.arange(n, dtype=np.uint64)
    positions.flags.writeable = False
    return positions


def cheapest(costs: np.ndarray, weights: np.ndarray) -> int:
    """``cost_order(costs, weights)[0]`` without ordering the rest: the cheapest, then the
    highest weight, then the first."""
    tied = np.flatnonzero(costs == costs.min())
    return int(tied[np.argmax(weights[tied])])


_SPLITMIX = (
    (np.uint64(30), np.uint64(0xBF58476D1CE4E5B9)),
    (np.uint64(27), np.uint64(0x94D049BB133111EB)),
)


def _id_hashes(ids: Sequence[str]) -> np.ndarray:
    return np.array([_cached_id_hash(rid) for rid in ids], np.uint64)


@functools.lru_cache(maxsize=65536)
def _cached_id_hash(replica_id: str) -> int:
    return id_hash(replica_id)


def rendezvous_order(key: bytes, replica_ids: Sequence[str]) -> list[str]:
    """Highest-random-weight order of replicas for a key, one BLAKE2b per (key, replica):
    the order ``prefix_affinity``, ``cache_aware`` and the simulator's peers have always
    used (pinned by a test: a change would move their keys during a rolling upgrade).
    ``prefill_cost`` ranks by ``rendezvous_weights`` instead, which costs a few array
    operations for a thousand replicas rather than a thousand hashes."""

    def weight(rid: str) -> bytes:
        return hashlib.blake2b(key + b"\x00" + rid.encode(), digest_size=8).digest()

    return sorted(replica_ids, key=weight, reverse=True)


@dataclass(frozen=True)
class BoundedLoad:
    """Consistent hashing with bounded loads: a replica may take one more request while its
    in-flight count, the new request included, stays within ``ceil((1 + epsilon) x mean)``.
    A hot key fills its replica to that bound, then spills to its next choice."""

    epsilon: float = 0.25

    def overloaded(self, replicas: ReplicaTable) -> set[str]:
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

    def on_routed(
        self, request: RoutingRequest, replica_id: str, work_tokens: int = 0, replicas: int = 1
    ) -> None:
        self._last = replica_id

    def rank(self, request: RoutingRequest, replicas: ReplicaTable) -> list[str]:
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

    def rank(self, request: RoutingRequest, replicas: ReplicaTable) -> list[str]:
        order = rendezvous_order(request.affinity_key, [r.replica_id for r in replicas])
        full = self.bound.overloaded(replicas)
        return [r for r in order if r not in full] + [r for r in order if r in full]


class CacheAware(RoutingPolicy):
    """The previous default: lowest ``uncached prompt tokens + load_cost_tokens x in
    flight``, replicas over the bounded-load cap last, ties in rendezvous order; below
    ``min_cached_fraction`` held anywhere (or with the index unknown) it is
    ``PrefixAffinity``. Kept as a baseline for ``prefill_cost``."""

    name = "cache_aware"
    uses_index = True

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

    def rank(self, request: RoutingRequest, replicas: ReplicaTable) -> list[str]:
        base = self.affinity.rank(request, replicas)
        if all(r.cached_blocks is None for r in replicas):
            return base
        usable = request.usable_tokens

        def credit(r: ReplicaState) -> int:
            return min((r.cached_blocks or 0) * request.block_size, usable)

        best = max((credit(r) for r in replicas), default=0)
        if best == 0 or best < self.min_cached_fraction * request.num_prompt_tokens:
            return base
        position = {rid: i for i, rid in enumerate(base)}
        full = self.bound.overloaded(replicas)

        def cost(r: ReplicaState) -> tuple[bool, int, int]:
            work = request.num_prompt_tokens - credit(r) + self.load_cost_tokens * r.in_flight
            return r.replica_id in full, work, position[r.replica_id]

        return [r.replica_id for r in sorted(replicas, key=cost)]
