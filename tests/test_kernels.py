"""The engine's kernels: right (against pure torch) and batch-invariant (bit for bit).

``replica/model/kernels/`` has, for attention and for linear layers, two implementations of
one arithmetic (AVX-512 and portable); they must agree bitwise (the portable one is the
vector one's reference), both must equal float64 maths up to rounding, and a query's or a
row's output must not depend on what else is in the call. The fused layer steps (norms,
SiLU, rotary) must equal their torch references and be per-row too.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from replica.checkpoints import SMOLLM2, checkpoint_for
from replica.model import kernels
from replica.model.attention import (
    KVCache,
    build_metadata,
    kernel_attention,
    reference_attention,
    reference_write_kv,
)
from replica.model.llama import RMSNorm, RotaryEmbedding, rotate_

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler here")

HEADS, KV_HEADS, DIM, LAYERS = 9, 3, 64, 2
DTYPES = [torch.float32, torch.bfloat16]
ops = torch.ops.prefix_serve


def make_cache(dtype: torch.dtype, block_size: int, num_blocks: int = 96) -> KVCache:
    cache = KVCache(LAYERS, num_blocks, block_size, KV_HEADS, DIM, dtype)
    cache.data.copy_(torch.randn(cache.data.shape, generator=torch.Generator().manual_seed(1)))
    return cache


def tables_for(spans: list[tuple[int, int]], block_size: int, seed: int = 0) -> list[list[int]]:
    """Disjoint random block tables long enough for each span's context."""
    free = list(range(1, 96))
    random.Random(seed).shuffle(free)
    tables = []
    for first, n in spans:
        need = -(-(first + n) // block_size)
        tables.append([free.pop() for _ in range(need)])
    return tables


def attend(q, cache, layer, meta, vector: bool = True) -> torch.Tensor:
    return kernel_attention(q, cache, layer, meta, DIM**-0.5, vector)


MIXED_STEP = [(0, 40), (30, 1), (20, 10), (47, 1), (16, 1)]  # (first position, tokens)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 4])
def test_write_kv_matches_the_torch_reference(dtype, block_size) -> None:
    ours, theirs = make_cache(dtype, block_size), make_cache(dtype, block_size)
    tables = tables_for(MIXED_STEP, block_size)
    meta = build_metadata(block_size, tables, MIXED_STEP, use_kernel=True)
    tokens = len(meta.slot_mapping)
    k, v = torch.randn(2, tokens, KV_HEADS, DIM).to(dtype)
    ops.write_kv(ours.data, 1, k, v, meta.slot_mapping)
    reference_write_kv(theirs, 1, k, v, meta.slot_mapping)
    assert torch.equal(ours.data, theirs.data)
    blocks = meta.slot_mapping // block_size
    assert torch.equal(
        ours.keys(1, blocks)[meta.slot_mapping % block_size + torch.arange(tokens) * block_size], k
    )


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64])
@pytest.mark.parametrize("block_size", [16, 4])
def test_attention_matches_a_float64_softmax(dtype, block_size) -> None:
    cache = make_cache(dtype, block_size)
    tables = tables_for(MIXED_STEP, block_size)
    meta = build_metadata(block_size, tables, MIXED_STEP, use_kernel=True)
    q = torch.randn(len(meta.query_seq), HEADS, DIM).to(dtype)
    exact = KVCache(LAYERS, 96, block_size, KV_HEADS, DIM, torch.float64)
    exact.pack = cache.pack  # the same layout, read in float64
    exact.data = cache.data.double()
    want = reference_attention(q.double(), exact, 1, meta, DIM**-0.5)
    got = attend(q, cache, 1, meta)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float64: 1e-12}[dtype]
    assert (got.double() - want).abs().max() < tolerance
    torch_path = reference_attention(q, cache, 1, meta, DIM**-0.5)  # the engine's fallback
    assert (torch_path.double() - want).abs().max() < tolerance


@pytest.mark.parametrize("dtype", DTYPES)
def test_vector_and_portable_kernels_agree_bit_for_bit(dtype) -> None:
    """Including values near the bottom of float's range, where VDPBF16PS flushes
    subnormals (the portable code does the same)."""
    cache = make_cache(dtype, 16)
    tiny = cache.data[10:20] * 1e-19  # products of these are subnormal
    cache.data[10:20] = tiny.to(dtype)
    spans = [(0, 40), (30, 1), (100, 1), (20, 10)]
    tables = tables_for(spans, 16, seed=3)
    tables[2][:6] = list(range(10, 16))  # a query over the tiny blocks
    meta = build_metadata(16, tables, spans, use_kernel=True)
    q = torch.randn(len(meta.query_seq), HEADS, DIM).to(dtype)
    q[40] *= 1e-19
    assert torch.equal(attend(q, cache, 0, meta, vector=True), attend(q, cache, 0, meta, False))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 4])
def test_a_query_gives_the_same_bits_alone_or_among_32(dtype, block_size) -> None:
    """32 rows of one prompt chunk in one call (M = 32), each row again alone as a decode
    (M = 1), and again beside other sequences sharing its first blocks: identical bits."""
    cache = make_cache(dtype, block_size)
    (table,) = tables_for([(0, 70)], block_size, seed=5)
    q = torch.randn(70, HEADS, DIM).to(dtype)
    chunk = build_metadata(block_size, [table], [(38, 32)], use_kernel=True)
    together = attend(q[38:], cache, 0, chunk)
    others = tables_for([(0, 80)] * 3, block_size, seed=6)
    for row in range(32):
        pos = 38 + row
        used = table[: pos // block_size + 1]
        alone = build_metadata(block_size, [used], [(pos, 1)], use_kernel=True)
        assert torch.equal(attend(q[pos : pos + 1], cache, 0, alone)[0], together[row])
        # among decodes whose tables share its first blocks and differ after
        shared = [used[:2] + t[2 : len(used)] for t in others] + [used]
        crowd = build_metadata(block_size, shared, [(pos, 1)] * 4, use_kernel=True)
        queries = torch.cat([torch.randn(3, HEADS, DIM).to(dtype), q[pos : pos + 1]])
        assert torch.equal(attend(queries, cache, 0, crowd)[3], together[row])


@pytest.fixture(scope="module")
def smollm2_linears() -> dict[str, torch.Tensor]:
    state = checkpoint_for(SMOLLM2).state_dict()
    layer = "model.layers.3."
    return {
        "qkv": torch.cat([state[f"{layer}self_attn.{p}_proj.weight"] for p in "qkv"]),
        "o": state[f"{layer}self_attn.o_proj.weight"],
        "gate_up": torch.cat([state[f"{layer}mlp.{p}_proj.weight"] for p in ("gate", "up")]),
        "down": state[f"{layer}mlp.down_proj.weight"],
        "lm_head": state["model.embed_tokens.weight"],
    }


def packed(weight: torch.Tensor) -> torch.Tensor:
    return ops.pack_linear(weight.contiguous())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["qkv", "o", "gate_up", "down", "lm_head"])
def test_a_linear_rows_bits_do_not_depend_on_the_number_of_rows(
    smollm2_linears, name, dtype
) -> None:
    weight = smollm2_linears[name].to(dtype)
    w = packed(weight)
    n = weight.shape[0]
    x = torch.randn(300, weight.shape[1], generator=torch.Generator().manual_seed(2)).to(dtype)
    batch = ops.linear(x[:32], w, n)
    for row in range(32):
        assert torch.equal(ops.linear(x[row : row + 1], w, n)[0], batch[row]), row
    assert torch.equal(ops.linear(x, w, n)[:32], batch)  # and a 300-row call (a prefill chunk)
    want = x[:32].double() @ weight.double().T
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 3e-2}[dtype]
    assert ((batch.double() - want).abs() / (want.abs() + 1)).max() < tolerance


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_vector_and_portable_kernels_agree_bit_for_bit(dtype) -> None:
    """Odd shapes (a partial panel, a row count that is no multiple of the micro-kernel's),
    and values whose products are subnormal, which VDPBF16PS flushes."""
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(200, 96, generator=gen).to(dtype)
    x = torch.randn(13, 96, generator=gen).to(dtype)
    x[3] *= 1e-20
    w = packed(weight)
    assert torch.equal(ops.linear(x, w, 200, True), ops.linear(x, w, 200, False))


def test_the_fused_layer_steps_equal_their_torch_references() -> None:
    """Rotary bit for bit (the same bfloat16 roundings at the same points); the norms and
    SiLU within a bfloat16 unit (a sum of squares and an exp in another order); and every
    row the same alone or among 64."""
    gen = torch.Generator().manual_seed(5)
    dt = torch.bfloat16
    norm = RMSNorm(576, 1e-5).to(dt)
    norm.weight.data.copy_(torch.rand(576, generator=gen) + 0.5)
    x = torch.randn(64, 576, generator=gen).to(dt)
    residual = torch.randn(64, 576, generator=gen).to(dt)
    assert close(norm(x, fused=True), norm(x))
    fused_res, torch_res = residual.clone(), residual.clone()
    assert close(norm.add_forward(fused_res, x, True), norm.add_forward(torch_res, x, False))
    assert torch.equal(fused_res, torch_res)  # the residual add rounds once, as torch's does
    for row in (0, 17, 63):
        assert torch.equal(norm(x[row : row + 1], fused=True)[0], norm(x, fused=True)[row])
    gate_up = torch.randn(64, 2 * 1536, generator=gen).to(dt) * 4
    gate, up = gate_up.split(1536, dim=-1)
    assert close(ops.silu_mul(gate_up), F.silu(gate) * up)
    assert torch.equal(ops.silu_mul(gate_up[5:6])[0], ops.silu_mul(gate_up)[5])
    rotary = RotaryEmbedding(64, 4096, 100000.0)
    cos, sin = rotary.at(torch.arange(100, 164), dt)
    qk = torch.randn(64, 12, 64, generator=gen).to(dt)
    ours, theirs = qk.clone(), qk.clone()
    rotate_(ours, cos, sin, fused=True)
    rotate_(theirs, cos, sin, fused=False)
    assert torch.equal(ours, theirs)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within one bfloat16 unit in the last place, relative to the values' size."""
    return bool(((a.float() - b.float()).abs() <= 2**-7 * b.float().abs() + 1e-6).all())
