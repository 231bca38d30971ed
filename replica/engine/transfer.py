"""Moving verified KV blocks between engines: what a replica that lacks a prefix would pull
from the replica that holds it (issue 23's engine half; the replicas and the router do not
call it yet).

``export_prefix`` answers a requester's prompt (its token ids and cache salt) with the
holder's longest *verified* cached prefix of it: per full block its hash, its parent's hash,
its token ids and a CRC-32 of its KV bytes; the bytes themselves (all layers' K and V: one
contiguous region of the block-major cache per block) travel as one uint8 array, which Ray's
object store carries without a copy between processes of a node. It runs between engine
steps, so no eviction can change a block while it is copied. Because it looks the prompt
up under the requester's salt, a tenant's blocks go only to a request with the same salt.

``import_prefix`` holds every block to the rule a local hit keeps, and more: its tokens are
the requester's tokens at that position, its hash is the one the *receiver* computes for
them (its own hasher, salt and secret), its parent is the block before it, its bytes have
the cache's layout and length and match their digest. The first block that fails ends the
import (a prefix is usable only up to its first gap); the blocks before it are published
like computed ones and released, so the next admission of the request hits them locally. A
forged hash, a collision, a torn or truncated copy therefore costs a miss, never a wrong
token. Imported blocks take free or least recently used cached blocks, never one in use.
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class ExportedBlock:
    block_hash: bytes
    parent_hash: bytes | None  # None for a prompt's first block
    token_ids: tuple[int, ...]
    crc: int  # zlib.crc32 of the block's bytes


@dataclass(frozen=True)
class PrefixExport:
    layout: tuple[str, tuple[int, ...]]  # the cache's dtype and one block's shape
    blocks: tuple[ExportedBlock, ...] = ()
    kv: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.uint8))  # a row a block

    @property
    def num_bytes(self) -> int:
        return int(self.kv.nbytes)


@dataclass
class ImportResult:
    imported: int = 0  # blocks now published here
    already_held: int = 0  # the requester's leading blocks this engine had
    rejected: list[str] = field(default_factory=list)  # why the first refused block was


def _layout(kv_data: torch.Tensor) -> tuple[str, tuple[int, ...]]:
    return str(kv_data.dtype), tuple(kv_data.shape[1:])


def _kv(engine: Any) -> torch.Tensor:
    kv = getattr(engine.runner, "kv_cache", None)
    if kv is None:
        raise TypeError("this engine's runner keeps no KV cache (a cost model)")
    return kv.data


def export_prefix(engine: Any, token_ids: Sequence[int], cache_salt: str | None) -> PrefixExport:
    """The engine's verified cached prefix of ``token_ids`` under ``cache_salt``, as blocks."""
    data = _kv(engine)
    cache = engine.block_manager.prefix_cache
    if cache is None:
        return PrefixExport(_layout(data))
    path = cache.lookup(token_ids, cache_salt)
    if not path:
        return PrefixExport(_layout(data))
    kv = data[path].view(torch.uint8).reshape(len(path), -1).numpy()  # a copy: indexed
    blocks = []
    for row, block_id in enumerate(path):
        entry = cache.entry(block_id)
        parent = entry.parent.block_hash if entry.parent is not None else None
        crc = zlib.crc32(kv[row])
        blocks.append(ExportedBlock(entry.block_hash, parent, entry.token_ids, crc))
    return PrefixExport(_layout(data), tuple(blocks), kv)


def import_prefix(
    engine: Any, token_ids: Sequence[int], cache_salt: str | None, export: PrefixExport
) -> ImportResult:
    """Publish the verified blocks of ``export`` that this engine lacks (see the module)."""
    data = _kv(engine)
    manager = engine.block_manager
    cache = manager.prefix_cache
    result = ImportResult()
    if cache is None:
        result.rejected.append("this engine has no prefix cache")
        return result
    if export.layout != _layout(data):
        result.rejected.append(f"layout {export.layout} is not this cache's {_layout(data)}")
        return result
    expected = manager.hasher.chain(token_ids, cache_salt)
    held = cache.lookup(token_ids, cache_salt, expected)
    result.already_held = len(held)
    count = _verified(export, token_ids, expected, len(held), manager.block_size, data, result)
    _publish(
        engine,
        export.kv[len(held) : len(held) + count],
        held,
        data,
        token_ids,
        expected,
        cache_salt,
        result,
    )
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
    """How many blocks from position ``start`` on pass every check, up to the first that
    does not (its reason recorded)."""
    size = data[0].numel() * data.element_size()
    rows, width = export.kv.shape if export.kv.ndim == 2 else (0, 0)
    wanted = 0
    for i, block in enumerate(export.blocks[start:], start):
        tokens = tuple(token_ids[i * block_size : (i + 1) * block_size])
        parent = expected[i - 1] if i else None
        problem = (
            "past the prompt's full blocks" if i >= len(expected)
            else "tokens differ" if block.token_ids != tokens
            else "hash differs" if block.block_hash != expected[i]
            else "parent differs" if block.parent_hash != parent
            else "truncated" if i >= rows or width != size
            else "checksum differs" if zlib.crc32(export.kv[i]) != block.crc
            else None
        )  # fmt: skip
        if problem is not None:
            result.rejected.append(f"block {i}: {problem}")
            break
        wanted += 1
    return wanted


def _publish(
    engine: Any,
    rows: np.ndarray,
    held: list[int],
    data: torch.Tensor,
    token_ids: Sequence[int],
    expected: list[bytes],
    cache_salt: str | None,
    result: ImportResult,
) -> None:
    """Copy the blocks in, publish them after the held ones, and release them (cached),
    deepest first, as a sequence releases its blocks: a parent is never evicted before its
    children (an evicted parent would strand them)."""
    manager = engine.block_manager
    allocator, cache, bs = manager.allocator, manager.prefix_cache, manager.block_size
    for block in held:  # pinned while allocating: the allocation must not evict them
        allocator.share(block)
    ids = allocator.allocate(min(len(rows), allocator.num_available))
    if ids:
        flat = data.view(torch.uint8).view(data.shape[0], -1)
        with warnings.catch_warnings():  # a read-only array (Ray's shared memory): only read
            warnings.simplefilter("ignore", UserWarning)
            flat[ids] = torch.from_numpy(np.ascontiguousarray(rows[: len(ids)]))
    parent = held[-1] if held else None
    for offset, block_id in enumerate(ids):
        i = len(held) + offset
        cache.publish(block_id, expected[i], token_ids[i * bs : (i + 1) * bs], parent, cache_salt)
        parent = block_id
    for block_id in reversed([*held, *ids]):
        allocator.free(block_id)
    result.imported = len(ids)
    if len(ids) < len(rows):
        result.rejected.append(f"room for {len(ids)} of {len(rows)} blocks")
