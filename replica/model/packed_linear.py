"""Linear layers on oneDNN with weights reordered once, and rows that never depend on the batch.

Speed: ``torch.nn.functional.linear`` hands the weight to oneDNN in PyTorch's layout on every
call; reordering it once into oneDNN's blocked layout (what vLLM's CPU build and
torch.compile's weight freezing do) makes the matrix products faster (docs/decisions.md).

Invariance: a row's result must not depend on how many rows share the call, or a request's
tokens would depend on what else runs in its step. oneDNN picks its kernel by the number of
rows M; on the machines measured, every M >= 2 reduces each row in the same order, but M = 1
takes a matrix-vector kernel that adds in another order (1 output in ~3,000 differs in its
last bit for SmolLM2's 1,536-wide down projection). So each layer is probed when it is packed:
``min_rows`` is the fewest rows from which every tested M gives bitwise the rows of a 256-row
call, and a call with fewer rows is padded to it. The probe runs on this CPU with this oneDNN
and thread count, so a machine whose kernels differ gets its own answer or a clear error.
"""

from __future__ import annotations

import torch
from torch import nn

_BATCH_HINT = 32  # oneDNN picks its blocking for about this many rows; any number works
_PROBE_ROWS = 256
_PROBE_COUNTS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64)
_CANDIDATE_MIN_ROWS = (1, 2, 4, 8, 16, 32)
PACKED_DTYPES = (torch.float32, torch.bfloat16)


class RowVariantError(RuntimeError):
    """No row count makes this CPU's matrix products independent of the batch."""


class PackedLinear(nn.Module):
    """``y = x @ W^T`` with W reordered for oneDNN (2-D inputs, no bias); calls with fewer
    than ``min_rows`` rows are padded with zero rows (invariance; see the module doc)."""

    def __init__(self, linear: nn.Linear, min_rows: int = 1) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_HINT)
        self.min_rows = min_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows < self.min_rows:
            pad = x.new_zeros(self.min_rows - rows, x.shape[1])
            return self._product(torch.cat([x, pad]))[:rows]
        return self._product(x)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


def invariant_min_rows(layer: PackedLinear, seed: int = 0) -> int:
    """The fewest rows per call from which each row's result is bitwise the same for every
    tested row count (the module doc); raises ``RowVariantError`` if none up to 32 is."""
    gen = torch.Generator().manual_seed(seed)
    dtype = layer.packed.dtype
    x = torch.randn(_PROBE_ROWS, layer.in_features, generator=gen).to(dtype)
    reference = layer._product(x)
    for min_rows in _CANDIDATE_MIN_ROWS:
        layer.min_rows = min_rows
        if all(_rows_match(layer, x, reference, count) for count in _PROBE_COUNTS):
            return min_rows
    raise RowVariantError(
        f"a {layer.in_features}x{layer.out_features} {dtype} matrix product gives a row "
        "different bits depending on the batch at every padding tried; serve with "
        "deterministic: false on this machine"
    )


def _rows_match(layer: PackedLinear, x: torch.Tensor, reference: torch.Tensor, count: int) -> bool:
    span = max(count, 64)
    return all(
        torch.equal(layer(x[i : i + count]), reference[i : i + count])
        for i in range(0, span, count)
    )


def pack_linears(model: nn.Module, invariant: bool) -> int:
    """Replace the bias-free float32 and bfloat16 linear layers of ``model`` by packed ones
    where oneDNN is available; with ``invariant``, each distinct shape is probed for its
    ``min_rows``. Returns how many were replaced."""
    if not torch.backends.mkldnn.is_available():
        if invariant:
            raise RowVariantError("deterministic serving needs oneDNN (torch built without it)")
        return 0
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
        and child.bias is None
        and child.weight.dtype in PACKED_DTYPES
    ]
    probed: dict[tuple[int, int, torch.dtype], int] = {}
    for parent, name, child in targets:
        packed = PackedLinear(child)
        if invariant:
            key = (child.in_features, child.out_features, child.weight.dtype)
            if key not in probed:
                probed[key] = invariant_min_rows(packed)
            packed.min_rows = probed[key]
        setattr(parent, name, packed)
    return len(targets)
