"""Moving verified KV blocks between engines: what a replica that lacks a prefix pulls from
the replica that holds it (``replica.pull`` calls these on each side's engine thread).

``export_prefix`` answers a requester's prompt (its token ids and cache salt) with the
holder's longest *verified* cached prefix of it: per full block its hash, its parent's hash,
its token ids, where it is in the holder's pool and its generation there. The KV (all
layers' K and V: one contiguous region of the block-major cache per block) travels one of
two ways. By reference, on the same node, when the holder's pool is shared memory
(``replica.kv.shared_pool``): the receiver copies the blocks straight out of the
holder's pool and keeps a block only if its generation did not change around the copy (it
was not evicted or reused meanwhile). As bytes otherwise: one uint8 array with a CRC-32 per
block, copied between steps (no eviction can change a block then), which Ray's object store
carries between nodes. Because the holder looks the prompt up under the requester's salt,
a tenant's blocks go only to a request with the same salt.

``import_prefix`` holds every block to the rule a local hit keeps, and more: its tokens are
the requester's tokens at that position, its hash is the one the *receiver* computes for
them (its own hasher, salt and secret), its parent is the block before it, its bytes have
the cache's layout and length and match their digest or their generation. The first block
that fails ends the import (a prefix is usable only up to its first gap); the blocks before
it are published like computed ones and released, so the next admission of the request
hits them locally. A forged hash, a collision, a torn, truncated or overwritten copy, a
holder that died mid-copy: each costs a miss, never a wrong token. Imported blocks take free
or least recently used cached blocks, never one in use.
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from replica.engine.faces import KVHandle
from replica.kv.shared_pool import PoolLocator, read_blocks


@dataclass(frozen=True)
class ExportedBlock:
    block_hash: bytes
    parent_hash: bytes | None  # None for a prompt's first block
    token_ids: tuple[int, ...]
    crc: int  # zlib.crc32 of the block's bytes (0 when they stay in the holder's pool)
    block_id: int = -1  # where it is in the holder's pool
    generation: int = -1  # the block's generation there when exported


@dataclass(frozen=True)
class PrefixExport:
    layout: tuple[str, tuple[int, ...]]  # the cache's dtype and one block's shape
    blocks: tuple[ExportedBlock, ...] = ()
    kv: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.uint8))  # a row a block
    pool: PoolLocator | None = None  # by reference: read the blocks from the holder's pool
    store: Any = None  # by reference: read them from a node store (``replica.store``)
    stored: tuple[Any, ...] = ()  # the store's records of ``blocks`` (``StoredBlock``)
    first: int = 0  # the prompt position of ``blocks[0]`` (a store's run starts anywhere)

    @property
    def num_bytes(self) -> int:
        return len(self.blocks) * self.block_bytes if self.by_reference else int(self.kv.nbytes)

    @property
    def by_reference(self) -> bool:
        return self.pool is not None or self.store is not None

    @property
    def block_bytes(self) -> int:
        """One block's size where the blocks are read (0 for bytes that travelled)."""
        if self.pool is not None:
            return self.pool.block_bytes
        return self.store.geometry.block_bytes if self.store is not None else 0


@dataclass
class ImportResult:
    imported: int = 0  # blocks now published here
    already_held: int = 0  # the requester's leading blocks this engine had
    rejected: list[str] = field(default_factory=list)  # why the first refused block was


def export_prefix(
    kv: KVHandle, token_ids: Sequence[int], cache_salt: str | None, by_reference: bool = False
) -> PrefixExport:
    """The engine's verified cached prefix of ``token_ids`` under ``cache_salt``, as blocks:
    their bytes, or (``by_reference``, when the pool is shared) where they are in the pool."""
    data = kv.pool.data
    cache = kv.cache
    path = kv.lookup(token_ids, cache_salt)
    if cache is None or not path:
        return PrefixExport(kv.layout)
    pool = kv.pool.locator if by_reference else None
    rows = np.zeros((0, 0), np.uint8)
    if pool is None:
        rows = data[path].view(torch.uint8).reshape(len(path), -1).numpy()  # a copy: indexed
    blocks = []
    for row, block_id in enumerate(path):
        entry = cache.entry(block_id)
        parent = entry.parent.block_hash if entry.parent is not None else None
        crc = zlib.crc32(rows[row]) if pool is None else 0
        generation = int(kv.pool.generations[block_id])
        blocks.append(
            ExportedBlock(entry.block_hash, parent, entry.token_ids, crc, block_id, generation)
        )
    return PrefixExport(kv.layout, tuple(blocks), rows, pool)


def import_prefix(
    kv: KVHandle,
    token_ids: Sequence[int],
    cache_salt: str | None,
    export: PrefixExport,
    expected: list[bytes] | None = None,
) -> ImportResult:
    """Publish the verified blocks of ``export`` that this engine lacks (see the module).
    ``expected``: this engine's own chain of ``token_ids`` under ``cache_salt``, if the
    caller has it (computed here otherwise); never the export's."""
    data = kv.pool.data
    result = ImportResult()
    if kv.cache is None:
        result.rejected.append("this engine has no prefix cache")
        return result
    if export.layout != kv.layout:
        result.rejected.append(f"layout {export.layout} is not this cache's {kv.layout}")
        return result
    if expected is None:
        expected = kv.manager.hasher.chain(token_ids, cache_salt)
    held = kv.lookup(token_ids, cache_salt, expected)
    result.already_held = len(held)
    count = _verified(export, token_ids, expected, len(held), kv.block_size, data, result)
    _publish(kv, export, held, count, token_ids, expected, cache_salt, result)
    return result


def _verified(
    export: PrefixExport,
    token_ids: Sequence[int],
    expected: list[bytes],
    start: int,
    block_size: int,
    data: torch.Tensor,
    result: ImportResult,
) -> int:
    """How many blocks from position ``start`` on pass every check that can be made before
    the copy, up to the first that does not (its reason recorded). Bytes that travelled are
    checked here (length, checksum); blocks read from a shared pool after their copy."""
    size = data[0].numel() * data.element_size()
    rows, width = export.kv.shape if export.kv.ndim == 2 else (0, 0)
    by_bytes = not export.by_reference
    if start < export.first:  # the export begins after a gap in what this engine holds
        result.rejected.append(f"block {start}: not in the export (it starts at {export.first})")
        return 0
    wanted = 0
    for i, block in enumerate(export.blocks[start - export.first :], start):
        tokens = tuple(token_ids[i * block_size : (i + 1) * block_size])
        parent = expected[i - 1] if i else None
        problem = (
            "past the prompt's full blocks" if i >= len(expected)
            else "tokens differ" if block.token_ids != tokens
            else "hash differs" if block.block_hash != expected[i]
            else "parent differs" if block.parent_hash != parent
            else "wrong pool" if not by_bytes and export.block_bytes != size
            else None if not by_bytes
            else "truncated" if i - export.first >= rows or width != size
            else "checksum differs" if zlib.crc32(export.kv[i - export.first]) != block.crc
            else None
        )  # fmt: skip
        if problem is not None:
            result.rejected.append(f"block {i}: {problem}")
            break
        wanted += 1
    return wanted


def _publish(
    kv: KVHandle,
    export: PrefixExport,
    held: list[int],
    count: int,
    token_ids: Sequence[int],
    expected: list[bytes],
    cache_salt: str | None,
    result: ImportResult,
) -> None:
    """Copy the ``count`` verified blocks after the held ones in, publish those that
    arrived intact, and release them (cached), deepest first, as a sequence releases its
    blocks: a parent is never evicted before its children (an evicted parent would strand
    them). Blocks that did not arrive intact go back free, unpublished."""
    allocator, cache, bs = kv.allocator, kv.cache, kv.block_size
    assert cache is not None  # checked by the caller
    for block in held:  # pinned while allocating: the allocation must not evict them
        allocator.share(block)
    ids = allocator.allocate(min(count, allocator.num_available))
    arrived = _copy_in(export, len(held), ids, kv.pool.data) if ids else 0
    parent = held[-1] if held else None
    for offset, block_id in enumerate(ids[:arrived]):
        i = len(held) + offset
        cache.publish(block_id, expected[i], token_ids[i * bs : (i + 1) * bs], parent, cache_salt)
        allocator.mark_copied(block_id)
        parent = block_id
    for block_id in reversed([*held, *ids]):
        allocator.free(block_id)
    result.imported = arrived
    if arrived < len(ids):
        result.rejected.append(f"block {len(held) + arrived}: changed or gone mid-copy")
    elif len(ids) < count:
        result.rejected.append(f"room for {len(ids)} of {count} blocks")


def _copy_in(export: PrefixExport, first: int, ids: list[int], data: torch.Tensor) -> int:
    """Copy the exported blocks from prompt position ``first`` on into this pool's ``ids``;
    how many arrived intact."""
    flat = data.view(torch.uint8).view(data.shape[0], -1)
    k = first - export.first
    if export.by_reference:
        rows = [flat[block_id].numpy() for block_id in ids]
        if export.store is not None:
            return export.store.read_blocks(export.stored[k : k + len(ids)], rows)
        blocks = export.blocks[k : k + len(ids)]
        sources = [b.block_id for b in blocks]
        return read_blocks(export.pool, sources, [b.generation for b in blocks], rows)
    with warnings.catch_warnings():  # a read-only array (Ray's shared memory): only read
        warnings.simplefilter("ignore", UserWarning)
        flat[ids] = torch.from_numpy(np.ascontiguousarray(export.kv[k : k + len(ids)]))
    return len(ids)
