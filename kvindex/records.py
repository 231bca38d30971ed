"""The records routers and the index exchange (plain data, no I/O), and the one rule for
reading a chain against holders.

``RoutingRequest`` is what a router may know about a request; ``ReplicaState`` is what it
knows about a replica for that request (the index's answer, with the router's own bookings
added); ``Booking`` is what a router books on the replica it chose.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, overload

import numpy as np


@dataclass(frozen=True)
class RoutingRequest:
    """A request as a router sees it: its prompt's block hash chain and sizes, no text."""

    request_id: str
    block_hashes: Sequence[bytes]  # full prompt blocks (kvindex.hashing)
    affinity_key: bytes  # BlockHasher.affinity_key: the first K blocks (or the partial block)
    num_prompt_tokens: int
    block_size: int
    max_tokens: int = 0

    @property
    def usable_tokens(self) -> int:
        """The most prompt tokens a cache can serve: at least one token always runs."""
        return (self.num_prompt_tokens - 1) // self.block_size * self.block_size

    @property
    def decode_blocks(self) -> int:
        """The KV blocks the request holds at most (its prompt and every output token)."""
        return -(-(self.num_prompt_tokens + self.max_tokens) // self.block_size)


@dataclass(frozen=True)
class Load:
    """The load booked on one replica, spelled the same from Redis (``kvindex.scripts``'
    ``loads`` hash fields, ``<replica>:<field>``) to the mirror, the shares and
    ``ReplicaState``: the uncached prompt tokens booked and not yet computed, the requests
    booked and not finished, the KV blocks those requests hold or will."""

    prefill_tokens: int = 0
    in_flight: int = 0
    decode_blocks: int = 0

    def __add__(self, other: Load) -> Load:
        return Load(
            self.prefill_tokens + other.prefill_tokens,
            self.in_flight + other.in_flight,
            self.decode_blocks + other.decode_blocks,
        )

    def __sub__(self, other: Load) -> Load:
        return Load(
            self.prefill_tokens - other.prefill_tokens,
            self.in_flight - other.in_flight,
            self.decode_blocks - other.decode_blocks,
        )


LOAD_FIELDS = tuple(f.name for f in fields(Load))  # the triple's one order, everywhere


@dataclass(frozen=True)
class ReplicaState:
    """A live replica as a router sees it now, for one request.

    Load comes from the routers' bookings (what they sent and has not finished), never from
    polled stats, so it is never a stats period late. ``cached_blocks`` is what the replica
    has published (None: the index did not answer); ``predicted_blocks`` what routers just
    sent there and it will publish soon.
    """

    replica_id: str
    in_flight: int = 0  # requests booked on it and not finished (``Load``)
    prefill_tokens: int = 0  # uncached prompt tokens booked on it, not yet computed
    decode_blocks: int = 0  # KV blocks its booked requests hold or will
    cached_blocks: int | None = None  # leading blocks of the chain it has published
    predicted_blocks: int = 0  # leading blocks recent decisions booked to it (short TTL)
    footprint_blocks: int = 0  # distinct blocks it has published (its share of the cache)
    pullable_blocks: int = 0  # leading blocks another replica has published (kvindex.pulls)
    stored_blocks: int = 0  # leading blocks its node's store holds (replica.store)

    @property
    def held_blocks(self) -> int:
        """Leading blocks it holds or will hold shortly (published, or predicted)."""
        return max(self.cached_blocks or 0, self.predicted_blocks)


STORE_PREFIX = "store-"


def store_id(node_id: str) -> str:
    """The index entry of a node's store (``replica.store``): published like a replica's,
    never a replica (no router sends it requests, no replica pulls from it)."""
    return f"{STORE_PREFIX}{node_id}"


def is_store(entry_id: str) -> bool:
    return entry_id.startswith(STORE_PREFIX)


@dataclass(frozen=True)
class Booking:
    """One routed request, as a router books it on its replica."""

    replica_id: str
    request_id: str
    prefill_tokens: int  # the prompt tokens the replica is predicted to compute
    decode_blocks: int  # the KV blocks the request will hold (prompt and output)
    block_hashes: Sequence[bytes]  # its prompt's chain: predicted to be held there soon


def leading_runs(
    chain: Sequence[bytes],
    replica_ids: Iterable[str],
    holders: Callable[[bytes], Collection[str]],
) -> dict[str, int]:
    """How many leading blocks of ``chain`` each replica holds: a replica's run ends at its
    first block it does not hold (the index's query, the simulator's index, a router's
    record of its routes and the peers' models all read a chain this way)."""
    runs = dict.fromkeys(replica_ids, len(chain))
    alive = set(runs)
    for i, block in enumerate(chain):
        if not alive:
            break
        held = holders(block)
        for rid in [r for r in alive if r not in held]:
            runs[rid] = i
            alive.discard(rid)
    return runs


COLUMNS = tuple(f.name for f in fields(ReplicaState) if f.name != "replica_id")


class ReplicaTable(Sequence[ReplicaState]):
    """Replicas' states for one request as numpy columns (``COLUMNS``, int64), so a router can
    rank a thousand replicas without a thousand objects; also a sequence of ``ReplicaState``
    for policies that read states one by one.

    It is the one shape of the index's answer (Redis's, a mirror's, the simulator's: every
    live entry's state for one chain, node stores' entries among them) and of what a policy
    ranks. Built from columns (the index mirror's answer) or from states (lazily turned into
    columns, and back only where asked). ``known`` False: the index did not answer (every
    ``cached_blocks`` is None). ``id_hashes`` (optional) are the ids' rendezvous hashes
    (``kvindex.hashing.id_hash``), carried so a ranking need not hash every id again.
    """

    def __init__(
        self,
        ids: Sequence[str],
        columns: Mapping[str, np.ndarray] | None = None,
        known: bool = True,
        states: Sequence[ReplicaState] | None = None,
        id_hashes: np.ndarray | None = None,
        id_array: np.ndarray | None = None,
        positions: dict[str, int] | None = None,
    ) -> None:
        self.ids = ids if isinstance(ids, list) else list(ids)  # never changed in place
        self._id_array = id_array
        self.known = known
        self._columns = dict(columns) if columns is not None else None
        self._states = list(states) if states is not None else None
        self.id_hashes = id_hashes
        self._positions = positions  # id -> index (a mirror passes the one it keeps)
        self._derived: dict[Hashable, np.ndarray] = {}
        assert self._columns is not None or self._states is not None

    @classmethod
    def of(cls, states: Sequence[ReplicaState]) -> ReplicaTable:
        """``states`` as a table (itself when it is one)."""
        if isinstance(states, ReplicaTable):
            return states
        states = list(states)
        known = any(s.cached_blocks is not None for s in states) or not states
        return cls([s.replica_id for s in states], known=known, states=states)

    def column(self, name: str) -> np.ndarray:
        if self._columns is None:
            self._columns = {
                c: np.array([getattr(s, c) or 0 for s in self._states or ()], np.int64)
                for c in COLUMNS
            }
        return self._columns[name]

    def derived(self, key: Hashable, compute: Callable[[], np.ndarray]) -> np.ndarray:
        """A column computed from this table's (``compute()``), once per ``key``: a decision
        reads the same credits three times. Like every column, never changed in place."""
        if key not in self._derived:
            self._derived[key] = compute()
        return self._derived[key]

    @property
    def held(self) -> np.ndarray:
        """``ReplicaState.held_blocks`` of each (computed once: the columns never change)."""
        return self.derived(
            "held",
            lambda: np.maximum(self.column("cached_blocks"), self.column("predicted_blocks")),
        )

    def with_columns(self, **columns: np.ndarray) -> ReplicaTable:
        """A copy with some columns replaced (its states are built anew where asked)."""
        merged = {c: self.column(c) for c in COLUMNS} | columns
        return ReplicaTable(
            self.ids,
            merged,
            self.known,
            id_hashes=self.id_hashes,
            id_array=self._id_array,
            positions=self._positions,
        )

    def take(self, ids: Sequence[str]) -> ReplicaTable:
        """The table for ``ids``; an id it lacks gets zeros. The same replicas in another
        order are this table as it is (every ranking breaks ties by rendezvous weights,
        never by list order, so the order of the candidates changes no decision)."""
        if ids is self.ids or (len(ids) == len(self.ids) and set(ids) == self.positions.keys()):
            return self
        where = self.positions
        pos = np.array([where.get(rid, -1) for rid in ids], np.int64)
        have = pos >= 0
        if not have.any():  # none known (an empty table has no row to gather from)
            columns = {c: np.zeros(len(ids), self.column(c).dtype) for c in COLUMNS}
        else:
            columns = {c: np.where(have, self.column(c)[np.maximum(pos, 0)], 0) for c in COLUMNS}
        hashes = None
        if self.id_hashes is not None and have.all():
            hashes = self.id_hashes[pos]
        return ReplicaTable(ids, columns, self.known, id_hashes=hashes)

    @property
    def id_array(self) -> np.ndarray:
        """The ids as a numpy object array (a ranking's order picks them at once)."""
        if self._id_array is None:
            self._id_array = np.array(self.ids, dtype=object)
        return self._id_array

    def as_dict(self) -> dict[str, ReplicaState]:
        """Entry id -> state (two answers hold the same when these are equal)."""
        return {state.replica_id: state for state in self}

    def state_of(self, rid: str) -> ReplicaState | None:
        """``rid``'s state (None: not in the table)."""
        k = self.position(rid)
        return None if k is None else self[k]

    def position(self, rid: str) -> int | None:
        """Where ``rid`` is (None: not in the table), without building ``positions``."""
        if self._positions is not None:
            return self._positions.get(rid)
        try:
            return self.ids.index(rid)
        except ValueError:
            return None

    @property
    def positions(self) -> dict[str, int]:
        if self._positions is None:
            self._positions = {rid: i for i, rid in enumerate(self.ids)}
        return self._positions

    def __len__(self) -> int:
        return len(self.ids)

    @overload
    def __getitem__(self, i: int) -> ReplicaState: ...
    @overload
    def __getitem__(self, i: slice) -> list[ReplicaState]: ...
    def __getitem__(self, i: Any) -> Any:
        if self._states is None:
            self._states = [self._state(k) for k in range(len(self.ids))]
        return self._states[i]

    def __iter__(self) -> Iterator[ReplicaState]:
        return iter(self[:])

    def _state(self, k: int) -> ReplicaState:
        values = {c: int(self.column(c)[k]) for c in COLUMNS}
        if not self.known:
            values["cached_blocks"] = None
        return ReplicaState(self.ids[k], **values)
