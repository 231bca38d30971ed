"""What a leaving replica hands on besides its streams: its hot prefixes, as chains of
published blocks (``replica.moves`` pushes each to where the router sends it next).

A chain ends at a leaf (a published block no other published block continues), so a pushed
chain is a whole prefix some request computed, never half of one. Leaves in use (a
session's pinned turn, a stream not moved) come first, then cached ones by recency, most
recent first, until ``max_blocks`` are taken: what is evicted next here is handed on last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads in the replica's process only
    from replica.engine.blocks.prefix_cache import CachedBlock
    from replica.engine.faces import KVHandle


@dataclass(frozen=True)
class HotPrefix:
    token_ids: list[int]
    cache_salt: str | None
    num_blocks: int


def hot_prefixes(kv: KVHandle, max_blocks: int) -> list[HotPrefix]:
    """The prefixes to hand on, hottest first, at most ``max_blocks`` blocks in all (a
    block two chains share counts once). On the engine's thread."""
    cache = kv.cache
    if cache is None or max_blocks <= 0:
        return []
    blocks = cache.published()
    parents = {b.parent.block_id for b in blocks if b.parent is not None}
    leaves = {b.block_id: b for b in blocks if b.block_id not in parents}
    recency = {block: i for i, block in enumerate(kv.allocator.eviction_order())}
    # in use (not in the eviction order) first, then the most recently released
    order = sorted(leaves, key=lambda block: -recency.get(block, len(recency)))
    taken: set[int] = set()
    hot: list[HotPrefix] = []
    for block in order:
        path = _path(leaves[block])
        new = [b for b in path if b.block_id not in taken]
        if len(taken) + len(new) > max_blocks:
            break
        taken.update(b.block_id for b in new)
        ids = [t for b in path for t in b.token_ids]
        hot.append(HotPrefix(ids, path[0].cache_salt, len(path)))
    return hot


def _path(leaf: CachedBlock) -> list[CachedBlock]:
    """The chain from the prefix's first block to ``leaf``."""
    path = []
    node: CachedBlock | None = leaf
    while node is not None:
        path.append(node)
        node = node.parent
    path.reverse()
    return path
