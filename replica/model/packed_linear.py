"""Linear layers with weights packed once, for the engine's own matrix kernel.

``kernels/linear.cpp`` computes every output as one accumulator walked over the input in
order, so a row's result never depends on how many rows share the call (the batch), and it
streams each weight once for the few rows of a decode step. Its weights are packed at load
time into panels of 64 outputs. Where the kernels could not be built (and determinism was
not asked for), the layers fall back to oneDNN with its own packed weights, which is fast
but not batch-invariant. The packed weight replaces the original, so memory does not grow.
The reference is ``torch.nn.functional.linear``; the tests compare the two.
"""

from __future__ import annotations

import torch
from torch import nn

KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_ONEDNN_BATCH_HINT = 32  # oneDNN picks its blocking for about this many rows


class PackedLinear(nn.Module):
    """``y = x @ W^T + b`` (2-D inputs, the bias optional) with W packed for the engine's
    kernel, or for oneDNN (``kernel`` false). The kernel's bias is added to its rounded
    output (an elementwise add: batch-invariant too)."""

    def __init__(self, linear: nn.Linear, kernel: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernel = kernel
        weight = linear.weight.detach().contiguous()
        self.bias = linear.bias
        if kernel:
            self.packed = torch.ops.prefix_serve.pack_linear(weight)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, _ONEDNN_BATCH_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            out = torch.ops.prefix_serve.linear(x, self.packed, self.out_features)
            return out if self.bias is None else out.add_(self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module, kernel: bool) -> int:
    """Replace the float32 and bfloat16 linear layers of ``model`` by packed ones
    (the engine's kernel, or oneDNN where ``kernel`` is false and oneDNN is there); returns
    how many were replaced."""
    if not kernel and not torch.backends.mkldnn.is_available():
        return 0
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and child.weight.dtype in KERNEL_DTYPES
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, kernel))
    return len(targets)
