"""The node store's one shared-memory format (version 3), and what names a store.

One file per (cluster, fingerprint) in the store directory (``/dev/shm`` by default):

* bytes 0-4095, the header (``HEADER``, little-endian): ``MAGIC``, ``VERSION``, the block
  size in tokens, the ways per set, the set count, one block's KV bytes, where the slot
  records and the blocks start, the 16-byte fingerprint and the creation time;
* from ``meta_offset``: one slot record per slot (``slot_dtype``), set-major (slot
  ``s * ways + w`` is way ``w`` of set ``s``);
* from ``data_offset`` (page-aligned): one block of KV per slot, ``block_bytes`` each, in
  the engine's block-major layout (all layers' K and V, ``replica.model.attention``).

A slot record: ``seq`` (a seqlock: odd while a writer rewrites the slot, bumped to the next
even value when it is done; a reader keeps a copy only if ``seq`` was the same even value
before and after), ``used_ns`` (the last put or restore, ``CLOCK_MONOTONIC``: one clock
for every process of a node), ``uses`` (1 on put, +1 per restore: the disk tier admits a
block on its second use), ``flags`` (``VALID``, ``HAS_PARENT``, ``WRITTEN``: its pages
exist), ``owner`` (the tenant whose share of the store the block counts in, ``owner_id``;
new in version 2), ``weight`` (that tenant's weight when the block was put, float32: its
share of a set is its weight over the set's owners' weights; new in version 3, in what was
padding before ``keep_until_ns``, so a record's size is unchanged), ``keep_until_ns`` (a
session's retention: no put replaces the block before then, same clock as ``used_ns``; 0:
none; new in version 2), the block's hash and its parent's as two little-endian uint64
each, and its ``block_size`` token ids (uint32).

The fingerprint (``fingerprint``) covers the format version, the model id, the block
size, the hash secret (its digest, never the secret), the KV layout (dtype and a block's
shape) and what computed the blocks (the weights files as this machine knows them, and the
code's numerics: ``replica.model.runner.numerics``): replicas that could not use each
other's blocks never open the same file, and a header that disagrees with its name is never
read (``NodeStore.open`` replaces it). A store outlives its cluster on purpose (a restart
starts warm); the fingerprint is what keeps a restart with other weights or other code
from reading it.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = b"PSKVSTOR"
VERSION = 3  # 2: the slot record's owner (a tenant's share of a set) and keep_until_ns;
# 3: the owner's weight (shares weighted as in the engine's pool)
HEADER_BYTES = 4096
HEADER = struct.Struct("<8sIIIIQQQQ16sQ")
# magic, version, block size, ways, (pad), sets, block bytes, meta at, data at,
# fingerprint, created (ns)

VALID = 1  # the slot holds a block
HAS_PARENT = 2  # that block continues another (its parent hash is meaningful)
WRITTEN = 4  # the slot's pages were written once (a rewrite needs no new memory)

FILE_PREFIX = "prefix-serve-store-"


def slot_dtype(block_size: int) -> np.dtype:
    """One slot's record (72 bytes plus 4 per token, 8-byte aligned)."""
    return np.dtype(
        [
            ("seq", "<i8"),
            ("used_ns", "<i8"),
            ("uses", "<i4"),
            ("flags", "<i4"),
            ("owner", "<u4"),
            ("weight", "<f4"),
            ("keep_until_ns", "<i8"),
            ("h0", "<u8"),
            ("h1", "<u8"),
            ("p0", "<u8"),
            ("p1", "<u8"),
            ("tokens", "<u4", (block_size,)),
        ],
        align=True,
    )


def owner_id(tenant: str) -> int:
    """A tenant's id in a slot record: 0 for the one tenant of a cluster without tenants
    (``replica.engine.blocks.eviction.ONE_TENANT``), else 32 bits of a keyed digest of its
    name (stable across processes and restarts, unlike ``hash``)."""
    if not tenant:
        return 0
    digest = hashlib.blake2b(tenant.encode(), digest_size=4, person=b"store-owner").digest()
    return int.from_bytes(digest, "little") or 1


def split_hash(block_hash: bytes) -> tuple[int, int]:
    """A 16-byte block hash as the two uint64 a slot keeps."""
    return int.from_bytes(block_hash[:8], "little"), int.from_bytes(block_hash[8:16], "little")


def join_hash(h0: int, h1: int) -> bytes:
    return int(h0).to_bytes(8, "little") + int(h1).to_bytes(8, "little")


def fingerprint(
    model_id: str,
    block_size: int,
    secret: bytes,
    layout: tuple[str, tuple[int, ...]],
    source: str = "",
) -> bytes:
    """What must match for two engines to use each other's blocks (see the module).
    ``source``: what computed them (the runner's ``kv_source``: the weights' identity and
    the code's numerics), so a store outliving a restart is read only by the same."""
    dtype, shape = layout
    secret_digest = hashlib.blake2b(secret, digest_size=16, person=b"store-secret").digest()
    text = f"v{VERSION}|{model_id}|{block_size}|{dtype}|{shape}|{source}".encode()
    return hashlib.blake2b(text + secret_digest, digest_size=16).digest()


def file_name(cluster: str, print_: bytes) -> str:
    """The store's file name in its directory: one per cluster and fingerprint."""
    return f"{FILE_PREFIX}{cluster}-{print_.hex()}"


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class StoreGeometry:
    """A store's shape: ``num_sets`` sets of ``ways`` slots of ``block_bytes`` each."""

    block_size: int
    block_bytes: int
    num_sets: int
    ways: int = 16

    @classmethod
    def for_bytes(
        cls, total_bytes: int, block_size: int, block_bytes: int, ways: int = 16
    ) -> StoreGeometry:
        """The most slots (at least one set) that fit ``total_bytes`` with their records."""
        per_slot = block_bytes + slot_dtype(block_size).itemsize
        sets = max(1, total_bytes // per_slot // ways)
        return cls(block_size, block_bytes, sets, ways)

    @property
    def num_slots(self) -> int:
        return self.num_sets * self.ways

    @property
    def data_offset(self) -> int:
        meta = self.num_slots * slot_dtype(self.block_size).itemsize
        return round_up(HEADER_BYTES + meta, mmap.PAGESIZE)

    @property
    def file_bytes(self) -> int:
        return self.data_offset + self.num_slots * self.block_bytes


def write_header(region: Any, geometry: StoreGeometry, fingerprint: bytes) -> None:
    g = geometry
    header = HEADER.pack(
        MAGIC,
        VERSION,
        g.block_size,
        g.ways,
        0,
        g.num_sets,
        g.block_bytes,
        HEADER_BYTES,
        g.data_offset,
        fingerprint,
        time.time_ns(),
    )
    region[: len(header)] = header


def read_header(raw: bytes) -> tuple[StoreGeometry, bytes] | None:
    """The geometry and fingerprint a header names, or None if it is not this version's."""
    if len(raw) < HEADER.size:
        return None
    magic, version, bs, ways, _, sets, block_bytes, meta_at, data_at, print_, _ = HEADER.unpack(
        raw[: HEADER.size]
    )
    if magic != MAGIC or version != VERSION or meta_at != HEADER_BYTES or bs <= 0 or ways <= 0:
        return None
    geometry = StoreGeometry(bs, block_bytes, sets, ways)
    if geometry.data_offset != data_at or sets <= 0:
        return None
    return geometry, print_


@dataclass(frozen=True)
class StoredBlock:
    """One slot's record as ``find`` read it (consistent: one writer's work)."""

    slot: int
    seq: int
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]


@dataclass
class StoreCounters:
    puts: int = 0  # blocks written
    put_skipped: int = 0  # already held (touched instead)
    evicted: int = 0  # blocks a put replaced
    full: int = 0  # puts refused: no free memory for new pages
    kept_full: int = 0  # puts refused: every way of the set kept for a session
    hits: int = 0  # blocks found and read intact
    torn: int = 0  # blocks found, then changed mid-read


@dataclass(frozen=True)
class PutResult:
    stored: bool
    evicted: StoredBlock | None = None  # the block this put replaced
    evicted_bytes: bytes | None = None  # its KV, when the caller asked to keep it (disk)
