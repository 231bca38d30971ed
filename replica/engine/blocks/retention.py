"""Blocks kept for a session's next turn: an agent's conversation outlives the tool call.

When a request that asks for retention (``replica.messages.Retention``) finishes, the
published full blocks of its prompt and output (a prefix, parent first) stay held for its
session, one reference each, until the TTL passes, the session's next turn ends (whose
own blocks then replace them), or the session says it is over (TTL 0). Held blocks are in
use: LRU eviction never takes them, the prefix cache keeps them findable, and the index
keeps them listed (they are never evicted, so never reported removed), so the router
keeps sending the session where its blocks are.

Bounds, so retention never starves running requests: the pins hold at most
``max_blocks`` references in all; a new pin beyond that first releases whole pins, oldest
first, of the tenant that holds the most (counting the new one), so one tenant's flood of
sessions releases its own before another's. A pin longer than ``max_blocks`` keeps its
first ``max_blocks`` blocks. Pins also yield to requests (``yield_one``, by the same rule):
the scheduler releases one rather than preempt a running request, or rather than leave a
request waiting when nothing runs that could free blocks. A flood of other requests evicts
cached blocks, never pinned ones, as long as what runs at once fits beside the pins.
Released blocks become cached like any other (and spill to the node store), so an expired
session may still hit. A pin released early (for room, before its TTL) tells
``on_early_release`` its tenant, blocks and expiry: the node store keeps them there until then
(``replica.store.tier``), so the session's next turn restores what the pool gave up.

Invariants: every pin's blocks are a prefix of published blocks, each held once by the pin;
``held`` is the sum of the pins' lengths and never exceeds ``max_blocks``; a block is freed
by a pin exactly as often as it was shared by it (tail first, so a child is never older
than its parent in the eviction order).
"""

from __future__ import annotations

import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from replica.engine.blocks.allocator import BlockAllocator
from replica.messages import Retention


@dataclass
class Pin:
    """One session's held blocks (parent first) and when they go."""

    tenant: str
    blocks: list[int]
    expires_at: float


@dataclass
class RetentionCounters:
    """What retention did: pins made, renewed by the session's next turn before they went
    (the retention paid), expired unused, released early for room, and ended by the client."""

    pinned: int = 0
    renewed: int = 0
    expired: int = 0
    released_for_room: int = 0
    ended: int = 0


class Pins:
    """The sessions' pins on one engine's pool (the module docstring)."""

    def __init__(
        self,
        allocator: BlockAllocator,
        max_blocks: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_blocks < 0:
            raise ValueError("max_blocks must be at least 0")
        self.allocator, self.max_blocks, self.clock = allocator, max_blocks, clock
        self._pins: OrderedDict[str, Pin] = OrderedDict()  # oldest first
        self._by_tenant: Counter[str] = Counter()  # blocks held per tenant
        # no pin goes before this (earlier after a release: then recomputed), so a step's
        # ``expire`` is one comparison while nothing is due
        self._soonest = math.inf
        self.held = 0
        self.counters = RetentionCounters()
        # told (tenant, blocks, expiry) of a pin released before its TTL (the node store
        # keeps them until then)
        self.on_early_release: Callable[[str, list[int], float], None] | None = None

    def __len__(self) -> int:
        return len(self._pins)

    def blocks(self) -> Iterator[int]:
        """Every reference the pins hold (a block pinned by two sessions: twice)."""
        for pin in self._pins.values():
            yield from pin.blocks

    def held_by(self, tenant: str) -> int:
        return self._by_tenant[tenant]

    def pin(self, retention: Retention, blocks: list[int]) -> int:
        """A request of ``retention.session`` finished holding ``blocks`` (its published
        prefix, parent first, still held by it): hold them for its TTL in place of the
        session's previous turn. Returns the blocks now held for the session."""
        had = retention.session in self._pins
        keep = blocks[: self.max_blocks] if retention.ttl_s > 0 else []
        for block in keep:  # before the old pin goes: shared blocks never drop to 0
            self.allocator.share(block)
        if had:
            self._release(retention.session)
            self.counters.renewed += 1
        if not keep:
            self.counters.ended += had
            return 0
        self._make_room(retention.tenant, len(keep))
        expires_at = self.clock() + retention.ttl_s
        self._pins[retention.session] = Pin(retention.tenant, keep, expires_at)
        self._soonest = min(self._soonest, expires_at)
        self._by_tenant[retention.tenant] += len(keep)
        self.held += len(keep)
        self.counters.pinned += 1
        return len(keep)

    def yield_one(self) -> bool:
        """Release one pin for a request that needs its blocks now (the module docstring):
        the oldest of the tenant holding the most. False when there is none."""
        if not self._pins:
            return False
        top = max(self._by_tenant, key=lambda t: self._by_tenant[t])
        self._release(next(s for s, p in self._pins.items() if p.tenant == top), early=True)
        self.counters.released_for_room += 1
        return True

    def expire(self) -> float | None:
        """Release every pin past its TTL; returns seconds until the next one goes (None:
        no pin left)."""
        now = self.clock()
        if not self._pins:
            return None
        if now < self._soonest:
            return self._soonest - now
        for session in [s for s, p in self._pins.items() if p.expires_at <= now]:
            self._release(session)
            self.counters.expired += 1
        self._soonest = min((p.expires_at for p in self._pins.values()), default=math.inf)
        return None if not self._pins else max(0.0, self._soonest - now)

    def release_all(self) -> None:
        """Drop every pin (a cache reset)."""
        for session in list(self._pins):
            self._release(session)

    def _make_room(self, tenant: str, needed: int) -> None:
        """Release whole pins until ``needed`` more fit: the oldest of the tenant holding
        the most, counting ``needed`` as ``tenant``'s. Its own blocks are shared already,
        so releasing them here only drops the pin's extra reference."""
        while self._pins and self.held + needed > self.max_blocks:
            load = self._by_tenant.copy()
            load[tenant] += needed
            top = max((t for t in load if self._by_tenant[t] > 0), key=lambda t: load[t])
            victim = next(s for s, p in self._pins.items() if p.tenant == top)
            self._release(victim, early=True)
            self.counters.released_for_room += 1

    def _release(self, session: str, early: bool = False) -> None:
        pin = self._pins.pop(session)
        if early and self.on_early_release is not None:
            self.on_early_release(pin.tenant, pin.blocks, pin.expires_at)
        for block in reversed(pin.blocks):  # tail first: a child goes before its parent
            self.allocator.free(block, pin.tenant)
        self._by_tenant[pin.tenant] -= len(pin.blocks)
        if not self._by_tenant[pin.tenant]:
            del self._by_tenant[pin.tenant]
        self.held -= len(pin.blocks)
