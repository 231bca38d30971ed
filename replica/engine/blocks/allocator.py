"""Reference-counted physical KV blocks with an LRU pool of reusable cached blocks."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, MutableSequence, Sequence
from typing import Protocol

from replica.engine.blocks.eviction import ONE_TENANT, EvictionOrder


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
      needed, then evicted (below);
    * in use: ref count > 0.

    Cached blocks are a segmented LRU for each tenant (``replica.engine.blocks.eviction``):
    a block hit since it was computed (``mark_hit``) is *protected*, one used only by the
    request that computed it is *on probation*, and probation is evicted first, least
    recently released first. Protected blocks may fill ``protected_fraction`` of the pool;
    beyond that the least recently released of them goes back on probation (most recent
    there). A prompt seen once (most of a long-tailed tenant mix) then passes through the
    pool without pushing out the prompts that come back. With ``tenant_shares``, a victim
    is taken only from the tenants at or over their weighted share of the cached blocks
    (a block is owned by the tenant whose request released it last), so one tenant's flood
    evicts its own blocks first. A block copied in (a pull, a restore) is on probation
    like one computed here: the request that brought it is its first use, not a hit (a
    pulled copy of a hot tenant's prefix then does not crowd out the unique blocks around
    it). With ``protected_fraction`` 0 and one tenant it is plain LRU. Within one tenant a parent is
    never evicted before its child: a child hit means its parent was hit, and a sequence
    releases its blocks tail first, so in either segment the child is the older.

    Whether a block is published is known only to ``cache`` (one source of truth): a block
    released to ref count 0 becomes cached if the cache has it, free otherwise. ``allocate``
    takes free blocks first and evicts cached ones only when it must (cached prefixes go
    before anyone is preempted, because the caller may use ``num_available``). ``share`` on
    a cached block takes it out of the eviction order, so a prefix hit is never evicted by
    the allocation that follows it. Ref counts never go negative.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        cache: BlockCache | None = None,
        protected_fraction: float = 0.0,
        tenant_shares: bool = True,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        if not 0.0 <= protected_fraction <= 1.0:
            raise ValueError("protected_fraction must be in [0, 1]")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cache = cache
        self.ref_counts = [0] * num_blocks
        # bumped when a block stops holding what it held (its eviction), before its memory
        # can be reused: a peer copying the block checks it before and after (``transfer``)
        self.generations: MutableSequence[int] = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.max_protected = int(protected_fraction * num_blocks)
        self.cached = EvictionOrder(self.max_protected, tenant_shares)
        self._hit = bytearray(num_blocks)  # hit since it was computed (``mark_hit``)
        self._copied = bytearray(num_blocks)  # copied in, not hit since (``mark_copied``)
        # told of every block that becomes cached (the node store spills it: replica.store)
        self.on_cached: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - len(self._free) - self.num_cached

    @property
    def num_available(self) -> int:
        """Blocks ``allocate`` can hand out now, evicting cached ones if needed."""
        return len(self._free) + self.num_cached

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def eviction_order(self) -> list[int]:
        """Cached blocks, the next to be evicted first."""
        return self.cached.order()

    def mark_hit(self, block: int) -> None:
        """``block`` served a prefix hit: once released, it is protected (see the class).
        The first hit of a block copied in is the request that brought it, as if computed
        here: it does not count."""
        if self._copied[block]:
            self._copied[block] = 0
            return
        self._hit[block] = 1

    def mark_copied(self, block: int) -> None:
        """``block`` was copied in (pulled or restored) for a request about to hit it."""
        self._copied[block] = 1

    def touch(self, chain: Sequence[int]) -> None:
        """A queued request expects to hit ``chain`` (blocks of one prefix, parent first):
        each cached one becomes the most recent of its segment, so the prefills queued
        ahead of it evict other blocks first. Flags are untouched (the hit, if the blocks
        survive, is counted at admission). Children move before parents, so a parent stays
        the more recent and is still never evicted before its child."""
        for block in reversed(chain):
            self.cached.touch(block)

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks with ref count 1. Raises ``OutOfBlocksError`` (changing nothing)."""
        if n > self.num_available:
            raise OutOfBlocksError(f"need {n} blocks, {self.num_available} available")
        blocks = []
        while len(blocks) < n:
            if not self._free:
                self.evict(self.cached.victim())
            block = self._free.popleft()
            self.ref_counts[block] = 1
            self._hit[block] = self._copied[block] = 0  # whatever it held before is gone
            blocks.append(block)
        return blocks

    def share(self, block: int) -> None:
        """One more holder of a block in use, or revive a cached one (ref count 0 -> 1)."""
        if self.ref_counts[block] == 0:
            if block not in self.cached:
                raise ValueError(f"block {block} is free: only in-use or cached blocks are shared")
            self.cached.remove(block)
        self.ref_counts[block] += 1

    def free(self, block: int, tenant: str = ONE_TENANT) -> None:
        """Drop one holder (a request of ``tenant``); at ref count 0 a published block
        becomes cached (most recent), owned by ``tenant``."""
        if self.ref_counts[block] <= 0:
            raise ValueError(f"block {block} freed more often than held")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if self.cache is not None and self.cache.is_published(block):
                self.cached.add(block, tenant, bool(self._hit[block]))
                if self.on_cached is not None:
                    self.on_cached(block)
            else:
                self._free.append(block)

    def evict(self, block: int) -> None:
        """Take one cached block's memory back: the cache forgets it and it becomes free.
        ``allocate`` evicts the first of ``eviction_order``; others are for resets and tests."""
        assert block in self.cached and self.cache is not None, f"block {block} is not cached"
        self.cached.remove(block)
        self.cache.evict(block)
        self.generations[block] += 1
        self._free.append(block)

    def evict_all(self) -> None:
        """Evict every cached block (a cache reset); blocks in use are untouched."""
        while self.num_cached:
            self.evict(self.cached.victim())
