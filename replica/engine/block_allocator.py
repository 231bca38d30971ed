"""Reference-counted physical KV blocks with an LRU pool of reusable cached blocks."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, MutableSequence
from typing import Protocol


class OutOfBlocksError(RuntimeError):
    """Not enough free or evictable blocks; nothing was changed."""


class BlockCache(Protocol):
    """What the allocator needs from a prefix cache: which blocks hold a published prefix,
    and a way to forget one when its memory is taken back."""

    def is_published(self, block_id: int) -> bool: ...

    def evict(self, block_id: int) -> None: ...


class BlockAllocator:
    """Hands out physical blocks and counts who holds them.

    Every block is in exactly one state, so ``num_free + num_cached + num_in_use == num_blocks``:

    * free: ref count 0, holds nothing anyone wants;
    * cached: ref count 0, holds a block published in ``cache``; kept until its memory is
      needed, then evicted least recently released first;
    * in use: ref count > 0.

    Whether a block is published is known only to ``cache`` (one source of truth): a block
    released to ref count 0 becomes cached if the cache has it, free otherwise. ``allocate``
    takes free blocks first and evicts cached ones only when it must (cached prefixes go
    before anyone is preempted, because the caller may use ``num_available``). ``share`` on
    a cached block takes it out of the eviction order, so a prefix hit is never evicted by
    the allocation that follows it. Ref counts never go negative.
    """

    def __init__(self, num_blocks: int, block_size: int, cache: BlockCache | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cache = cache
        self.ref_counts = [0] * num_blocks
        # bumped when a block stops holding what it held (its eviction), before its memory
        # can be reused: a peer copying the block checks it before and after (``transfer``)
        self.generations: MutableSequence[int] = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU first
        # told of every block that becomes cached (the node store spills it: replica.store)
        self.on_cached: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - len(self._free) - len(self._cached)

    @property
    def num_available(self) -> int:
        """Blocks ``allocate`` can hand out now, evicting cached ones if needed."""
        return len(self._free) + len(self._cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def eviction_order(self) -> list[int]:
        """Cached blocks, the next to be evicted first."""
        return list(self._cached)

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks with ref count 1. Raises ``OutOfBlocksError`` (changing nothing)."""
        if n > self.num_available:
            raise OutOfBlocksError(f"need {n} blocks, {self.num_available} available")
        blocks = []
        while len(blocks) < n:
            if not self._free:
                self.evict(next(iter(self._cached)))
            block = self._free.popleft()
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def share(self, block: int) -> None:
        """One more holder of a block in use, or revive a cached one (ref count 0 -> 1)."""
        if self.ref_counts[block] == 0:
            if block not in self._cached:
                raise ValueError(f"block {block} is free: only in-use or cached blocks are shared")
            del self._cached[block]
        self.ref_counts[block] += 1

    def free(self, block: int) -> None:
        """Drop one holder; at ref count 0 a published block becomes cached (most recent)."""
        if self.ref_counts[block] <= 0:
            raise ValueError(f"block {block} freed more often than held")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if self.cache is not None and self.cache.is_published(block):
                self._cached[block] = None
                if self.on_cached is not None:
                    self.on_cached(block)
            else:
                self._free.append(block)

    def evict(self, block: int) -> None:
        """Take one cached block's memory back: the cache forgets it and it becomes free.
        ``allocate`` evicts least recently released first; others are for resets and tests."""
        del self._cached[block]
        assert self.cache is not None
        self.cache.evict(block)
        self.generations[block] += 1
        self._free.append(block)

    def evict_all(self) -> None:
        """Evict every cached block (a cache reset); blocks in use are untouched."""
        while self._cached:
            self.evict(next(iter(self._cached)))
