"""Gives sequences their blocks: the cached prefix first, new blocks for the rest."""

from __future__ import annotations

from dataclasses import dataclass

from kvindex.hashing import BlockHasher
from replica.engine.blocks.allocator import BlockAllocator
from replica.engine.blocks.prefix_cache import PrefixCache
from replica.engine.blocks.retention import Pins
from replica.engine.sequence import Sequence


@dataclass(frozen=True)
class BlockUsage:
    """The pool's blocks by state, and what the prefix cache counted (``EngineStats``)."""

    total: int
    free: int
    cached: int
    in_use: int
    evictions: int
    hash_mismatches: int
    pinned: int  # references the sessions' pins hold (``replica.engine.blocks.retention``)
    sessions: int  # sessions holding blocks


class BlockManager:
    """Block tables of sequences, on top of the allocator and (optionally) the prefix cache.

    A sequence gets blocks for its whole prompt when it is admitted (so a prompt computed
    over several steps never waits for memory mid-way), and one block at a time as decoding
    fills them. A block is published when it is *scheduled* to become full, before the
    forward pass that fills it, not when its request ends: requests admitted in the same
    step then hit it, since every layer writes the step's keys and values before any
    attention of that layer reads them. The caller must run every scheduled sequence in
    that step's forward pass.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        hasher: BlockHasher,
        enable_prefix_cache: bool,
        protected_fraction: float = 0.0,
        max_pinned_fraction: float = 0.0,
        tenant_shares: bool = True,
    ) -> None:
        if hasher.block_size != block_size:
            raise ValueError("hasher and block manager disagree on block_size")
        self.block_size = block_size
        self.hasher = hasher
        self.prefix_cache = PrefixCache(hasher) if enable_prefix_cache else None
        self.allocator = BlockAllocator(
            num_blocks, block_size, self.prefix_cache, protected_fraction, tenant_shares
        )
        self.pins = Pins(self.allocator, int(max_pinned_fraction * num_blocks))
        self._copies: list[tuple[int, int]] = []  # (src, dst) for the next forward pass

    def usage(self) -> BlockUsage:
        alloc, cache = self.allocator, self.prefix_cache
        return BlockUsage(
            total=alloc.num_blocks,
            free=alloc.num_free,
            cached=alloc.num_cached,
            in_use=alloc.num_in_use,
            evictions=cache.num_evictions if cache else 0,
            hash_mismatches=cache.num_hash_mismatches if cache else 0,
            pinned=self.pins.held,
            sessions=len(self.pins),
        )

    def admit(self, seq: Sequence, token_budget: int, reserve_blocks: int = 0) -> int | None:
        """Give a waiting sequence its blocks; return how many tokens it computes now.

        Shares the longest verified cached prefix, capped so at least one token runs, and
        allocates blocks for the rest of the prompt. The first ``token_budget`` uncached
        tokens run now (the rest in later steps, ``schedule_chunk``). Returns None, changing
        nothing, when the budget is 0 or the blocks would leave fewer than
        ``reserve_blocks`` available (evicting cached ones if needed).
        """
        bs = self.block_size
        n = seq.num_tokens
        hits = self._hits(seq)
        num_new_blocks = self.allocator.blocks_needed(n) - len(hits)
        reviving = sum(1 for b in hits if self.allocator.ref_counts[b] == 0)
        needed = num_new_blocks + reviving
        if token_budget <= 0 or needed + reserve_blocks > self.allocator.num_available:
            return None
        for block in hits:  # before allocating, so the allocation cannot evict a hit
            self.allocator.share(block)
            self.allocator.mark_hit(block)
        seq.block_table = hits + self.allocator.allocate(num_new_blocks)
        seq.num_computed_tokens = len(hits) * bs
        seq.num_published_blocks = len(hits)
        if seq.num_cached_prompt_tokens is None:
            seq.num_cached_prompt_tokens = len(hits) * bs
        return self.schedule_chunk(seq, token_budget)

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        """Prompt tokens ``admit`` would take from the cache if it ran now (no change): none
        for a request that wants prompt logprobs (``admit`` computes those prompts whole)."""
        return len(self._hits(seq)) * self.block_size

    def expect(self, seq: Sequence) -> int:
        """A sequence was queued: the cached blocks it would hit become the most recent
        (``BlockAllocator.touch``), so the prefills ahead of it in the queue do not evict
        the prefix it was routed here for. Returns how many blocks that is."""
        hits = self._hits(seq)
        self.allocator.touch(hits)
        return len(hits)

    def _hits(self, seq: Sequence) -> list[int]:
        """The cached blocks ``admit`` would share now: the longest verified prefix, capped
        so at least one token runs; none for a request that wants prompt logprobs (they need
        every prompt position's logits, and cached blocks hold none)."""
        if self.prefix_cache is None or seq.params.prompt_logprobs is not None:
            return []
        n = seq.num_tokens
        hits = self.prefix_cache.lookup(seq.token_ids, seq.cache_salt, self._hashes(seq, n))
        return hits[: (n - 1) // self.block_size]

    def schedule_chunk(self, seq: Sequence, token_budget: int) -> int:
        """Schedule the next prompt tokens of an admitted sequence, at most ``token_budget``,
        and publish the blocks they fill; returns how many tokens run."""
        n = min(seq.num_tokens - seq.num_computed_tokens, token_budget)
        self._publish(seq, seq.num_computed_tokens + n)
        return n

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Give ``child`` the computed context of ``parent`` (another choice of the same
        request): it shares every full block and gets its own copy of the partial last one
        (copy-on-write: both will write their next token there), copied before the next
        forward pass. False, changing nothing, if no block is available for the copy, or if
        ``parent`` no longer holds its context (it ended on its first token and was released:
        the child then recomputes its prompt, which the prefix cache serves)."""
        bs = self.block_size
        full, partial = divmod(parent.num_computed_tokens, bs)
        if not parent.block_table:  # released (``release`` zeroes its computed tokens too)
            return False
        if partial and self.allocator.num_available < 1:
            return False
        shared = parent.block_table[:full]
        for block in shared:
            self.allocator.share(block)
        child.block_table = list(shared)
        if partial:
            (copy,) = self.allocator.allocate(1)
            self._copies.append((parent.block_table[full], copy))
            child.block_table.append(copy)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_published_blocks = min(parent.num_published_blocks, full)
        child.block_hashes = parent.block_hashes[:full]
        return True

    def take_copies(self) -> list[tuple[int, int]]:
        """The block copies the next forward pass must run first (and forget them)."""
        copies, self._copies = self._copies, []
        return copies

    def needs_block(self, seq: Sequence) -> bool:
        """Whether the next decode token (at ``num_computed_tokens``) needs a new block."""
        return len(seq.block_table) * self.block_size <= seq.num_computed_tokens

    def append_slot(self, seq: Sequence) -> bool:
        """Make room for one decode token; False (nothing changed) if no block is available."""
        if self.needs_block(seq):
            if self.allocator.num_available < 1:
                return False
            seq.block_table += self.allocator.allocate(1)
        self._publish(seq, seq.num_computed_tokens + 1)
        return True

    def draft_slots(self, seq: Sequence, num_drafts: int) -> int:
        """Room for up to ``num_drafts`` drafted tokens after a scheduled decode (whose own
        slot ``append_slot`` made): blocks only from the free list, never by evicting a
        cached prefix for a guess. Returns how many drafts fit. Nothing is published: a
        draft's block is published once verification keeps its tokens (``settle_drafts``)."""
        bs = self.block_size
        last = seq.num_computed_tokens + num_drafts  # the last draft's position
        more = min(last // bs + 1 - len(seq.block_table), self.allocator.num_free)
        if more > 0:
            seq.block_table += self.allocator.allocate(more)
        return min(num_drafts, len(seq.block_table) * bs - seq.num_computed_tokens - 1)

    def settle_drafts(self, seq: Sequence) -> None:
        """After verification (``num_computed_tokens`` counts the kept drafts): publish the
        blocks they filled, and free the blocks past the next token's that only rejected
        drafts wrote (unpublished, so they go back to the free list)."""
        self._publish(seq, seq.num_computed_tokens)
        keep = seq.num_computed_tokens // self.block_size + 1
        while len(seq.block_table) > keep:
            self.allocator.free(seq.block_table.pop(), seq.tenant)

    def release(self, seq: Sequence) -> None:
        """Return a sequence's blocks. The tail goes first, so it is evicted first."""
        for block in reversed(seq.block_table):
            self.allocator.free(block, seq.tenant)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_published_blocks = 0

    def retain(self, seq: Sequence) -> None:
        """``seq`` finished (still holding its blocks): keep its published prefix for its
        session's next turn, if it asked (``replica.engine.blocks.retention``)."""
        if seq.retention is not None and seq.index == 0:
            self.pins.pin(seq.retention, seq.block_table[: seq.num_published_blocks])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix and every session's pin. Refused (False) while a
        request holds blocks."""
        held_by_requests = sum(self.allocator.ref_counts) - self.pins.held
        if self.prefix_cache is None or held_by_requests:
            return False
        self.pins.release_all()
        self.allocator.evict_all()
        self.prefix_cache.mark_cleared()
        return True

    def chain(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        """The hashes of the full blocks of ``seq``'s first ``num_tokens`` tokens (kept on
        the sequence: each block is hashed once, whoever asks first)."""
        return self._hashes(seq, num_tokens)[: num_tokens // self.block_size]

    def _hashes(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        have = len(seq.block_hashes)
        if num_tokens // self.block_size > have:
            parent = seq.block_hashes[-1] if have else None
            seq.block_hashes += self.hasher.chain(
                seq.token_ids[:num_tokens], seq.cache_salt, parent=parent, start_block=have
            )
        return seq.block_hashes

    def _publish(self, seq: Sequence, num_tokens: int) -> None:
        """Publish the blocks that are full once the first ``num_tokens`` tokens are computed."""
        if self.prefix_cache is None:
            return
        bs = self.block_size
        full = num_tokens // bs
        if full <= seq.num_published_blocks:
            return
        hashes = self._hashes(seq, num_tokens)
        for i in range(seq.num_published_blocks, full):
            self.prefix_cache.publish(
                seq.block_table[i],
                hashes[i],
                seq.token_ids[i * bs : (i + 1) * bs],
                seq.block_table[i - 1] if i else None,
                seq.cache_salt,
            )
        seq.num_published_blocks = full
