"""The vLLM event bridge: vLLM's blocks re-keyed by our hash chain, exactly, and never a guess.

vLLM's own block hashes are opaque to the bridge: the tests use small ints (101, 102, ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvindex.hashing import BlockHasher
from replica.engine.blocks.prefix_cache import CacheEvents
from replica.vllm.bridge import (
    BlockSizeMismatch,
    Cleared,
    Event,
    KVEventBridge,
    Lost,
    Removed,
    Stored,
)

BS = 4
HASHER = BlockHasher(BS, "m")
T = list(range(100, 112))  # three full blocks
U = list(range(200, 212))  # three other full blocks


def make() -> tuple[KVEventBridge, list[CacheEvents]]:
    """A bridge on block size 4, model "m", and the list its ``on_events`` appends to."""
    got: list[CacheEvents] = []
    return KVEventBridge(HASHER, got.append), got


def store(
    vhashes: Sequence[int],
    parent: int | None,
    tokens: Sequence[int],
    lora_name: str | None = None,
    extra_keys: Sequence[tuple[object, ...] | None] | None = None,
    medium: str | None = None,
) -> Stored:
    """vLLM's BlockStored of blocks of size 4."""
    return Stored(list(vhashes), parent, list(tokens), BS, lora_name, extra_keys, medium)


def applied(events: Sequence[CacheEvents]) -> set[bytes]:
    """What a subscriber holds after applying ``events`` in order."""
    held: set[bytes] = set()
    for e in events:
        if e.cleared:
            held.clear()
        held.update(e.stored)
        held.difference_update(e.removed)
    return held


def apply(bridge: KVEventBridge, events: Sequence[Event]) -> None:
    """One batch through the bridge, then its invariant."""
    bridge.apply(events)
    bridge.check()


# --- keying --------------------------------------------------------------------------------


def test_prompt_and_its_extension_are_published_as_our_chain() -> None:
    """A prompt's blocks get exactly our chain, an extension exactly its continuation."""
    bridge, got = make()
    chain = HASHER.chain(T)
    apply(bridge, [store([101, 102], None, T[:8])])
    assert len(got) == 1
    assert list(got[0].stored) == chain[:2] == HASHER.chain(T[:8])
    assert got[0].removed == () and not got[0].cleared
    apply(bridge, [store([103], 102, T[8:])])
    assert got[1] == CacheEvents((chain[2],), ())
    assert bridge.published == set(chain)
    assert bridge.ours == {101: chain[0], 102: chain[1], 103: chain[2]}
    assert bridge.counters.stored == 3
    apply(bridge, [])
    apply(bridge, [store([101], None, T[:4])])  # already held there: nothing changes
    assert len(got) == 2
    assert bridge.published == set(chain) == applied(got)


def test_cache_salt_in_the_first_blocks_extra_keys_roots_the_chain() -> None:
    """A cache salt in block 0's extra keys gives chain(tokens, cache_salt=salt)."""
    bridge, got = make()
    salted = HASHER.chain(T, cache_salt="salt")
    assert salted[:2] != HASHER.chain(T[:8])
    assert salted[:2] != HASHER.chain(T[:8], cache_salt="other")
    apply(bridge, [store([101, 102], None, T[:8], extra_keys=[("salt",), None])])
    assert got == [CacheEvents(tuple(salted[:2]), ())]
    apply(bridge, [store([103], 102, T[8:], extra_keys=[None])])
    assert got[1] == CacheEvents((salted[2],), ())
    assert bridge.published == set(salted)
    assert bridge.counters.unkeyable == 0


def test_lora_blocks_and_their_descendants_are_never_published() -> None:
    """Blocks hashed with a LoRA name, and their children, are counted, not published."""
    bridge, got = make()
    apply(bridge, [store([101, 102], None, T[:8], lora_name="L", extra_keys=[("L",), ("L",)])])
    assert got == [] and bridge.published == set() and bridge.ours == {}
    assert bridge.counters.unkeyable == 2 and bridge.counters.stored == 0
    apply(bridge, [store([103], 102, T[8:], lora_name="L", extra_keys=[("L",)])])
    assert got == [] and bridge.published == set()
    assert bridge.counters.unkeyable == 3
    apply(bridge, [store([201], None, U[:4], lora_name="L")])  # the name alone is enough
    apply(bridge, [Removed([101, 102, 103, 201])])  # forgotten quietly, not Lost
    assert got == [] and bridge.counters.unkeyable == 4 and bridge.counters.removed == 0
    with pytest.raises(Lost):  # and really forgotten
        bridge.apply([store([104], 103, U[:4], lora_name="L", extra_keys=[("L",)])])


def test_multimodal_blocks_and_their_descendants_are_never_published() -> None:
    """Any extra key but a first block's lone salt makes a block (and its tail) unpublished."""
    bridge, got = make()
    mm = ("mm-id", 0)
    apply(bridge, [store([101], None, T[:4], extra_keys=[(mm,)])])
    apply(bridge, [store([102], None, U[:4], extra_keys=[(mm, "salt")])])  # salt and image
    apply(bridge, [store([103], None, U[4:8], extra_keys=[(b"embeds-hash",)])])  # not a str
    apply(bridge, [store([104], None, U[8:], extra_keys=[("salt", b"embeds-hash")])])
    apply(bridge, [store([105], 101, T[4:8])])  # a plain child of an unkeyable block
    assert got == [] and bridge.published == set()
    assert bridge.counters.unkeyable == 5
    chain = HASHER.chain(T)
    apply(bridge, [store([201, 202, 203], None, T, extra_keys=[None, (mm,), None])])
    assert got == [CacheEvents((chain[0],), ())]
    apply(bridge, [store([204], 201, T[4:8], extra_keys=[("salt",)])])  # salt past block 0
    apply(bridge, [store([205], 203, U[:4])])
    assert len(got) == 1 and bridge.published == {chain[0]}
    assert bridge.ours == {201: chain[0]} and bridge.counters.unkeyable == 9


# --- what the bridge refuses ---------------------------------------------------------------


def test_a_store_under_a_parent_never_stored_is_lost() -> None:
    """A Stored whose parent the bridge never saw raises Lost and publishes nothing."""
    bridge, got = make()
    with pytest.raises(Lost):
        bridge.apply([store([102], 101, T[4:8])])
    apply(bridge, [store([101], None, T[:4])])
    apply(bridge, [Removed([101])])
    with pytest.raises(Lost):  # a parent stored once but gone is as unknown
        bridge.apply([store([102], 101, T[4:8])])
    assert bridge.published == set() and applied(got) == set()


def test_a_removal_of_a_block_never_stored_is_lost() -> None:
    """A Removed of a vLLM hash the bridge does not hold raises Lost."""
    bridge, _ = make()
    with pytest.raises(Lost):
        bridge.apply([Removed([999])])
    apply(bridge, [store([101], None, T[:4], medium="GPU")])
    apply(bridge, [Removed([101], medium="GPU")])
    with pytest.raises(Lost):  # removed twice
        bridge.apply([Removed([101], medium="GPU")])


def test_a_block_size_other_than_the_hashers_is_refused() -> None:
    """vLLM blocks of another size raise BlockSizeMismatch and change nothing."""
    bridge, got = make()
    with pytest.raises(BlockSizeMismatch):
        bridge.apply([Stored([101], None, list(range(8)), 8)])
    with pytest.raises(BlockSizeMismatch):
        bridge.apply([Stored([101, 102], None, list(range(4)), 2)])
    assert got == [] and bridge.ours == {} and bridge.published == set()
    bridge.check()


@pytest.mark.parametrize("n_tokens", [0, 7, 9, 12])
def test_token_ids_that_do_not_fill_the_blocks_are_refused(n_tokens: int) -> None:
    """Two block hashes need exactly 8 token ids: any other count raises ValueError."""
    bridge, got = make()
    with pytest.raises(ValueError, match="do not fill"):
        bridge.apply([store([101, 102], None, T[:n_tokens])])
    assert got == [] and bridge.ours == {}


# --- removal -------------------------------------------------------------------------------


def test_removing_blocks_publishes_their_hashes_as_removed() -> None:
    """Each removed block's hash of ours is reported removed, and no longer published."""
    bridge, got = make()
    chain = HASHER.chain(T)
    apply(bridge, [store([101, 102, 103], None, T)])
    apply(bridge, [Removed([103])])
    assert got[1] == CacheEvents((), (chain[2],))
    assert bridge.published == set(chain[:2])
    apply(bridge, [Removed([102, 101])])
    assert got[2].stored == () and not got[2].cleared
    assert sorted(got[2].removed) == sorted(chain[:2])
    assert bridge.published == set() == applied(got)
    assert bridge.ours == {} and bridge.counters.removed == 3


def test_a_block_held_in_two_media_is_removed_when_both_drop_it() -> None:
    """The same vLLM block on GPU and CPU stays published until both removed it."""
    bridge, got = make()
    h = HASHER.chain(T[:4])[0]
    apply(bridge, [store([101], None, T[:4], medium="GPU")])
    apply(bridge, [store([101], None, T[:4], medium="CPU")])
    assert got == [CacheEvents((h,), ())]
    apply(bridge, [Removed([101], medium="GPU")])
    assert len(got) == 1 and bridge.published == {h} and bridge.ours == {101: h}
    apply(bridge, [store([101, 102], None, T[:8], medium="CPU")])  # block 0 already there
    assert got[-1] == CacheEvents((HASHER.chain(T[:8])[1],), ())
    apply(bridge, [Removed([101], medium="CPU")])
    assert got[-1] == CacheEvents((), (h,))
    assert bridge.published == {HASHER.chain(T[:8])[1]} == applied(got)


def test_two_vllm_blocks_with_one_hash_of_ours_count_twice() -> None:
    """Our hash stays published until every vLLM block that maps to it is removed."""
    bridge, got = make()
    h = HASHER.chain(T[:4])[0]
    apply(bridge, [store([101], None, T[:4])])
    apply(bridge, [store([201], None, T[:4])])  # same tokens, another vLLM hash
    assert bridge.ours == {101: h, 201: h} and bridge.published == {h}
    assert all(e.stored == (h,) and e.removed == () for e in got)
    n = len(got)
    apply(bridge, [Removed([101])])
    assert len(got) == n and bridge.published == {h} == applied(got)
    apply(bridge, [Removed([201])])
    assert got[-1] == CacheEvents((), (h,))
    assert bridge.published == set() == applied(got)


# --- batches -------------------------------------------------------------------------------


def test_storing_and_removing_a_block_in_one_batch_nets_out() -> None:
    """Within one batch only what is held at its end is reported stored."""
    bridge, got = make()
    chain = HASHER.chain(T)
    apply(bridge, [store([101, 102], None, T[:8]), Removed([102])])
    assert len(got) == 1 and got[0].stored == (chain[0],) and not got[0].cleared
    assert chain[1] not in bridge.published and bridge.published == {chain[0]} == applied(got)
    apply(bridge, [store([201], None, U[:4]), Removed([201])])
    assert all(e.stored == () for e in got[1:])
    assert bridge.published == {chain[0]} == applied(got)
    apply(bridge, [Removed([101]), store([101], None, T[:4])])  # dropped and stored again
    assert got[-1] == CacheEvents((chain[0],), ())
    assert bridge.published == {chain[0]} == applied(got)


def test_cleared_forgets_everything_and_applies_what_follows_it() -> None:
    """Cleared empties the bridge; events after it in a batch are applied after it."""
    bridge, got = make()
    apply(bridge, [store([101, 102], None, T[:8])])
    apply(bridge, [Cleared()])
    assert got[-1] == CacheEvents((), (), cleared=True)
    assert bridge.published == set() and bridge.ours == {} and bridge.counters.cleared == 1
    with pytest.raises(Lost):  # a block from before the clear is unknown
        bridge.apply([store([103], 102, T[8:])])
    chain = HASHER.chain(U[:8])
    before = [store([301], None, T[:4]), Removed([301]), store([302], None, T[4:8])]
    apply(bridge, [*before, Cleared(), store([201, 202], None, U[:8])])
    assert got[-1] == CacheEvents(tuple(chain), (), cleared=True)
    assert bridge.published == set(chain) == applied(got)
    assert bridge.ours == {201: chain[0], 202: chain[1]}
    apply(bridge, [store([203], 202, U[8:]), store([401], None, T[:4], lora_name="L")])
    apply(bridge, [Cleared()])
    assert got[-1] == CacheEvents((), (), cleared=True) and bridge.published == set()
    with pytest.raises(Lost):  # unpublished blocks are forgotten too
        bridge.apply([Removed([401])])


# --- a model of vLLM's cache ---------------------------------------------------------------

MEDIA = st.sampled_from(["GPU", "CPU"])
# a tiny vocabulary: three possible blocks, so the same content (and our hash) comes back often
BLOCK = st.sampled_from([(0, 0, 0, 0), (0, 1, 0, 1), (1, 1, 1, 1)])
TOKENS = st.lists(BLOCK, min_size=1, max_size=2).map(lambda bs: [t for b in bs for t in b])
NONCE = st.integers(0, 1)


@dataclass
class Block:
    """What vLLM knows of one of its blocks (a vLLM hash stands for its content)."""

    parent: int | None
    tokens: tuple[int, ...]
    path: tuple[int, ...]  # every token from the prompt's start through this block
    salt: str | None
    lora: bool
    extra: tuple[object, ...] | None
    keyable: bool
    media: set[str] = field(default_factory=set)

    def event(self, vhash: int, medium: str) -> Stored:
        """This block alone stored in ``medium`` (vLLM offloading a copy)."""
        lora_name = "L" if self.lora else None
        return store(
            [vhash],
            self.parent,
            self.tokens,
            lora_name=lora_name,
            extra_keys=[self.extra],
            medium=medium,
        )


class VLLMCacheModel(RuleBasedStateMachine):
    """vLLM's cache as vLLM hash -> block; every change goes through the bridge as a batch."""

    @initialize()
    def start(self) -> None:
        """An empty vLLM cache and a fresh bridge."""
        self.emitted: list[CacheEvents] = []
        self.checked = 0  # emitted events the invariant has looked at
        self.bridge = KVEventBridge(HASHER, self.emitted.append)
        self.blocks: dict[int, Block] = {}
        self.ids: dict[tuple[object, ...], int] = {}  # content -> vLLM hash, as vLLM's is

    def held(self) -> list[int]:
        """vLLM hashes of the blocks held in some medium."""
        return sorted(v for v, b in self.blocks.items() if b.media)

    def stored(
        self,
        parent: int | None,
        tokens: list[int],
        medium: str,
        nonce: int = 0,
        *,
        salt: str | None = None,
        lora: bool = False,
        mm: bool = False,
    ) -> Stored:
        """Blocks of ``tokens`` after ``parent`` (a root: salted, LoRA as asked; a child
        inherits both), the last one multimodal if ``mm``, as vLLM's one Stored. ``nonce``
        stands for what vLLM hashes and our chain does not: two vLLM hashes, one of ours."""
        top = self.blocks[parent] if parent is not None else None
        lora, salt = (top.lora, top.salt) if top else (lora, salt)
        keyable, path = (top.keyable, top.path) if top else (not lora, ())
        vhashes, extras, prev, n = [], [], parent, len(tokens) // BS
        for i in range(n):
            keys: list[object] = ["L"] if lora else []
            keys += [("mm-id", 0)] if mm and i == n - 1 else []
            keys += [salt] if salt and prev is None else []
            keyable = keyable and not (mm and i == n - 1)
            path += tuple(tokens[i * BS : (i + 1) * BS])
            extra = tuple(keys) or None
            vh = self.ids.setdefault((prev, path[-BS:], extra, nonce), 1000 + len(self.ids))
            block = Block(prev, path[-BS:], path, salt, lora, extra, keyable)
            self.blocks.setdefault(vh, block).media.add(medium)
            vhashes.append(vh)
            extras.append(extra)
            prev = vh
        lora_name = "L" if lora else None
        return store(vhashes, parent, tokens, lora_name=lora_name, extra_keys=extras, medium=medium)

    @rule(
        tokens=TOKENS,
        salt=st.none() | st.just("a"),
        lora=st.booleans(),
        mm=st.booleans(),
        medium=MEDIA,
        nonce=NONCE,
    )
    def store_root(
        self, tokens: list[int], salt: str | None, lora: bool, mm: bool, medium: str, nonce: int
    ) -> None:
        """vLLM stores a prompt's first blocks."""
        event = self.stored(None, tokens, medium, nonce, salt=salt, lora=lora, mm=mm)
        self.bridge.apply([event])

    @precondition(lambda self: self.held())
    @rule(data=st.data(), tokens=TOKENS, mm=st.booleans(), medium=MEDIA, nonce=NONCE)
    def extend(
        self, data: st.DataObject, tokens: list[int], mm: bool, medium: str, nonce: int
    ) -> None:
        """vLLM stores blocks that continue a held one."""
        parent = data.draw(st.sampled_from(self.held()))
        self.bridge.apply([self.stored(parent, tokens, medium, nonce, mm=mm)])

    def copyable(self) -> list[int]:
        """Blocks held in one medium whose parent is held: vLLM may copy them to the other."""
        held = set(self.held())
        return [
            v
            for v in held
            if len(self.blocks[v].media) == 1 and self.blocks[v].parent in held | {None}
        ]

    @precondition(lambda self: self.copyable())
    @rule(data=st.data())
    def copy(self, data: st.DataObject) -> None:
        """vLLM copies a held block to its other medium."""
        vh = data.draw(st.sampled_from(sorted(self.copyable())))
        (medium,) = {"GPU", "CPU"} - self.blocks[vh].media
        self.blocks[vh].media.add(medium)
        self.bridge.apply([self.blocks[vh].event(vh, medium)])

    @precondition(lambda self: self.held())
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        """vLLM drops a held block from one of its media."""
        vh = data.draw(st.sampled_from(self.held()))
        medium = data.draw(st.sampled_from(sorted(self.blocks[vh].media)))
        self.blocks[vh].media.discard(medium)
        self.bridge.apply([Removed([vh], medium)])

    @precondition(lambda self: self.held())
    @rule(data=st.data())
    def drop_and_restore(self, data: st.DataObject) -> None:
        """One batch evicts a block and stores it again (its parent is still held)."""
        held = set(self.held())
        vh = data.draw(st.sampled_from(sorted(held)))
        block = self.blocks[vh]
        medium = data.draw(st.sampled_from(sorted(block.media)))
        if block.parent in held - {vh} | {None}:
            self.bridge.apply([Removed([vh], medium), block.event(vh, medium)])

    @rule(tokens=TOKENS, medium=MEDIA, nonce=NONCE)
    def store_and_drop(self, tokens: list[int], medium: str, nonce: int) -> None:
        """One batch stores a prompt and drops again what it newly stored."""
        was = {v for v, b in self.blocks.items() if medium in b.media}
        event = self.stored(None, tokens, medium, nonce)
        new = [v for v in event.block_hashes if v not in was][::-1]
        for v in new:
            self.blocks[v].media.discard(medium)
        self.bridge.apply([event, Removed(new, medium)])

    @rule(before=st.none() | TOKENS, after=st.none() | TOKENS, medium=MEDIA)
    def clear(self, before: list[int] | None, after: list[int] | None, medium: str) -> None:
        """A batch with a Cleared, maybe a store before it and one after it."""
        events: list[Event] = [self.stored(None, before, medium)] if before else []
        for b in self.blocks.values():
            b.media.clear()
        events.append(Cleared())
        events += [self.stored(None, after, medium)] if after else []
        self.bridge.apply(events)

    @invariant()
    def bridge_matches_the_model(self) -> None:
        """Published (in the bridge and as its events add up) = our hashes of what vLLM holds."""
        self.bridge.check()
        keyed = [v for v in self.held() if self.blocks[v].keyable]
        expected = {HASHER.chain(self.blocks[v].path, self.blocks[v].salt)[-1] for v in keyed}
        assert self.bridge.published == expected
        assert applied(self.emitted) == expected
        assert set(self.bridge.ours) == set(keyed)
        for e in self.emitted[self.checked :]:  # order within an event must not matter
            assert not set(e.stored) & set(e.removed), e
        self.checked = len(self.emitted)


VLLMCacheModel.TestCase.settings = settings(max_examples=200, deadline=None, stateful_step_count=30)
test_bridge_follows_a_model_of_vllms_cache = VLLMCacheModel.TestCase
