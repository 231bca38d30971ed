"""The disk tier behind a node store: blocks the store evicts after their second use, one
file each, read back (verified) when the store misses.

Format (version 1), ``<directory>/<cluster>-<fingerprint hex>/<block hash hex>.kvb``:
the header ``HEADER`` (``MAGIC``, the version, the block size, one block's bytes, the
fingerprint, the block's hash and its parent's, a has-parent flag, and a CRC-32 of
everything after the header), then the block's token ids (uint32 each), then its KV
bytes. A file is written to a temporary name and renamed, so a reader sees a whole file
or none; one whose version, fingerprint, hash, length or checksum is not what it should
be is a miss (and is removed), never a misread.

Size: ``max_bytes`` over the directory; a writer past it removes the oldest files
(modification time) until a tenth is free. A full disk (``ENOSPC``) skips the write.
"""

from __future__ import annotations

import contextlib
import os
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MAGIC = b"PSKVDISK"
VERSION = 1
HEADER = struct.Struct("<8sIIQ16s16s16sBxxxI")  # ... has parent, (pad), crc


@dataclass(frozen=True)
class DiskBlock:
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    data: bytes


@dataclass
class DiskCounters:
    writes: int = 0
    write_failures: int = 0  # disk full or unwritable
    reads: int = 0  # blocks read back intact
    rejected: int = 0  # files found wrong (version, checksum, length) and removed
    removed: int = 0  # files removed to stay under max_bytes


class DiskTier:
    def __init__(
        self,
        directory: str,
        name: str,
        fingerprint: bytes,
        block_size: int,
        block_bytes: int,
        max_bytes: int,
    ) -> None:
        self.directory = os.path.join(directory, name)
        os.makedirs(self.directory, exist_ok=True)
        self.fingerprint = fingerprint
        self.block_size, self.block_bytes = block_size, block_bytes
        self.max_bytes = max_bytes
        self.counters = DiskCounters()
        self._file_bytes = HEADER.size + 4 * block_size + block_bytes
        self._used = self._file_bytes * len(self._files())

    def _path(self, block_hash: bytes) -> str:
        return os.path.join(self.directory, block_hash.hex() + ".kvb")

    def _files(self) -> list[str]:
        try:
            return [n for n in os.listdir(self.directory) if n.endswith(".kvb")]
        except OSError:
            return []

    def write(self, block: DiskBlock) -> bool:
        """Store one block (whole or not at all); False if the disk refused."""
        tokens = np.asarray(block.token_ids, np.uint32).tobytes()
        if len(block.data) != self.block_bytes or len(block.token_ids) != self.block_size:
            raise ValueError("a disk block is one full block of this tier's layout")
        crc = zlib.crc32(block.data, zlib.crc32(tokens))
        parent = block.parent_hash or b"\0" * 16
        header = HEADER.pack(
            MAGIC, VERSION, self.block_size, self.block_bytes, self.fingerprint,
            block.block_hash, parent, block.parent_hash is not None, crc,
        )  # fmt: skip
        path = self._path(block.block_hash)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(header + tokens + block.data)
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            self.counters.write_failures += 1
            return False
        self.counters.writes += 1
        self._used += self._file_bytes
        if self._used > self.max_bytes:
            self._trim()
        return True

    def read(self, block_hash: bytes) -> DiskBlock | None:
        """The block with ``block_hash`` if its file is whole and this tier's, else None."""
        path = self._path(block_hash)
        try:
            with open(path, "rb") as f:
                raw = f.read(self._file_bytes + 1)
        except OSError:
            return None
        block = self._parse(raw, block_hash)
        if block is None:
            self.counters.rejected += 1
            with contextlib.suppress(OSError):
                os.unlink(path)
            return None
        self.counters.reads += 1
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: trimmed last
        return block

    def read_chain(self, hashes: Sequence[bytes]) -> list[DiskBlock]:
        """The blocks of ``hashes`` on disk, up to the first one that is not."""
        found = []
        for block_hash in hashes:
            block = self.read(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def _parse(self, raw: bytes, block_hash: bytes) -> DiskBlock | None:
        if len(raw) != self._file_bytes:
            return None
        magic, version, bs, nbytes, print_, h, parent, has_parent, crc = HEADER.unpack(
            raw[: HEADER.size]
        )
        body = raw[HEADER.size :]
        expected = (MAGIC, VERSION, self.block_size, self.block_bytes, self.fingerprint, block_hash)
        if (magic, version, bs, nbytes, print_, h) != expected or zlib.crc32(body) != crc:
            return None
        split = 4 * self.block_size
        tokens = tuple(int(t) for t in np.frombuffer(body[:split], np.uint32))
        return DiskBlock(h, parent if has_parent else None, tokens, body[split:])

    def _trim(self) -> None:
        """Remove the oldest files until a tenth of ``max_bytes`` is free."""
        entries = []
        for name in self._files():
            with contextlib.suppress(OSError):
                path = os.path.join(self.directory, name)
                entries.append((os.stat(path).st_mtime_ns, path))
        entries.sort()
        self._used = self._file_bytes * len(entries)
        target = self.max_bytes * 0.9
        for _, path in entries:
            if self._used <= target:
                break
            with contextlib.suppress(OSError):
                os.unlink(path)
                self.counters.removed += 1
            self._used -= self._file_bytes
