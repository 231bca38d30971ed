"""Counts that all decay alike, in O(1) a decay: what ``router.recent_work`` and
``router.prefix_demand`` keep.

Every value halves once per unit of ``halvings`` passed to ``decay``. Instead of touching
every value, the counts are kept scaled by a growing factor (``_scale``): a decay grows
the factor, an addition is scaled up by it, a read divides by it, and comparing scaled
values orders them as the decayed ones. Once the factor passes ``rescale_at`` it is folded
back into the values (so floats never overflow), and a value that has decayed below
``forgotten`` is dropped then (a replica gone, a prompt not seen again).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterator, Sequence
from typing import Generic, TypeVar

import numpy as np

K = TypeVar("K", bound=Hashable)


class DecayedCounts(Generic[K]):
    """Key -> amount, decayed by the halvings since it was added.

    Invariant: a key's decayed value is ``_values[key] / _scale``; ``_scale >= 1``; every
    value kept is positive and finite."""

    def __init__(self, rescale_at: float, forgotten: float) -> None:
        if rescale_at <= 1.0 or forgotten < 0.0:
            raise ValueError("rescale_at must be > 1 and forgotten >= 0")
        self.rescale_at = rescale_at
        self.forgotten = forgotten
        self._values: dict[K, float] = {}
        self._scale = 1.0

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: K) -> bool:
        return key in self._values

    def decay(self, halvings: float) -> None:
        """Every value halves ``halvings`` times (a fraction: partly)."""
        self._scale *= 2.0**halvings
        if self._scale > self.rescale_at:
            self._values = {key: v for key, v in self.items() if v >= self.forgotten}
            self._scale = 1.0

    def add(self, key: K, amount: float) -> None:
        """``amount`` more under ``key``, counted whole now."""
        self._values[key] = self._values.get(key, 0.0) + amount * self._scale

    def value(self, key: K) -> float:
        """The decayed amount under ``key`` (0 for one never added or forgotten)."""
        return self._values.get(key, 0.0) / self._scale

    def items(self) -> Iterator[tuple[K, float]]:
        """Every key kept, with its decayed amount."""
        scale = self._scale
        return ((key, v / scale) for key, v in self._values.items())

    def scaled(self, keys: Sequence[K]) -> np.ndarray:
        """The values of ``keys`` in their order, scaled alike: for comparing only."""
        get = self._values.get
        return np.fromiter((get(key, 0.0) for key in keys), np.float64, len(keys))

    def check(self) -> None:
        assert self._scale >= 1.0 and math.isfinite(self._scale)
        assert all(v > 0.0 and math.isfinite(v) for v in self._values.values())
