"""What each served family's ``config.json`` (or GGUF metadata) switches on in the shape, and
what is refused by name rather than served wrong.

Llama 3's rotary scaling becomes one factor per frequency (``llama3_freq_factors``), the
form llama.cpp stores in a GGUF file's ``rope_freqs`` tensor, so both formats reach the
model the same way. Qwen2 always has Q/K/V biases; Qwen3 always normalizes Q and K per head
and may name a head size other than hidden / heads.
"""

from __future__ import annotations

import math
import struct
from typing import Any

from replica.checkpoints.shape import ARCHITECTURES

# model_type -> the switches it implies, before the config's own fields
FAMILY_SWITCHES: dict[str, dict[str, bool]] = {
    "llama": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
}
_REFUSED_KINDS = {
    "moe": "mixture-of-experts models are not served",
    "vision": "multimodal models are not served (text-only decoders are)",
}


def refusal(config: dict[str, Any]) -> str | None:
    """Why a Hugging Face config cannot be served exactly, or None. Every reason names the
    feature, so a user reads what to change rather than a shape error."""
    model_type = str(config.get("model_type", "llama"))
    if "moe" in model_type or config.get("num_experts") or config.get("num_local_experts"):
        return f"a '{model_type}' model: {_REFUSED_KINDS['moe']}"
    if "vision_config" in config or "vl" in model_type.split("_") or "mllama" in model_type:
        return f"a '{model_type}' model: {_REFUSED_KINDS['vision']}"
    if model_type not in ARCHITECTURES:
        return f"a '{model_type}' model; the served architectures are {', '.join(ARCHITECTURES)}"
    if config.get("use_sliding_window") or (model_type == "llama" and config.get("sliding_window")):
        return "sliding-window attention is not served (set use_sliding_window false)"
    if model_type != "qwen2" and config.get("attention_bias"):
        return "attention_bias (biases on every attention projection) is not served"
    if config.get("mlp_bias"):
        return "mlp_bias is not served"
    if config.get("hidden_act", "silu") != "silu":
        return f"hidden_act '{config['hidden_act']}' is not served (SwiGLU with silu is)"
    rope = rope_parameters(config)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        return f"rope_type '{kind}' is not served (default and llama3 are)"
    return None


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """The rotary settings: transformers 5 writes ``rope_parameters``, older versions
    ``rope_scaling`` beside a top-level ``rope_theta``."""
    rope = dict(config.get("rope_scaling") or {})
    rope.update(config.get("rope_parameters") or {})
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return rope


def freq_factors(config: dict[str, Any], head_dim: int) -> tuple[float, ...] | None:
    """Per-frequency divisors for the config's rotary scaling (None where it has none)."""
    rope = rope_parameters(config)
    if rope.get("rope_type", rope.get("type", "default")) != "llama3":
        return None
    return llama3_freq_factors(
        head_dim,
        float(rope["rope_theta"]),
        factor=float(rope["factor"]),
        low=float(rope["low_freq_factor"]),
        high=float(rope["high_freq_factor"]),
        original_context=int(rope["original_max_position_embeddings"]),
    )


def llama3_freq_factors(
    head_dim: int, theta: float, factor: float, low: float, high: float, original_context: int
) -> tuple[float, ...]:
    """Llama 3's scaling as divisors: wavelengths shorter than ``original_context / high``
    keep their frequency, longer than ``original_context / low`` are slowed by ``factor``,
    and those between blend the two smoothly (Meta's reference and transformers'
    ``_compute_llama3_parameters`` compute the same frequencies)."""
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original_context / high:
            factors.append(1.0)
        elif wavelen > original_context / low:
            factors.append(factor)
        else:
            smooth = (original_context / wavelen - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(_float32(f) for f in factors)


def _float32(x: float) -> float:
    """``x`` rounded to float32, as a GGUF file stores the factors: both formats of one model
    then rotate by bitwise the same angles."""
    return struct.unpack("<f", struct.pack("<f", x))[0]
