"""The order in which the pool takes cached blocks back: a segmented LRU for each tenant, and
each tenant's share of the cached blocks.

Segments: a block hit since it was computed is *protected*, one used only by the request
that computed it is *on probation*; probation goes first, least recently released first.
Protected blocks may fill ``max_protected`` blocks of the pool; beyond that the least
recently released of them (whoever owns it) goes back on probation.

Shares: a cached block is owned by the tenant whose request released it last (a prefix two
tenants share belongs to the one that used it last). Tenant ``t`` owns ``c_t`` of the ``c``
cached blocks and its share is ``c * w_t / W`` (``w_t`` its weight, ``W`` the sum over
the tenants owning any). A victim is taken only from tenants at or over their share (there
is always one), probation before protected, least recent first. So a tenant whose flood
fills the pool evicts its own blocks, and never the prefix of a tenant under its share,
even one its flood's hits would have pushed out of the protected segment. With one tenant
(a cluster without tenants, or ``by_tenant`` off) this is the plain segmented LRU.

A parent and its child owned by different tenants (a shared prefix, continued by a tenant
that then left it) may be taken parent first; the child is then unreachable until it goes
itself (``PrefixCache``: it costs its memory, never a wrong hit).

Invariants (``check``): every cached block is in exactly one segment of one tenant, and
its owner is recorded; stamps rise along every segment; at most ``max_protected`` blocks
are protected.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

ONE_TENANT = ""  # the owner of every block when shares are off


@dataclass
class _Owned:
    """One tenant's cached blocks: block -> release stamp, least recent first."""

    probation: OrderedDict[int, int] = field(default_factory=OrderedDict)
    protected: OrderedDict[int, int] = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self.probation) + len(self.protected)

    def segment(self, block: int) -> OrderedDict[int, int]:
        return self.probation if block in self.probation else self.protected


class EvictionOrder:
    """The pool's cached blocks in eviction order (the module docstring)."""

    def __init__(self, max_protected: int, by_tenant: bool = True) -> None:
        self.max_protected, self.by_tenant = max_protected, by_tenant
        self.weights: dict[str, float] = {}  # each tenant's latest weight (default 1)
        self._owned: dict[str, _Owned] = {}
        self._owner: dict[int, str] = {}  # cached block -> its tenant
        self._stamps = itertools.count()
        self.num_protected = 0

    def __len__(self) -> int:
        return len(self._owner)

    def __contains__(self, block: int) -> bool:
        return block in self._owner

    def owner(self, block: int) -> str | None:
        """The tenant owning cached ``block`` (None if it is not cached)."""
        return self._owner.get(block)

    def held_by(self) -> dict[str, int]:
        """Cached blocks per tenant."""
        return {tenant: len(owned) for tenant, owned in self._owned.items()}

    def set_weight(self, tenant: str, weight: float) -> None:
        if weight <= 0:
            raise ValueError("a tenant's weight must be positive")
        self.weights[tenant] = weight

    def add(self, block: int, tenant: str, protected: bool) -> None:
        """``block`` was released by ``tenant``'s request: the most recent of its segment."""
        if block in self._owner:
            raise ValueError(f"block {block} is cached already")
        tenant = tenant if self.by_tenant else ONE_TENANT
        owned = self._owned.setdefault(tenant, _Owned())
        self._owner[block] = tenant
        if not (protected and self.max_protected):
            owned.probation[block] = next(self._stamps)
            return
        owned.protected[block] = next(self._stamps)
        self.num_protected += 1
        while self.num_protected > self.max_protected:
            self._demote_oldest()

    def remove(self, block: int) -> None:
        """``block`` leaves the cached pool (revived by a hit, or evicted)."""
        tenant = self._owner.pop(block)
        owned = self._owned[tenant]
        if block in owned.probation:
            del owned.probation[block]
        else:
            del owned.protected[block]
            self.num_protected -= 1
        if not owned:
            del self._owned[tenant]

    def touch(self, block: int) -> None:
        """A cached block becomes the most recent of its segment (nothing if not cached)."""
        tenant = self._owner.get(block)
        if tenant is not None:
            segment = self._owned[tenant].segment(block)
            segment[block] = next(self._stamps)
            segment.move_to_end(block)

    def victim(self) -> int:
        """The next block to evict (the module docstring). Raises LookupError if none."""
        over = self._over_share()
        for name in ("probation", "protected"):
            heads = [_head(getattr(owned, name)) for owned in over if getattr(owned, name)]
            if heads:
                return min(heads)[1]
        raise LookupError("no cached block")

    def order(self) -> list[int]:
        """Every cached block, the next to be evicted first (victims taken in turn from a
        copy: with shares the order depends on what goes before)."""
        copy = EvictionOrder(self.max_protected, self.by_tenant)
        copy.weights, copy._owner = dict(self.weights), dict(self._owner)
        copy._owned = {
            t: _Owned(o.probation.copy(), o.protected.copy()) for t, o in self._owned.items()
        }
        order = []
        while copy._owner:
            order.append(copy.victim())
            copy.remove(order[-1])
        return order

    def blocks(self) -> Iterator[int]:
        return iter(self._owner)

    def check(self) -> None:
        """The invariants of the module docstring (for tests and audits)."""
        seen = 0
        for tenant, owned in self._owned.items():
            assert owned, f"tenant {tenant!r} kept with nothing cached"
            for segment in (owned.probation, owned.protected):
                stamps = list(segment.values())
                assert stamps == sorted(stamps), "a segment out of release order"
                assert all(self._owner[b] == tenant for b in segment), "owner out of date"
                seen += len(segment)
        assert seen == len(self._owner), "a cached block in no segment, or in two"
        protected = sum(len(o.protected) for o in self._owned.values())
        assert protected == self.num_protected <= max(self.max_protected, 0)

    def _over_share(self) -> list[_Owned]:
        """The tenants at or over their share of the cached blocks (never empty while any
        block is cached: not every tenant can be under its share)."""
        owned = list(self._owned.items())
        if len(owned) == 1:
            return [owned[0][1]]
        weights = {tenant: self.weights.get(tenant, 1.0) for tenant, _ in owned}
        total_weight, total = sum(weights.values()), len(self._owner)
        return [o for t, o in owned if len(o) * total_weight >= total * weights[t]]

    def _demote_oldest(self) -> None:
        """The least recent protected block, whoever owns it, goes back on probation (the
        most recent there)."""
        _, block = min(_head(o.protected) for o in self._owned.values() if o.protected)
        owned = self._owned[self._owner[block]]
        del owned.protected[block]
        owned.probation[block] = next(self._stamps)
        self.num_protected -= 1


def _head(segment: OrderedDict[int, int]) -> tuple[int, int]:
    """(stamp, block) of a segment's least recent block."""
    block = next(iter(segment))
    return segment[block], block
