"""The pull settings (``pull:`` in the Serve config) as a replica reads them: the router's
part (``kvindex.pulls.PullPrices``: on or off, from how many missing blocks, the price) and
the replica's own (how long it waits, how the blocks travel). Kept apart from
``replica.pull`` so the cluster's config loads without the engine."""

from __future__ import annotations

from pydantic import Field

from kvindex.pulls import PullPrices


class PullConfig(PullPrices):
    """When a replica pulls a prefix from another instead of recomputing it, and how."""

    timeout_s: float = Field(2.0, gt=0, description="a pull not back by then is given up")
    shared_memory: bool = Field(
        True,
        description="same node: copy blocks straight from the holder's pool (shared memory); "
        "off: as bytes through Ray's object store, as between nodes",
    )

    def prices(self) -> PullPrices:
        """The part a router is handed."""
        return PullPrices.model_validate(self.model_dump(include=set(PullPrices.model_fields)))
