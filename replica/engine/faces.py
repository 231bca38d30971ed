"""The engine's faces to what moves its KV, owned here so that the rooms above it (the node
store, pulls: ``replica.kv``, ``replica.store``) see the engine through them and the engine
never imports them:

* ``KVHandle``: an engine's blocks as they move between engines and tiers (look up a prefix,
  the pool's rows and generations, publish and release the blocks it takes in, hear of the
  blocks it releases), over its block manager and its runner's pool (``KVPool``);
* ``SecondTier``: a cache tier behind the pool (the node store), which hears of released
  blocks, copies them behind each step and restores a request's stored prefix when it is
  added.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from replica.engine.blocks.allocator import BlockAllocator
from replica.engine.blocks.manager import BlockManager
from replica.engine.blocks.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from replica.engine.sequence import Sequence as Seq


class KVPool(Protocol):
    """A runner's KV pool (``replica.model.attention.KVCache``; the simulator's one byte a
    block): a row of ``data`` per block, each block's generation (bumped when it is given to
    another prefix), and where other processes find it (``None``: private memory)."""

    data: torch.Tensor
    generations: np.ndarray
    locator: object | None


@dataclass(frozen=True)
class KVHandle:
    """One engine's blocks and pool, for moving KV (``replica.kv.transfer``, the tier)."""

    manager: BlockManager
    pool: KVPool

    @property
    def cache(self) -> PrefixCache | None:
        return self.manager.prefix_cache

    @property
    def allocator(self) -> BlockAllocator:
        return self.manager.allocator

    @property
    def block_size(self) -> int:
        return self.manager.block_size

    @property
    def layout(self) -> tuple[str, tuple[int, ...]]:
        """What a block's KV is (dtype and shape): two pools exchange blocks only alike."""
        return str(self.pool.data.dtype), tuple(self.pool.data.shape[1:])

    def rows(self) -> np.ndarray:
        """The pool as uint8 rows, one a block (a view: readers read the pool itself)."""
        data = self.pool.data
        return data.view(torch.uint8).view(data.shape[0], -1).numpy()

    def lookup(
        self, token_ids: Sequence[int], salt: str | None, chain: list[bytes] | None = None
    ) -> list[int]:
        """The blocks of the longest verified cached prefix of ``token_ids``."""
        cache = self.cache
        return cache.lookup(token_ids, salt, chain) if cache is not None else []

    def on_release(self, listener: Callable[[int], None]) -> None:
        """Hear of every published block whose last holder releases it (the tier's spill)."""
        self.allocator.on_cached = listener

    def on_early_unpin(self, listener: Callable[[str, list[int], float], None]) -> None:
        """Hear of a session's blocks released before their TTL: its tenant, its blocks,
        its expiry on ``time.monotonic``'s clock (``replica.engine.blocks.retention``)."""
        self.manager.pins.on_early_release = listener


class SecondTier(Protocol):
    """A second cache tier as the engine uses it; it sees the engine's KV only through
    ``KVHandle``."""

    def attach(self, kv: KVHandle) -> None:
        """Become the tier of ``kv``'s engine (before its first request)."""

    def after_step(self, kv: KVHandle) -> None:
        """The step's end: take over the blocks it released."""

    def restore(self, kv: KVHandle, seq: Seq) -> int:
        """Import what the tier keeps of ``seq``'s prompt beyond the local hit; how many
        blocks (on the engine's thread, when ``seq`` is added)."""
