"""What an index mirror holds, and its answer: plain data, no I/O (``kvindex.mirror`` feeds
it from Redis; tests feed it directly).

Sized for a thousand replicas: which replicas hold each block is a ``HolderTable`` (numpy,
~13 bytes per replica and block), and loads, footprints and shared bookings are numpy rows
per replica *slot*, so an answer is a ``ReplicaTable`` built by a few array operations, not
one object per replica.

Invariants (``check``): the holder table's own; a replica's footprint is the number of
blocks the table says it holds; every replica with blocks, loads or predictions has a slot;
slots are reused only after their replica was purged (so no stale holder can name a new
replica). The answer reads a chain as ``QUERY`` does (``kvindex.scripts``): published runs
and predicted runs walked block by block, footprints, loads, for live replicas only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from kvindex.hashing import id_hash
from kvindex.mirror.holder_table import HolderTable, block_keys
from kvindex.records import COLUMNS, LOAD_FIELDS, ReplicaTable

HASH_BYTES = 16
_IN_FLIGHT = LOAD_FIELDS.index("in_flight")


class MirrorState:
    def __init__(self, own_router: str | None = None) -> None:
        self.seq = 0  # the last event applied
        # routers' shared bookings (``SHARE``): each one's latest, and their sum per slot;
        # this router's own are left out (it adds its own bookings, fresher, itself)
        self.own_router = own_router
        self.shares: dict[str, tuple[float, dict[str, list[int]]]] = {}
        self.shared_in_flight = 0  # the sum of the shared requests, all replicas
        self.epochs: dict[str, str] = {}
        self.holders = HolderTable()
        self.loads = np.zeros((0, 3), np.int64)  # slot -> LOAD_FIELDS
        self.shared = np.zeros((0, 3), np.int64)  # slot -> the other routers' shares, summed
        self.id_hashes = np.zeros(0, np.uint64)  # slot -> id_hash of its replica
        self.predicted: dict[bytes, dict[str, float]] = {}  # block -> replica -> expiry ms
        self.predicted_of: dict[str, set[bytes]] = {}
        self.live: list[str] = []
        self._live_slots: np.ndarray | None = None
        self._live_array: np.ndarray | None = None
        self._live_mask = 0
        self._live_positions: dict[str, int] = {}
        self._live_position = np.zeros(0, np.int64)
        self._slot: dict[str, int] = {}
        self._rid: dict[int, str] = {}
        self._free: list[int] = []

    # --- changes (the log's events) ---

    def apply(self, fields: dict[bytes, bytes]) -> None:
        """One event of the log (``kvindex.lua.EMIT``)."""
        op, rid, a = fields[b"o"], fields[b"r"].decode(), fields[b"a"]
        if op == b"add":
            self.add(rid, _split(a))
        elif op == b"rem":
            self.remove(rid, _split(a))
        elif op == b"load":
            slot = self._slot_of(rid)  # first: a new slot may grow the rows
            self.loads[slot] = [int(v) for v in a.split(b":")]
        elif op == b"pred":
            self.predict(rid, float(a), _split(fields[b"b"]))
        elif op == b"share":
            self.share(rid, a)
        elif op == b"purge":
            self.purge(rid)
        elif op == b"reg":
            self.register(rid, a.decode())
        elif op == b"dereg":
            self.purge(rid)
            self.epochs.pop(rid, None)
            self._release_slot(rid)
        else:
            raise ValueError(f"unknown index event {op!r}")

    def register(self, rid: str, epoch: str) -> None:
        self.epochs[rid] = epoch
        self._slot_of(rid)

    def add(self, rid: str, blocks: Iterable[bytes]) -> None:
        self.holders.add(self._slot_of(rid), block_keys(list(blocks)))

    def remove(self, rid: str, blocks: Iterable[bytes]) -> None:
        """Blocks evicted: neither held nor predicted there any longer (as ``PUBLISH``)."""
        blocks = list(blocks)
        self.holders.remove(self._slot_of(rid), block_keys(blocks))
        mine = self.predicted_of.get(rid)
        if mine:
            for block in blocks:
                if block in mine:
                    mine.discard(block)
                    self._unpredict(block, rid)

    def reserve(self, blocks: int) -> None:
        """Room for ``blocks`` more (a snapshot's next replicas)."""
        self.holders.reserve(blocks)

    def blocks_held(self, rid: str) -> int:
        """The distinct blocks ``rid`` has published (its footprint)."""
        slot = self._slot.get(rid)
        return 0 if slot is None else int(self.holders.count[slot])

    def holds(self, rid: str, block: bytes) -> bool:
        slot = self._slot.get(rid)
        key = int(block_keys([block])[0])
        return slot is not None and slot in self.holders.holders_of(key)

    def predict(self, rid: str, expiry_ms: float, blocks: Iterable[bytes]) -> None:
        self._slot_of(rid)
        mine = self.predicted_of.setdefault(rid, set())
        for block in blocks:
            self.predicted.setdefault(block, {})[rid] = expiry_ms
            mine.add(block)

    def purge(self, rid: str) -> None:
        """Everything of the replica: blocks, predictions, loads (its slot stays)."""
        slot = self._slot_of(rid)
        self.holders.purge(slot)
        for block in self.predicted_of.pop(rid, ()):
            self._unpredict(block, rid)
        self.loads[slot] = 0

    def _unpredict(self, block: bytes, rid: str) -> None:
        by_replica = self.predicted.get(block, {})
        by_replica.pop(rid, None)
        if not by_replica:
            self.predicted.pop(block, None)

    def share(self, router: str, payload: bytes) -> None:
        """A router's shared bookings (``expiry|replica:<LOAD_FIELDS' values>,...``),
        replacing its last ones."""
        if router == self.own_router:
            return
        expiry, _, body = payload.partition(b"|")
        totals = {}
        for item in body.decode().split(",") if body else ():
            rid, *values = item.rsplit(":", 3)
            totals[rid] = [int(v) for v in values]
        self._unshare(router)
        self.shares[router] = (float(expiry), totals)
        for rid, values in totals.items():
            slot = self._slot_of(rid)
            self.shared[slot] += values
            self.shared_in_flight += values[_IN_FLIGHT]

    def expire_shares(self, now_ms: float) -> None:
        for router in [r for r, (expiry, _) in self.shares.items() if expiry <= now_ms]:
            self._unshare(router)

    def _unshare(self, router: str) -> None:
        _, old = self.shares.pop(router, (0.0, {}))
        for rid, values in old.items():
            self.shared[self._slot[rid]] -= values
            self.shared_in_flight -= values[_IN_FLIGHT]

    def set_load_field(self, rid: str, name: str, value: int) -> None:
        slot = self._slot_of(rid)
        self.loads[slot, LOAD_FIELDS.index(name)] = value

    def set_live(self, live: Sequence[str]) -> None:
        self.live = list(live)  # a new list: answers already out keep theirs
        self._live_slots = None

    def expire_predictions(self, now_ms: float) -> None:
        for block in list(self.predicted):
            by_replica = self.predicted[block]
            for rid in [r for r, expiry in by_replica.items() if expiry <= now_ms]:
                del by_replica[rid]
                self.predicted_of.get(rid, set()).discard(block)
            if not by_replica:
                del self.predicted[block]

    # --- the answer ---

    def answer(self, chain: Sequence[bytes], now_ms: float) -> ReplicaTable:
        """Every live replica's state for ``chain``, as ``IndexReader.query`` answers it."""
        if self._live_slots is None:
            self._cache_live()
        slots, position = self._live_slots, self._live_position
        runs = self.holders.leading_runs(block_keys(list(chain)), self._live_mask)
        cached = _run_per_slot(runs, self._live_mask.bit_length())[slots]
        predicted = np.zeros(slots.size, np.int64)
        for rid, run in self._predicted_runs(chain, now_ms).items():
            k = position[self._slot[rid]]
            if k >= 0:
                predicted[k] = run
        # (3, live) rows, each contiguous: one gather, not a row-by-row fancy index
        load = np.take((self.loads + self.shared).T, slots, axis=1)
        columns = dict(zip(LOAD_FIELDS, load, strict=True))
        columns |= {
            "cached_blocks": cached,
            "predicted_blocks": predicted,
            "footprint_blocks": self.holders.count[slots],
            "pullable_blocks": np.zeros(slots.size, np.int64),
            "stored_blocks": np.zeros(slots.size, np.int64),
        }
        assert set(columns) == set(COLUMNS)
        return ReplicaTable(
            self.live,
            columns,
            id_hashes=self.id_hashes[slots],
            id_array=self._live_array,
            positions=self._live_positions,
        )

    def _cache_live(self) -> None:
        """What every answer needs of the live set: slots, their bitmask, each slot's place."""
        slots = np.array([self._slot_of(rid) for rid in self.live], np.int64)
        self._live_array = np.array(self.live, dtype=object)
        self._live_positions = {rid: k for k, rid in enumerate(self.live)}
        bits = np.zeros(int(slots.max(initial=0)) + 8, np.uint8)
        bits[slots] = 1
        self._live_mask = int.from_bytes(np.packbits(bits, bitorder="little").tobytes(), "little")
        self._live_position = np.full(len(self._slot) + len(self._free), -1, np.int64)
        self._live_position[slots] = np.arange(slots.size)
        self._live_slots = slots

    def _predicted_runs(self, chain: Sequence[bytes], now_ms: float) -> dict[str, int]:
        predicted: dict[str, int] = {}
        alive: set[str] | None = None
        for i, block in enumerate(chain):
            by_replica = self.predicted.get(block, {})
            now_there = {
                rid
                for rid, expiry in by_replica.items()
                if expiry > now_ms and (alive is None or rid in alive)
            }
            if not now_there:
                break
            for rid in now_there:
                predicted[rid] = i + 1
            alive = now_there
        return predicted

    # --- slots ---

    def _slot_of(self, rid: str) -> int:
        slot = self._slot.get(rid)
        if slot is None:
            slot = self._free.pop() if self._free else len(self._slot) + len(self._free)
            self._slot[rid], self._rid[slot] = slot, rid
            if slot >= len(self.loads):
                grow = max(64, len(self.loads))
                self.loads = np.concatenate([self.loads, np.zeros((grow, 3), np.int64)])
                self.shared = np.concatenate([self.shared, np.zeros((grow, 3), np.int64)])
                self.id_hashes = np.concatenate([self.id_hashes, np.zeros(grow, np.uint64)])
            self.id_hashes[slot] = id_hash(rid)
            self.holders.ensure_slot(slot)
            self._live_slots = None
        return slot

    def _release_slot(self, rid: str) -> None:
        slot = self._slot.pop(rid, None)
        if slot is not None:
            del self._rid[slot]
            self._free.append(slot)
            for _, totals in self.shares.values():  # its shared bookings end with it
                values = totals.pop(rid, None)
                if values is not None:
                    self.shared_in_flight -= values[_IN_FLIGHT]
            self.shared[slot] = 0
            self._live_slots = None

    def check(self) -> None:
        """The invariants of the module docstring."""
        self.holders.check()
        assert set(self._rid.values()) == set(self._slot)
        assert all(self._rid[s] == rid for rid, s in self._slot.items())
        for slot in self._free:
            assert self.holders.count[slot] == 0 and not self.loads[slot].any(), slot
        assert self.shared_in_flight == int(self.shared[:, 1].sum())


def _run_per_slot(runs: list[tuple[int, int]], slots: int) -> np.ndarray:
    """Each of ``slots`` slots' run: the runs' masks (disjoint) unpacked at once, one row
    each, so a staircase of 64 runs costs one unpacking, not 64."""
    if not runs:
        return np.zeros(slots, np.int64)
    width = (slots + 7) // 8
    raw = b"".join(mask.to_bytes(width, "little") for _, mask in runs)
    bits = np.unpackbits(
        np.frombuffer(raw, np.uint8).reshape(len(runs), width), axis=1, bitorder="little"
    )
    longest = runs[-1][0]  # runs come shortest first
    lengths = np.array([run for run, _ in runs], np.uint16 if longest < 2**16 else np.uint32)
    return (bits * lengths[:, None]).max(axis=0)[:slots].astype(np.int64)  # no integer BLAS


def _split(joined: bytes) -> list[bytes]:
    return [joined[i : i + HASH_BYTES] for i in range(0, len(joined), HASH_BYTES)]
