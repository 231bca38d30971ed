"""What this CPU computes fast: ``dtype: auto`` serves bfloat16 where matrix products in it
are native (AMX or AVX-512 BF16), float32 elsewhere (emulated bfloat16 is slow). The
measured ratio on this project's machines is in docs/decisions.md."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

_NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@functools.cache
def native_bfloat16() -> bool:
    """Whether /proc/cpuinfo lists a native bfloat16 matrix instruction set (Linux)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return any(flag in flags for flag in _NATIVE_BF16_FLAGS)


def resolve_dtype(name: str) -> torch.dtype:
    """The torch dtype for ``EngineConfig.dtype`` (``auto`` decided by this CPU)."""
    if name == "auto":
        return torch.bfloat16 if native_bfloat16() else torch.float32
    return DTYPES[name]
