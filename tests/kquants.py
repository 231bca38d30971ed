"""Numpy quantizers for the GGUF K-quant types Q4_K, Q5_K and Q6_K, for building test models.

`gguf` (0.19) can dequantize these types but raises NotImplementedError when asked to quantize
them, so tests that need K-quantized GGUF files use `quantize_k` here. The byte layouts are the
exact inverses of `gguf.quants.Q4_K/Q5_K/Q6_K.dequantize_blocks`, which are the reference:
`gguf.quants.dequantize(quantize_k(w, kind), kind)` approximates `w`.

The quantization is simple, not llama.cpp's iterative search: each sub-block's scale (and min)
comes from its own range (32 values for Q4_K/Q5_K, 16 for Q6_K, as the formats define), the
sub-block scales/mins are quantized against the super-block's f16 `d` (and `dmin`), rounded away
from zero so that no value clips, and the values are then rounded to nearest against the scales
actually stored. Magnitudes beyond what an f16 `d` can scale (about 1e6) saturate, finitely.
The result is `uint8` shaped like `gguf.quants.quantize` output, ready for
`GGUFWriter.add_tensor(name, data, raw_dtype=kind)`.
"""

from __future__ import annotations

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType

_F16_MAX = float(np.finfo(np.float16).max)


def _f16_up(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Round `x` (n, 1) up to float16, so the stored value is never below `x`.

    Returns (value as float32, little-endian bytes (n, 2)); saturates at the f16 maximum.
    """
    x = np.minimum(x, _F16_MAX)
    h = x.astype("<f2")
    with np.errstate(over="ignore"):  # nextafter(f16 max) is inf; np.where never picks it
        h = np.where(h.astype(np.float32) < x, np.nextafter(h, np.float16(np.inf)), h)
    h = h.astype("<f2")
    return h.astype(np.float32), h.view(np.uint8).reshape(-1, 2)


def _div(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den, with 0 wherever den is 0 (broadcasting)."""
    num, den = np.broadcast_arrays(num, den)
    return np.divide(num, den, out=np.zeros(num.shape, np.float32), where=den != 0)


def _pack_scale_min(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Pack 8 six-bit scales and mins per block (n, 8) into the 12-byte K_SCALE layout.

    Inverse of `gguf.quants.Q4_K.get_scale_min`: bytes 0-3 hold sc[0:4] plus the top two bits
    of sc[4:8], bytes 4-7 the same for the mins, bytes 8-11 the low nibbles of sc/mn[4:8].
    """
    lo_sc, hi_sc = sc[:, :4], sc[:, 4:]
    lo_mn, hi_mn = mn[:, :4], mn[:, 4:]
    out = np.concatenate(
        [
            lo_sc | ((hi_sc >> 4) << 6),
            lo_mn | ((hi_mn >> 4) << 6),
            (hi_sc & 0x0F) | ((hi_mn & 0x0F) << 4),
        ],
        axis=1,
    )
    return out.astype(np.uint8)


def _quantize_scale_min(blocks: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Shared Q4_K/Q5_K step: blocks (n, 256) -> (header bytes (n, 16), q (n, 8, 32) uint8).

    Header is f16 d, f16 dmin and the packed 6-bit scales/mins; a value dequantizes as
    d * sc * q - dmin * m with q in [0, nmax].
    """
    x = blocks.reshape(-1, 8, 32)
    lo = np.minimum(x.min(axis=2), 0.0)  # the stored min offset is never positive
    hi = x.max(axis=2)
    # Round mins, then scales, away from zero so no value falls outside [0, nmax].
    dmin, dmin_bytes = _f16_up((-lo).max(axis=1, keepdims=True) / 63)
    mn = np.clip(np.ceil(_div(-lo, dmin)), 0, 63).astype(np.uint8)
    eff_min = dmin * mn  # (n, 8), >= -lo
    scale = (hi + eff_min) / nmax
    d, d_bytes = _f16_up(scale.max(axis=1, keepdims=True) / 63)
    sc = np.clip(np.ceil(_div(scale, d)), 0, 63).astype(np.uint8)
    eff_scale = (d * sc)[:, :, None]
    q = np.clip(np.rint(_div(x + eff_min[:, :, None], eff_scale)), 0, nmax).astype(np.uint8)
    header = np.concatenate([d_bytes, dmin_bytes, _pack_scale_min(sc, mn)], axis=1)
    return header, q


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Low nibbles of q (n, 8, 32): sub-block 2g in the low, 2g+1 in the high half of byte g."""
    q = (q & 0x0F).reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, QK_K // 2)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    header, q = _quantize_scale_min(blocks, 15)
    return np.concatenate([header, _pack_nibbles(q)], axis=1)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    header, q = _quantize_scale_min(blocks, 31)
    shifts = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    qh = ((q >> 4) << shifts).sum(axis=1, dtype=np.uint8)  # bit j of qh[l] = sub-block j
    return np.concatenate([header, qh, _pack_nibbles(q)], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K: 16 sub-blocks of 16 with int8 scales, one f16 d; q in [-32, 31] stored + 32."""
    x = blocks.reshape(-1, 16, 16)
    lo, hi = x.min(axis=2), x.max(axis=2)
    # q spans [-32, 31]: a positive scale puts lo at the 32-step end, a negative one hi.
    pos = np.maximum(-lo / 32, hi / 31)
    neg = np.maximum(hi / 32, -lo / 31)
    scale = np.where(pos <= neg, pos, -neg)
    d, d_bytes = _f16_up(np.abs(scale).max(axis=1, keepdims=True) / 127)
    # Round scales away from zero so no value falls outside [-32, 31].
    sc = np.clip(np.sign(scale) * np.ceil(_div(np.abs(scale), d)), -127, 127).astype(np.int8)
    eff_scale = (d * sc)[:, :, None]
    q = np.clip(np.rint(_div(x, eff_scale)), -32, 31).astype(np.int8)
    u = (q.astype(np.int16) + 32).astype(np.uint8).reshape(-1, QK_K)
    low = (u & 0x0F).reshape(-1, 2, 2, 64)  # [half, nibble, element]
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, QK_K // 2)
    high = (u >> 4).reshape(-1, 2, 4, 32)  # [half, 2-bit slot, element]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = (high << shifts).sum(axis=2, dtype=np.uint8).reshape(-1, QK_K // 4)
    return np.concatenate([ql, qh, sc.view(np.uint8), d_bytes], axis=1)


_QUANTIZERS = {
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}


def quantize_k(weights: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    """Quantize float weights to Q4_K, Q5_K or Q6_K bytes.

    `weights`' last dimension must be a multiple of 256. Returns uint8 shaped
    (*weights.shape[:-1], weights.shape[-1] // 256 * type_size), like `gguf.quants.quantize`.
    """
    if kind not in _QUANTIZERS:
        raise ValueError(f"quantize_k supports Q4_K, Q5_K and Q6_K, not {kind.name}")
    weights = np.asarray(weights, dtype=np.float32)
    if weights.ndim == 0 or weights.shape[-1] % QK_K:
        raise ValueError(f"last dimension must be a multiple of {QK_K}, got shape {weights.shape}")
    if not np.isfinite(weights).all():
        raise ValueError("weights must be finite")
    block_size, type_size = GGML_QUANT_SIZES[kind]
    blocks = weights.reshape(-1, block_size)
    out = _QUANTIZERS[kind](blocks)
    assert out.shape == (blocks.shape[0], type_size), out.shape
    return out.reshape(*weights.shape[:-1], weights.shape[-1] // block_size * type_size)
