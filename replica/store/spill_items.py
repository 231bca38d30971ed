"""What a spill carries: a block the engine released, as the store will take it (where it
is in the pool, its generation then, its hash, parent and tokens, its tenant, and how long a
session keeps it), and which of a step's released blocks to spill."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from replica.engine.faces import KVHandle
from replica.store.layout import owner_id


@dataclass(frozen=True)
class SpillItem:
    """A released block, as the engine saw it: where it is, its generation, what it holds."""

    block_id: int
    generation: int
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    owner: int = 0  # the tenant owning it in the pool (``layout.owner_id``)
    weight: float = 1.0  # that tenant's weight (its share of the store, as in the pool)
    keep_until_ns: int = 0  # a session's retention: the store keeps it until then


def released_blocks(kv: KVHandle, blocks: Sequence[int]) -> list[SpillItem]:
    """What to spill of ``blocks`` (released this step): those still cached, published."""
    held = kv.allocator.ref_counts
    return published_blocks(kv, [b for b in dict.fromkeys(blocks) if not held[b]])


def published_blocks(
    kv: KVHandle, blocks: Sequence[int], tenant: str | None = None
) -> list[SpillItem]:
    """``blocks`` as the store takes them: those published (revived or evicted ones are
    left out by the caller, or held by it), owned by ``tenant`` (None: the tenant that
    owns each in the pool's cached blocks)."""
    allocator, cache = kv.allocator, kv.cache
    assert cache is not None  # a tier needs the prefix cache (``build_tier``)
    items = []
    for block in blocks:
        if not cache.is_published(block):
            continue  # evicted since: gone
        entry = cache.entry(block)
        parent = entry.parent.block_hash if entry.parent is not None else None
        generation = int(allocator.generations[block])
        name = tenant if tenant is not None else allocator.cached.owner(block) or ""
        owner, weight = owner_id(name), allocator.cached.weights.get(name, 1.0)
        items.append(
            SpillItem(block, generation, entry.block_hash, parent, entry.token_ids, owner, weight)
        )
    return items
