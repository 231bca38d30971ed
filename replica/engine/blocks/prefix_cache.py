"""The local prefix cache: published full blocks, found by hash, verified by tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvindex.hashing import BlockHasher


@dataclass(eq=False, slots=True)
class CachedBlock:
    """A published block: what it holds and what came before it.

    ``parent`` is the published block this one continues (None for a sequence's first block,
    whose namespace is ``cache_salt``). Together with ``token_ids`` it pins the block's whole
    context: a chain of verified parents means every earlier token matched too.
    """

    block_id: int
    block_hash: bytes
    token_ids: tuple[int, ...]
    parent: CachedBlock | None
    cache_salt: str | None


@dataclass(frozen=True)
class CacheEvents:
    """What changed in one engine step: hashes now held, hashes no longer held.

    A hash is reported stored when the engine's first block with it is published and removed
    when its last one is evicted. ``cleared`` means every earlier hash is gone (a reset).
    """

    stored: tuple[bytes, ...]
    removed: tuple[bytes, ...]
    cleared: bool = False


class PrefixCache:
    """Maps block hashes to published physical blocks: the one record of what is published.

    It holds no memory itself: the allocator asks it whether a released block is published
    (then the block is kept, cached) and tells it when it evicts one. Invariants:

    * A hit is verified, never trusted: a block matches only if its tokens equal the request's
      and its parent is the block matched just before (or, for block 0, its salt is the
      request's). A hash collision therefore costs a miss, never someone else's context.
    * A hash may map to several blocks (the same content computed twice, or a collision);
      ``lookup`` follows whichever verified path is longest.
    * A block whose parent was evicted is unreachable (its parent can never verify again)
      until it is evicted itself. Sequences hold every block of their prefix and release
      their tail first, so a parent is never older in the LRU order than its children: LRU
      eviction never strands a block, only an out-of-order ``evict`` can.
    """

    def __init__(self, hasher: BlockHasher) -> None:
        self.hasher = hasher
        self.block_size = hasher.block_size
        self._by_hash: dict[bytes, list[CachedBlock]] = {}
        self._by_block: dict[int, CachedBlock] = {}
        self._changes: dict[bytes, bool] = {}  # hash -> held, since the last drain
        self._cleared = False
        self.num_evictions = 0
        self.num_hash_mismatches = 0

    def __len__(self) -> int:
        return len(self._by_block)

    def lookup(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        block_hashes: Sequence[bytes] | None = None,
    ) -> list[int]:
        """Return the physical blocks covering the longest cached prefix of ``token_ids``.

        Stops at the first miss: a prefix is only usable if every block before it is too, so a
        later hit after a gap is worthless. ``block_hashes`` may pass the chain if the caller
        already has it; it is recomputed otherwise.
        """
        if block_hashes is None:
            block_hashes = self.hasher.chain(token_ids, cache_salt)
        bs = self.block_size
        level: list[CachedBlock | None] = [None]
        for i, block_hash in enumerate(block_hashes):
            candidates = self._by_hash.get(block_hash)
            if not candidates:
                break
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            matched = [
                e
                for e in candidates
                if e.token_ids == tokens
                and e.parent in level
                and (e.parent is not None or e.cache_salt == cache_salt)
            ]
            if not matched:
                self.num_hash_mismatches += 1
                break
            level = matched
        path = []
        entry = level[0]
        while entry is not None:
            path.append(entry.block_id)
            entry = entry.parent
        return path[::-1]

    def publish(
        self,
        block_id: int,
        block_hash: bytes,
        token_ids: Sequence[int],
        parent_block: int | None,
        cache_salt: str | None,
    ) -> None:
        """Make a full, in-use block findable. ``parent_block`` must be published already."""
        if block_id in self._by_block:
            return
        parent = None if parent_block is None else self._by_block[parent_block]
        entry = CachedBlock(block_id, block_hash, tuple(token_ids), parent, cache_salt)
        self._by_block[block_id] = entry
        same_hash = self._by_hash.setdefault(block_hash, [])
        same_hash.append(entry)
        if len(same_hash) == 1:
            self._changes[block_hash] = True

    def entry(self, block_id: int) -> CachedBlock:
        """What a published block holds and continues."""
        return self._by_block[block_id]

    def is_published(self, block_id: int) -> bool:
        return block_id in self._by_block

    def published(self) -> list[CachedBlock]:
        """Every published block (in use or not), in publishing order."""
        return list(self._by_block.values())

    def cached_hashes(self) -> set[bytes]:
        """Every hash this cache holds (published blocks, in use or not)."""
        return set(self._by_hash)

    def mark_cleared(self) -> None:
        """Every block was just evicted (a reset): report one ``cleared`` event for it all."""
        assert not self._by_block, "evict every block before marking the cache cleared"
        self._changes.clear()
        self._cleared = True

    def drain_events(self) -> CacheEvents | None:
        """The changes since the last drain, or None if there were none."""
        if not self._changes and not self._cleared:
            return None
        events = CacheEvents(
            stored=tuple(h for h, held in self._changes.items() if held),
            removed=tuple(h for h, held in self._changes.items() if not held),
            cleared=self._cleared,
        )
        self._changes.clear()
        self._cleared = False
        return events

    def evict(self, block_id: int) -> None:
        """Forget one block (the allocator's LRU victim, unreferenced): it is free memory now."""
        entry = self._by_block.pop(block_id)
        same_hash = self._by_hash[entry.block_hash]
        same_hash.remove(entry)
        if not same_hash:
            del self._by_hash[entry.block_hash]
            self._changes[entry.block_hash] = False
        self.num_evictions += 1
