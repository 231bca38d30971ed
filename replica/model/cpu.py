"""What this CPU computes fast: ``dtype: auto`` serves bfloat16 where matrix products in it
are native (AMX or AVX-512 BF16), float32 elsewhere. Where it is not native, bfloat16 runs
emulated (the kernels' pair step as float32 FMAs); what that measured, and why ``auto``
still picks float32 there, is in docs/decisions.md."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}

# Measured on an AMD EPYC with AVX2 and FMA, no AVX-512 (2 cores, 2 threads): the kernels'
# emulated bfloat16 against float32, SmolLM2-135M. Linear layers (``python -m
# replica.model.kernels bench``: weights streamed, medians of 15): 0.54x float32's time at 1
# row, 0.61x at 8, 0.59x at 32, 0.95x at 256 (halving the weights' bytes pays for the
# emulation); greedy generation (Engine.generate, medians of 5, interleaved): 0.70x a batch-1
# decode, 0.80x batch 8, 0.95x a 512-token prefill. Not measured: AVX-512F without AVX-512
# BF16, and oneDNN's emulation (deterministic: false without the kernels).
EMULATED_BFLOAT16 = (
    "dtype: bfloat16 on a CPU without native bfloat16 (AMX or AVX-512 BF16): its products "
    "are emulated here with float32 FMAs, bit for bit as AVX-512 BF16 computes them. On an "
    "AVX2 AMD EPYC this measured no slower than float32 (0.5-1.0x float32's time in "
    "SmolLM2's linear layers, 0.7-0.95x in greedy generation); this CPU is not measured. "
    "dtype: auto picks float32 here"
)


@functools.cache
def native_bfloat16() -> bool:
    """Whether /proc/cpuinfo lists a native bfloat16 matrix instruction set (Linux)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return any(flag in flags for flag in _NATIVE_BF16_FLAGS)


def resolve_dtype(name: str) -> torch.dtype:
    """The torch dtype for ``EngineConfig.dtype`` (``auto`` decided by this CPU); an explicit
    ``bfloat16`` without native bfloat16 is logged, once a process (``EMULATED_BFLOAT16``)."""
    if name == "auto":
        return torch.bfloat16 if native_bfloat16() else torch.float32
    if name == "bfloat16" and not native_bfloat16():
        _warn_emulated_bfloat16()
    return DTYPES[name]


@functools.cache
def _warn_emulated_bfloat16() -> None:
    log.warning(EMULATED_BFLOAT16)
