"""The node store: evicted KV blocks kept in shared memory that every replica of a node
reads and writes, and that outlives any one of them (format: ``replica.store.layout``).

It is a set-associative cache: a block lives in one of the ``ways`` slots of the set its
hash picks, and a put into a full set replaces one of that set's blocks: the least
recently used of the tenant holding the most of the set, never one a session keeps
(``replica.store.victim``). No
index beside the slots (nothing to rebuild or tear), no tombstones, and a lookup reads
``ways`` records.

Who may trust what:

* Writers (``put``) hold an exclusive ``flock`` on the file (released by the kernel if the
  writer dies mid-put) and a thread lock (``flock`` does not exclude threads sharing a
  descriptor). A writer makes the slot's ``seq`` odd, rewrites record and bytes, then makes
  it even again; a writer SIGKILLed mid-put leaves an odd ``seq``, which no reader accepts
  and the next put of that slot repairs.
* Readers take no lock. ``find`` copies a record between two reads of its ``seq`` and
  keeps it only if both are the same even value; ``read_blocks`` copies bytes and keeps a
  block only if its ``seq`` is still the one ``find`` saw (the shared pool's rule,
  ``replica.kv.shared_pool``). A block replaced or torn mid-read is a miss, never
  someone else's bytes. The caller still verifies tokens, hash and parent like a local hit
  (``replica.kv.transfer``).
* ``used_ns`` and ``uses`` are hints (LRU order, disk admission), written by readers
  without the lock: a lost update costs a slightly worse eviction, never a wrong block.

Memory: a file-backed store takes its pages when slots are first written; a put that
would need new pages while the directory has less than ``reserve_bytes`` free is refused
(counted ``full``) instead of risking SIGBUS on a full ``/dev/shm``.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from replica.store.layout import (
    HAS_PARENT,
    HEADER_BYTES,
    VALID,
    WRITTEN,
    PutResult,
    StoreCounters,
    StoredBlock,
    StoreGeometry,
    join_hash,
    read_header,
    slot_dtype,
    split_hash,
    write_header,
)
from replica.store.victim import victim_way

__all__ = ["NodeStore", "StoreGeometry", "StoredBlock", "read_header", "write_header"]

RESERVE_BYTES = 64 * 2**20


class NodeStore:
    """A store over one mapped region (see the module). ``anonymous`` for one process (the
    simulator, tests); ``replica.store.files.open_node_store`` for a node's shared file."""

    def __init__(
        self,
        region: Any,
        geometry: StoreGeometry,
        fingerprint: bytes,
        fd: int | None = None,
        reserve_dir: str | None = None,
    ) -> None:
        self.geometry = g = geometry
        self.fingerprint = fingerprint
        self.counters = StoreCounters()
        self._region = region
        self._fd = fd  # the file's descriptor: its flock excludes other processes' puts
        self._reserve_dir = reserve_dir
        self._thread_lock = threading.Lock()
        dtype = slot_dtype(g.block_size)
        self.meta = np.frombuffer(region, dtype, g.num_slots, HEADER_BYTES)
        data = np.frombuffer(region, np.uint8, g.num_slots * g.block_bytes, g.data_offset)
        self.data = data.reshape(g.num_slots, g.block_bytes)

    @classmethod
    def anonymous(cls, geometry: StoreGeometry, fingerprint: bytes = b"\0" * 16) -> NodeStore:
        region = mmap.mmap(-1, geometry.file_bytes)
        write_header(region, geometry, fingerprint)
        return cls(region, geometry, fingerprint)

    # -- reading (no lock) --------------------------------------------------------------

    def find(self, block_hash: bytes) -> StoredBlock | None:
        """The block with ``block_hash``, its record read consistently, or None."""
        h0, h1 = split_hash(block_hash)
        lo = (h0 % self.geometry.num_sets) * self.geometry.ways
        ways = self.meta[lo : lo + self.geometry.ways]
        hit = np.flatnonzero((ways["h0"] == h0) & (ways["h1"] == h1) & (ways["flags"] & VALID))
        for way in hit:
            slot = lo + int(way)
            seq = int(self.meta["seq"][slot])
            record = self.meta[slot].copy()
            if seq % 2 or int(self.meta["seq"][slot]) != seq or not record["flags"] & VALID:
                continue  # mid-write: a miss
            if (int(record["h0"]), int(record["h1"])) != (h0, h1):
                continue
            parent = None
            if record["flags"] & HAS_PARENT:
                parent = join_hash(record["p0"], record["p1"])
            tokens = tuple(int(t) for t in record["tokens"])
            return StoredBlock(slot, seq, block_hash, parent, tokens)
        return None

    def find_chain(self, hashes: Sequence[bytes], start: int = 0) -> list[StoredBlock]:
        """The stored blocks of ``hashes[start:]``, up to the first one not stored."""
        found = []
        for block_hash in hashes[start:]:
            block = self.find(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def read_blocks(self, blocks: Sequence[StoredBlock], rows: Sequence[np.ndarray]) -> int:
        """Copy ``blocks`` into ``rows`` (uint8, ``block_bytes`` each); how many leading
        ones arrived intact (``seq`` unchanged since ``find``). Touches those."""
        seqs = self.meta["seq"]
        count = 0
        for block, row in zip(blocks, rows, strict=True):
            if int(seqs[block.slot]) != block.seq:
                break
            np.copyto(row, self.data[block.slot])
            count += 1
        for i in range(count):
            if int(seqs[blocks[i].slot]) != blocks[i].seq:
                count = i
                break
        self.counters.hits += count
        self.counters.torn += len(blocks) - count
        now = time.monotonic_ns()
        for block in blocks[:count]:  # hints, unlocked (see the module)
            self.meta["used_ns"][block.slot] = now
            self.meta["uses"][block.slot] += 1
        return count

    @property
    def num_blocks(self) -> int:
        return int(np.count_nonzero(self.meta["flags"] & VALID))

    # -- writing (locked) ---------------------------------------------------------------

    def put(
        self,
        block_hash: bytes,
        parent_hash: bytes | None,
        token_ids: Sequence[int],
        data: np.ndarray,
        keep_evicted_after_uses: int | None = None,
        owner: int = 0,
        keep_until_ns: int = 0,
        weight: float = 1.0,
    ) -> PutResult:
        """Store one block (its KV ``data``, uint8). A block already held is touched. The
        set's LRU block of the owner holding the most of the set for its weight makes room
        (``victim_way``);
        with ``keep_evicted_after_uses``, the result carries its bytes when it was used that
        often (the disk tier's admission). ``owner``: the tenant it counts for
        (``layout.owner_id``) at ``weight``; ``keep_until_ns``: no put replaces it before
        then (a session's retention; a set whose every way is kept refuses the put)."""
        g = self.geometry
        if len(token_ids) != g.block_size or data.size != g.block_bytes:
            raise ValueError("a store block is one full block of this store's layout")
        h0, h1 = split_hash(block_hash)
        lo = (h0 % g.num_sets) * g.ways
        with self._locked():
            ways = self.meta[lo : lo + g.ways]
            same = np.flatnonzero((ways["h0"] == h0) & (ways["h1"] == h1) & (ways["flags"] & VALID))
            if same.size:
                held = lo + int(same[0])
                self.meta["used_ns"][held] = time.monotonic_ns()
                keep = max(int(self.meta["keep_until_ns"][held]), keep_until_ns)
                self.meta["keep_until_ns"][held] = keep
                self.counters.put_skipped += 1
                return PutResult(False)
            way = victim_way(ways, owner, weight, time.monotonic_ns())
            if way < 0:
                self.counters.kept_full += 1
                return PutResult(False)
            slot = lo + way
            if not self.meta["flags"][slot] & WRITTEN and not self._has_room():
                self.counters.full += 1
                return PutResult(False)
            evicted, kept = self._victim_record(slot, keep_evicted_after_uses)
            held_for = (owner, weight, keep_until_ns)
            self._write(slot, (h0, h1), parent_hash, token_ids, data, held_for)
        self.counters.puts += 1
        self.counters.evicted += evicted is not None
        return PutResult(True, evicted, kept)

    def _victim_record(
        self, slot: int, keep_after_uses: int | None
    ) -> tuple[StoredBlock | None, bytes | None]:
        record = self.meta[slot]
        if not record["flags"] & VALID or int(record["seq"]) % 2:
            return None, None
        parent = join_hash(record["p0"], record["p1"]) if record["flags"] & HAS_PARENT else None
        block = StoredBlock(
            slot,
            int(record["seq"]),
            join_hash(record["h0"], record["h1"]),
            parent,
            tuple(int(t) for t in record["tokens"]),
        )
        keep = keep_after_uses is not None and int(record["uses"]) >= keep_after_uses
        return block, (self.data[slot].tobytes() if keep else None)

    def _write(
        self,
        slot: int,
        key: tuple[int, int],
        parent_hash: bytes | None,
        token_ids: Sequence[int],
        data: np.ndarray,
        held_for: tuple[int, float, int] = (0, 1.0, 0),
    ) -> None:
        """Rewrite one slot under the seqlock (the caller holds the lock); ``held_for``:
        its owner, the owner's weight and the time a session keeps it until."""
        meta = self.meta
        seq = int(meta["seq"][slot])
        meta["seq"][slot] = seq + 1 if seq % 2 == 0 else seq + 2  # odd: being written
        meta["flags"][slot] = WRITTEN
        np.copyto(self.data[slot], data.reshape(-1))
        meta["h0"][slot], meta["h1"][slot] = key
        p0, p1 = split_hash(parent_hash) if parent_hash is not None else (0, 0)
        meta["p0"][slot], meta["p1"][slot] = p0, p1
        meta["tokens"][slot] = np.asarray(token_ids, np.uint32)
        meta["uses"][slot] = 1
        meta["owner"][slot], meta["weight"][slot], meta["keep_until_ns"][slot] = held_for
        meta["used_ns"][slot] = time.monotonic_ns()
        meta["flags"][slot] = WRITTEN | VALID | (HAS_PARENT if parent_hash is not None else 0)
        meta["seq"][slot] = int(meta["seq"][slot]) + 1  # even: done

    def discard(self, block_hash: bytes) -> bool:
        """Drop a block (a caller found it corrupt, or a test); False if not held."""
        block = self.find(block_hash)
        if block is None:
            return False
        with self._locked():
            seqs = self.meta["seq"]
            if int(seqs[block.slot]) != block.seq:
                return False
            seqs[block.slot] = block.seq + 1
            self.meta["flags"][block.slot] &= ~VALID
            seqs[block.slot] = block.seq + 2
        return True

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock:
            if self._fd is None:
                yield
                return
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _has_room(self) -> bool:
        if self._reserve_dir is None:
            return True
        st = os.statvfs(self._reserve_dir)
        return st.f_bavail * st.f_frsize >= RESERVE_BYTES + self.geometry.block_bytes

    # -- checks -------------------------------------------------------------------------

    def check(self) -> None:
        """Raise ``AssertionError`` unless every valid slot is stable, in its hash's set,
        owned at a positive weight, and no set holds a hash twice."""
        g = self.geometry
        for s in range(g.num_sets):
            ways = self.meta[s * g.ways : (s + 1) * g.ways]
            valid = ways[(ways["flags"] & VALID) != 0]
            assert not np.any(valid["seq"] % 2), f"set {s}: a valid slot mid-write"
            assert np.all(valid["h0"] % g.num_sets == s), f"set {s}: a block in the wrong set"
            assert np.all(valid["weight"] > 0), f"set {s}: a block owned at no weight"
            keys = set(zip(valid["h0"].tolist(), valid["h1"].tolist(), strict=True))
            assert len(keys) == len(valid), f"set {s}: a hash held twice"

    def close(self) -> None:
        self.meta = self.data = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError, ValueError):
            if isinstance(self._region, mmap.mmap):
                self._region.close()
