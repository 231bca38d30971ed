"""The node store's settings (``store:`` in the Serve config): where its file lives, its
size, its disk tier; and the name that sets one cluster's stores on a node apart from
another's. The router's part of the section (on or off, the price of a restored token) is
``kvindex.stored.StorePrices``, which this extends."""

from __future__ import annotations

import hashlib
import os

from pydantic import Field

from kvindex.config import IndexConfig
from kvindex.stored import StorePrices


class StoreConfig(StorePrices):
    """A node-shared store of evicted KV blocks, then (if set) a disk directory.

    On by default: the store takes memory only as blocks fill it (up to ``memory_bytes``),
    and a block is spilled when it is released, behind the step. Disk is off unless
    ``disk_directory`` is set.
    """

    directory: str = Field("/dev/shm", description="where the shared-memory file lives")
    memory_bytes: int | None = Field(
        None, gt=0, description="the store's size; None: 1/16 of the node's RAM, at most "
        "a quarter of the directory's free space",
    )  # fmt: skip
    ways: int = Field(16, gt=0, le=256, description="slots per set (LRU within a set)")
    disk_directory: str | None = Field(None, description="the disk tier's directory; None: off")
    disk_bytes: int = Field(8 * 2**30, gt=0, description="the disk tier's size")
    disk_after_uses: int = Field(
        2, ge=1, description="a block the store evicts goes to disk if used this often"
    )
    stale_after_s: float = Field(
        3600.0, ge=0, description="an unused store of another cluster is removed after this"
    )

    def size_bytes(self) -> int:
        """``memory_bytes``, or the default (see the field)."""
        if self.memory_bytes is not None:
            return self.memory_bytes
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        st = os.statvfs(self.directory)
        return max(1, min(ram // 16, st.f_bavail * st.f_frsize // 4))

    def prices(self) -> StorePrices:
        """The part a router is handed."""
        return StorePrices.model_validate(self.model_dump(include=set(StorePrices.model_fields)))


def store_namespace(index: IndexConfig) -> str:
    """What names a cluster's stores on a node: its index's cluster name and Redis (two
    clusters of one name on different Redis servers are two clusters)."""
    where = hashlib.blake2b(index.url.encode(), digest_size=4).hexdigest()
    return f"{index.cluster}.{where}"
