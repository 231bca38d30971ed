"""How close a speed run is to the machine: prefill against the peak arithmetic of the path
that ran (tokens/s x FLOPs a token, over the cores' peak), decode at batch 1 against the
memory bandwidth measured on the spot (tokens/s x bytes read a token, over it).

The peaks are the cores' issue rates for the instruction each path is built on, times the
clock ``/proc/cpuinfo`` reports (a VM's nominal clock: turbo or throttling moves the real
one, so a fraction is an estimate to a few tens of percent, never a measurement of the
peak itself):
- ``amx``: one TDPBF16PS (16 x 16 x 32 bfloat16 products: 16,384 FLOPs) per 16 cycles, so
  1,024 FLOPs a cycle a core;
- ``avx512_bf16``: two 512-bit VDPBF16PS a cycle (64 FLOPs each: Intel's two FMA ports;
  AMD's Zen 4 issues one, so its fraction here is understated by up to 2x), 128;
- ``avx512``: two 16-lane FMAs a cycle, 64 (bfloat16 emulated: its pair step is two FMAs);
- ``avx2``: two 8-lane FMAs a cycle, 32;
- ``portable``: one scalar FMA a cycle, 2.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from replica.checkpoints.shape import ModelShape
from replica.model.cpu import resolve_dtype

FLOPS_PER_CYCLE = {"amx": 1024, "avx512_bf16": 128, "avx512": 64, "avx2": 32, "portable": 2}


def linear_weights(shape: ModelShape) -> int:
    """Weights of the decoder's linear layers (q, k, v, o, gate, up, down), all layers."""
    h, d = shape.hidden_size, shape.head_dim
    attention = h * (shape.num_heads * d) * 2 + h * (shape.num_kv_heads * d) * 2
    mlp = 3 * h * shape.intermediate_size
    return shape.num_layers * (attention + mlp)


def prefill_flops_per_token(shape: ModelShape, prompt_tokens: int) -> float:
    """FLOPs a prompt token costs in a prefill of ``prompt_tokens`` (causal: a token attends
    to (n + 1) / 2 positions on average); the logits are the last token's only."""
    linears = 2 * linear_weights(shape)
    context = (prompt_tokens + 1) / 2
    attention = shape.num_layers * 2 * 2 * shape.num_heads * shape.head_dim * context
    logits = 2 * shape.vocab_size * shape.hidden_size / prompt_tokens
    return linears + attention + logits


def decode_bytes_per_token(shape: ModelShape, dtype: torch.dtype, context: int) -> float:
    """Bytes a decode step at batch 1 reads: every linear weight, the output projection
    (the vocabulary's rows), and the keys and values of ``context`` positions."""
    size = torch.finfo(dtype).bits // 8
    weights = linear_weights(shape) + shape.vocab_size * shape.hidden_size
    kv = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * context
    return (weights + kv) * size


def clock_hz(cpuinfo: str | None = None) -> float:
    """The highest clock ``/proc/cpuinfo`` reports (its "cpu MHz" lines)."""
    text = cpuinfo if cpuinfo is not None else Path("/proc/cpuinfo").read_text()
    mhz = [float(line.split(":")[1]) for line in text.splitlines() if line.startswith("cpu MHz")]
    if not mhz:
        raise ValueError("no 'cpu MHz' in /proc/cpuinfo")
    return max(mhz) * 1e6


def peak_flops(path: str, threads: int, hz: float) -> float:
    return FLOPS_PER_CYCLE[path] * threads * hz


def read_bandwidth(threads: int, mib: int = 1024, repeats: int = 5) -> float:
    """Bytes a second ``threads`` threads read: the best of ``repeats`` sums of ``mib`` MiB
    (a sum reads every byte once and writes nothing)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        data = torch.ones(mib * 2**20 // 4)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            data.sum()
            best = min(best, time.perf_counter() - start)
        return data.numel() * 4 / best
    finally:
        torch.set_num_threads(before)


def machine_fractions(
    shape: ModelShape,
    dtype: torch.dtype,
    path: str,
    threads: int,
    prefill: tuple[int, float],
    decode_b1: tuple[int, float] | None,
) -> dict[str, Any]:
    """``prefill``: (prompt tokens, tokens/s); ``decode_b1``: (context, tokens/s) of a
    decode at batch 1. The fractions of peak and of bandwidth, and what they are of."""
    hz = clock_hz()
    peak = peak_flops(path, threads, hz)
    tokens, rate = prefill
    out = {
        "path": path,
        "clock_ghz": hz / 1e9,
        "peak_gflops": peak / 1e9,
        "prefill_gflops": rate * prefill_flops_per_token(shape, tokens) / 1e9,
    }
    out["prefill_of_peak"] = out["prefill_gflops"] * 1e9 / peak
    if decode_b1 is not None:
        context, rate = decode_b1
        bandwidth = read_bandwidth(threads)
        out["bandwidth_gb_s"] = bandwidth / 1e9
        out["decode_b1_gb_s"] = rate * decode_bytes_per_token(shape, dtype, context) / 1e9
        out["decode_b1_of_bandwidth"] = out["decode_b1_gb_s"] * 1e9 / bandwidth
    return out


def of_speed_run(
    shape: ModelShape,
    dtype_name: str,
    threads: int,
    prefill_tokens: int,
    b1_context: int,
    ours: dict[str, Any],
) -> dict[str, Any]:
    """``machine_fractions`` of a ``speed`` run's medians of our engine (in this process, so
    ``linear_path`` names the path that ran)."""
    dtype = resolve_dtype(dtype_name)
    path = str(torch.ops.prefix_serve.linear_path(dtype))
    prefill = (prefill_tokens, ours["prefill_tokens_per_s"]["median"])
    b1 = ours.get("decode_tokens_per_s_b1")
    decode = (b1_context, b1["median"]) if b1 else None
    return machine_fractions(shape, dtype, path, threads, prefill, decode)
