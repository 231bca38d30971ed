"""`python -m replica.model.kernels`: build the kernels for this machine (`make install`).

`python -m replica.model.kernels bench`: the linear kernel's paths timed on this CPU (JSON).
One SmolLM2-135M decoder layer's linears (qkv 576->960, o 576->576, gate_up 576->3072, down
1536->576) in ``--layers`` copies, run in turn as a step runs them, so that the weights stream
from memory as in the engine (8 copies outgrow a 32 MiB L3 even in bfloat16). For each row
count: float32 and bfloat16 on the vector path this build has (``linear_path``) and bfloat16
on the portable one, their samples interleaved so that a busy machine slows all alike; per
layer, the median and the spread (min, max) of ``--repeats`` samples, and the ratios of the
medians. The numbers behind the engine's log line for bfloat16 without native bfloat16
(``replica/model/cpu.py``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from replica.model import kernels

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
CONFIGS = {  # name: (dtype, vector path)
    "float32": (torch.float32, True),
    "bfloat16": (torch.bfloat16, True),
    "bfloat16_portable": (torch.bfloat16, False),
}
Layers = list[dict[str, torch.Tensor]]  # per layer copy: its packed weights by name


def _layers(count: int, dtype: torch.dtype) -> Layers:
    gen = torch.Generator().manual_seed(0)
    pack = torch.ops.prefix_serve.pack_linear
    return [
        {
            name: pack((torch.randn(n, k, generator=gen) * 0.02).to(dtype))
            for name, (n, k) in SHAPES.items()
        }
        for _ in range(count)
    ]


def _sample_us(layers: Layers, xs: dict[int, torch.Tensor], vector: bool) -> float:
    """One pass over every layer's linears; microseconds per layer."""
    start = time.perf_counter()
    for layer in layers:
        for name, (n, k) in SHAPES.items():
            torch.ops.prefix_serve.linear(xs[k], layer[name], n, vector)
    return (time.perf_counter() - start) / len(layers) * 1e6


def _summary(samples: list[float]) -> dict[str, float]:
    return {
        "median_us": round(statistics.median(samples), 1),
        "min_us": round(min(samples), 1),
        "max_us": round(max(samples), 1),
    }


def measure(
    rows: int, weights: dict[torch.dtype, Layers], repeats: int, portable_repeats: int
) -> dict[str, object]:
    """Every config at ``rows`` rows, samples interleaved; medians, spreads and ratios."""
    gen = torch.Generator().manual_seed(1)
    x = {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in SHAPES.values()}}
    samples: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for i in range(-1, repeats):  # -1: a warm-up round, not kept
        for name, (dtype, vector) in CONFIGS.items():
            if vector or 0 <= i < portable_repeats:
                # the portable path is slow: fewer samples, over one layer
                used = weights[dtype] if vector else weights[dtype][:1]
                xs = {k: v.to(dtype) for k, v in x.items()}
                sample = _sample_us(used, xs, vector)
                if i >= 0:
                    samples[name].append(sample)
    out: dict[str, object] = {name: _summary(s) for name, s in samples.items()}
    med = {name: statistics.median(s) for name, s in samples.items()}
    out["bfloat16_over_float32"] = round(med["bfloat16"] / med["float32"], 2)
    out["portable_over_vector_bfloat16"] = round(med["bfloat16_portable"] / med["bfloat16"], 1)
    return out


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def bench(argv: list[str]) -> None:
    """Time the linear kernel's paths at each row count; JSON on stdout."""
    parser = argparse.ArgumentParser(prog="python -m replica.model.kernels bench")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--portable-repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    kernels.load()
    torch.set_num_threads(args.threads)
    ops = torch.ops.prefix_serve
    weights = {dt: _layers(args.layers, dt) for dt in (torch.float32, torch.bfloat16)}
    report: dict[str, object] = {
        "cpu": _cpu_model(),
        "threads": args.threads,
        "layers": args.layers,
        "repeats": args.repeats,
        "paths": {str(dt): ops.linear_path(dt) for dt in (torch.float32, torch.bfloat16)},
        "per_layer": {
            str(rows): measure(rows, weights, args.repeats, args.portable_repeats)
            for rows in args.rows
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    if sys.argv[1:2] == ["bench"]:
        bench(sys.argv[2:])
    else:
        print(kernels.build())
        sys.exit(0 if kernels.available() else 1)
