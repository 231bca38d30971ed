"""A KV pool that same-node replicas can read: one anonymous shared-memory file per replica
(``memfd``), so a pull copies blocks straight from the holder's pool into the puller's, with
no serialisation, no object store and no checksum pass.

Format (version 1), one file:

* bytes 0-4095, the header: ``MAGIC``, the version, a random 16-byte nonce, the block
  count, one block's size in bytes, and where the generations and the blocks start
  (``_HEADER``, little-endian);
* from ``GEN_OFFSET``: one int64 *generation* per block, bumped each time the block stops
  holding what it held (its cache entry is evicted, before its memory is reused);
* from ``data_offset`` (page-aligned): the blocks, ``block_bytes`` each, in the engine's
  block-major layout (``KVCache``).

A reader never trusts a copy it cannot check: it reads a block's generation before and
after copying its bytes and keeps the block only if both equal the generation the holder
reported when it exported the block (a seqlock: the holder bumps before it rewrites, so a
block evicted or reused mid-copy shows a changed generation). A header that is not this
version's, a nonce that is not the exported one (a recycled pid or fd) or a short read is a
miss, never a misread.

Why ``memfd`` and not a named file in ``/dev/shm``: the memory is freed when the last
process holding it exits, so a SIGKILLed replica leaks nothing; readers reach it through
``/proc/<pid>/fd/<fd>`` (same user, same node) and close it after each pull, so they never
keep a dead holder's pool alive.
"""

from __future__ import annotations

import mmap
import os
import secrets
import struct
from dataclasses import dataclass

import numpy as np
import torch

MAGIC = b"PSKVPOOL"
VERSION = 1
GEN_OFFSET = 4096
MADV_POPULATE_WRITE = 23  # Linux 5.14; Python 3.11's mmap does not name it
_HEADER = struct.Struct("<8sI16sQQQ")  # magic, version, nonce, blocks, block bytes, data at


@dataclass(frozen=True)
class PoolLocator:
    """How a process on the same node opens a replica's pool."""

    pid: int
    fd: int
    nonce: bytes
    num_blocks: int
    block_bytes: int
    data_offset: int


def shared_memory_available() -> bool:
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


class SharedPool:
    """Owns one pool: ``data`` (a tensor of ``shape`` and ``dtype`` on the shared pages) and
    ``generations`` (int64 per block, on the same pages)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        num_blocks = shape[0]
        block_bytes = int(np.prod(shape[1:])) * torch.empty((), dtype=dtype).element_size()
        data_offset = _round_up(GEN_OFFSET + 8 * num_blocks, mmap.PAGESIZE)
        size = data_offset + num_blocks * block_bytes
        self.fd = os.memfd_create("prefix-serve-kv", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)  # zero pages, taken as they are first written
        self._map = mmap.mmap(self.fd, size)
        _populate(self._map)
        nonce = secrets.token_bytes(16)
        header = _HEADER.pack(MAGIC, VERSION, nonce, num_blocks, block_bytes, data_offset)
        self._map[: len(header)] = header
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        self.data = raw[data_offset:].view(dtype).view(shape)
        self.generations = np.frombuffer(self._map, np.int64, num_blocks, GEN_OFFSET)
        self.locator = PoolLocator(
            os.getpid(), self.fd, nonce, num_blocks, block_bytes, data_offset
        )


def read_blocks(
    locator: PoolLocator, sources: list[int], generations: list[int], rows: np.ndarray
) -> int:
    """Copy the holder's blocks ``sources`` into ``rows`` (``[len(sources), block_bytes]``
    uint8, writable); how many leading blocks arrived intact (their generation was
    ``generations[i]`` before and after the copy). 0 when the pool cannot be opened or is
    not the one exported."""
    try:
        fd = os.open(f"/proc/{locator.pid}/fd/{locator.fd}", os.O_RDONLY)
    except OSError:  # the holder is gone (or on another node)
        return 0
    try:
        if not _is_exported_pool(fd, locator):
            return 0
        before = _generations(fd, locator)
        count = 0
        for i, block in enumerate(sources):
            if before[block] != generations[i]:
                break
            offset = locator.data_offset + block * locator.block_bytes
            if os.preadv(fd, [rows[i]], offset) != locator.block_bytes:
                break
            count += 1
        after = _generations(fd, locator)
        for i in range(count):
            if after[sources[i]] != generations[i]:
                return i
        return count
    finally:
        os.close(fd)


def _is_exported_pool(fd: int, locator: PoolLocator) -> bool:
    header = os.pread(fd, _HEADER.size, 0)
    if len(header) != _HEADER.size:
        return False
    magic, version, nonce, blocks, block_bytes, data_offset = _HEADER.unpack(header)
    return (magic, version, nonce, blocks, block_bytes, data_offset) == (
        MAGIC,
        VERSION,
        locator.nonce,
        locator.num_blocks,
        locator.block_bytes,
        locator.data_offset,
    )


def _generations(fd: int, locator: PoolLocator) -> np.ndarray:
    raw = os.pread(fd, 8 * locator.num_blocks, GEN_OFFSET)
    if len(raw) != 8 * locator.num_blocks:
        return np.full(locator.num_blocks, -1, np.int64)  # nothing matches a short read
    return np.frombuffer(raw, np.int64)


def _populate(region: mmap.mmap) -> None:
    """Take every page now, as the private pool it replaces did (``torch.zeros``): a page
    first touched by a pull's copy costs a fault and a zeroing each (measured: a 1,024-token
    SmolLM2 pull took 45-170 ms into fresh pages, 10 ms into touched ones)."""
    try:
        region.madvise(MADV_POPULATE_WRITE)
    except OSError:  # a kernel before 5.14: touch each page
        step = mmap.PAGESIZE
        view = np.frombuffer(region, np.uint8)
        view[::step] = 0


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to
