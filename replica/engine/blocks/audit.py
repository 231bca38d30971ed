"""The engine's block accounting, checked from scratch (tests after every step, replicas
whenever they fall idle): counted, never derived from the counters it checks."""

from __future__ import annotations

from collections.abc import Iterable

from replica.engine.blocks.manager import BlockManager
from replica.engine.sequence import Sequence


def check_block_accounting(
    manager: BlockManager, running: Iterable[Sequence], waiting: Iterable[Sequence]
) -> None:
    """Raise ``AssertionError`` naming every broken rule: free + cached + in use = total,
    every ref count equals the number of block tables and sessions' pins holding the block,
    waiting requests hold nothing, pins hold published blocks only and within their bound,
    exactly the published blocks that nobody holds are evictable, each in one tenant's
    segment."""
    alloc, cache = manager.allocator, manager.prefix_cache
    held = [0] * alloc.num_blocks
    for seq in running:
        for block in seq.block_table:
            held[block] += 1
    pins = manager.pins
    pinned = list(pins.blocks())
    for block in pinned:
        held[block] += 1
    in_use = sum(1 for count in alloc.ref_counts if count > 0)
    published_idle = {
        b for b in range(alloc.num_blocks) if cache is not None and cache.is_published(b)
    } - {b for b in range(alloc.num_blocks) if alloc.ref_counts[b]}
    checks = {
        "free + cached + in use != total": alloc.num_free + alloc.num_cached + in_use
        == alloc.num_blocks,
        "ref counts differ from the block tables": held == alloc.ref_counts,
        "a waiting request holds blocks": all(not s.block_table for s in waiting),
        "a pin holds an unpublished block": all(
            cache is not None and cache.is_published(b) for b in pinned
        ),
        "the pins hold more than their bound": len(pinned) == pins.held <= pins.max_blocks,
        "evictable blocks differ from the published blocks nobody holds": set(alloc.cached.blocks())
        == published_idle,
    }
    alloc.cached.check()  # segments and owners (``replica.engine.blocks.eviction``)
    broken = [name for name, ok in checks.items() if not ok]
    if broken:
        raise AssertionError("; ".join(broken))
