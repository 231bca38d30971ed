"""vLLM's KV cache events in this project's vocabulary: every block vLLM stores, re-keyed by
our hash chain (``kvindex.hashing``), so the router's hashes of a prompt find what vLLM holds.

vLLM keys a block by its own chained hash (of its parent's hash, its tokens and its extra
keys) and says so in a ``BlockStored`` event: the blocks' vLLM hashes, the parent's vLLM hash
(None for a prompt's first block), the blocks' token ids, and per block the extra keys that
went into its hash (the cache salt on a first block, LoRA names, multimodal identifiers).
vLLM stores a block only while its parent is cached (the request holding the child holds the
parent), so the bridge always knows the parent's hash in our chain, and recomputes::

    ours(block) = H(ours(parent) || tokens of block)    ours(None) = root(cache salt)

What it cannot key exactly it never publishes: a block hashed with a LoRA name or multimodal
inputs (our chain has no place for them), and every descendant of such a block. A parent the
bridge never saw means an event was lost before this one: ``apply`` says so (``Lost``) and the
caller resyncs (``replica.vllm.events``); it never guesses.

Invariant (``check``): ``ours`` maps exactly the vLLM hashes held in some medium and keyable;
``_count`` counts, per hash of ours, the vLLM blocks that map to it; the published set is
``_count``'s keys.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from kvindex.hashing import BlockHasher
from replica.engine.blocks.prefix_cache import CacheEvents

VHash = Hashable  # vLLM's ExternalBlockHash: bytes or int


@dataclass(frozen=True)
class Stored:
    """vLLM's ``BlockStored``, the fields the bridge reads."""

    block_hashes: Sequence[VHash]
    parent: VHash | None
    token_ids: Sequence[int]
    block_size: int
    lora_name: str | None = None
    extra_keys: Sequence[tuple[object, ...] | None] | None = None
    medium: str | None = None


@dataclass(frozen=True)
class Removed:
    """vLLM's ``BlockRemoved``."""

    block_hashes: Sequence[VHash]
    medium: str | None = None


@dataclass(frozen=True)
class Cleared:
    """vLLM's ``AllBlocksCleared``: nothing is cached any more."""


Event = Stored | Removed | Cleared


class Lost(Exception):
    """An event refers to a block the bridge never saw stored: an earlier event was lost."""


class BlockSizeMismatch(Exception):
    """vLLM hashes blocks of another size than the deployment's (a misconfiguration)."""


@dataclass
class BridgeCounters:
    stored: int = 0  # vLLM blocks keyed and published
    removed: int = 0
    cleared: int = 0
    unkeyable: int = 0  # blocks not published: LoRA, multimodal, or a descendant of one


@dataclass
class KVEventBridge:
    """Translates vLLM's event batches into ``CacheEvents`` of our hashes for ``on_events``
    (``replica.publisher.IndexPublisher.on_events``). Not thread-safe: one subscriber
    thread calls it."""

    hasher: BlockHasher
    on_events: Callable[[CacheEvents], None]
    ours: dict[VHash, bytes] = field(default_factory=dict)
    counters: BridgeCounters = field(default_factory=BridgeCounters)
    _media: dict[VHash, set[str | None]] = field(default_factory=dict)
    _unkeyable: dict[VHash, set[str | None]] = field(default_factory=dict)
    _count: dict[bytes, int] = field(default_factory=dict)

    def apply(self, events: Sequence[Event]) -> None:
        """One batch: everything it changed goes to ``on_events`` as one ``CacheEvents``.
        Raises ``Lost`` (nothing of the batch applied past the lost reference: the caller
        clears and resyncs) or ``BlockSizeMismatch``."""
        stored: list[bytes] = []
        removed: list[bytes] = []
        cleared = False
        for event in events:
            if isinstance(event, Cleared):
                self.reset()
                stored, removed, cleared = [], [], True
            elif isinstance(event, Stored):
                stored += self._store(event)
            else:
                removed += self._remove(event)
        gone = set(removed)
        stored = [h for h in stored if h not in gone or h in self._count]
        removed = [h for h in gone if h not in self._count]
        if stored or removed or cleared:
            self.on_events(CacheEvents(tuple(stored), tuple(removed), cleared))

    def reset(self) -> None:
        """Forget everything (vLLM cleared its cache, or the caller gave up on a gap)."""
        self.ours.clear()
        self._media.clear()
        self._unkeyable.clear()
        self._count.clear()
        self.counters.cleared += 1

    @property
    def published(self) -> set[bytes]:
        """Our hashes of every keyable block vLLM holds now."""
        return set(self._count)

    def _store(self, event: Stored) -> list[bytes]:
        bs = self.hasher.block_size
        if event.block_size != bs:
            raise BlockSizeMismatch(f"vLLM stores blocks of {event.block_size}, not {bs}")
        if len(event.token_ids) != bs * len(event.block_hashes):
            raise ValueError("BlockStored: token ids do not fill its blocks")
        parent = self._parent(event)
        new: list[bytes] = []
        for i, vhash in enumerate(event.block_hashes):
            extra = event.extra_keys[i] if event.extra_keys else None
            if extra is not None and (i or event.parent is not None):
                parent = None  # keyed by what our chain has no place for (multimodal)
            if parent is None:
                self._unkeyable.setdefault(vhash, set()).add(event.medium)
                self.counters.unkeyable += 1
                continue
            if vhash in self.ours:
                self._media[vhash].add(event.medium)
                parent = self.ours[vhash]
                continue
            parent = self.hasher.hash_block(parent, event.token_ids[i * bs : (i + 1) * bs])
            self.ours[vhash] = parent
            self._media[vhash] = {event.medium}
            self._count[parent] = self._count.get(parent, 0) + 1
            self.counters.stored += 1
            new.append(parent)
        return new

    def _parent(self, event: Stored) -> bytes | None:
        """Our hash of the first block's parent; None: the chain cannot be keyed."""
        if event.parent is None:
            first = event.extra_keys[0] if event.extra_keys else None
            if event.lora_name is not None or not _is_salt(first):
                return None
            return self.hasher.root(first[0] if first else None)
        if event.parent in self.ours:
            return self.ours[event.parent]
        if event.parent in self._unkeyable:
            return None
        raise Lost(f"BlockStored after a parent never stored ({event.parent!r})")

    def _remove(self, event: Removed) -> list[bytes]:
        gone: list[bytes] = []
        for vhash in event.block_hashes:
            if vhash in self._unkeyable:
                _drop_medium(self._unkeyable, vhash, event.medium)
                continue
            if vhash not in self.ours:
                raise Lost(f"BlockRemoved of a block never stored ({vhash!r})")
            if _drop_medium(self._media, vhash, event.medium):
                continue  # still held in another medium
            ours = self.ours.pop(vhash)
            self._count[ours] -= 1
            if not self._count[ours]:
                del self._count[ours]
                gone.append(ours)
            self.counters.removed += 1
        return gone

    def check(self) -> None:
        """The invariant in the module docstring (tests call it after every batch)."""
        counts: dict[bytes, int] = {}
        for ours in self.ours.values():
            counts[ours] = counts.get(ours, 0) + 1
        assert counts == self._count, "published counts differ from the map"
        assert set(self._media) == set(self.ours), "media and map disagree"
        assert not set(self._unkeyable) & set(self.ours), "a block both keyed and not"


def _is_salt(extra: tuple[object, ...] | None) -> bool:
    """A first block's extra keys that our chain can take: none, or one cache salt."""
    return extra is None or (len(extra) == 1 and isinstance(extra[0], str))


def _drop_medium(held: dict[VHash, set[str | None]], vhash: VHash, medium: str | None) -> bool:
    """Remove ``medium`` from ``vhash``'s; True while another medium still holds it."""
    media = held[vhash]
    media.discard(medium)
    if media:
        return True
    del held[vhash]
    return False
