"""The engine's kernels: right (against pure torch) and batch-invariant (bit for bit).

``replica/model/kernels/`` has, for attention and for linear layers, a vector implementation
(AVX-512, with or without AVX-512 BF16, or AVX2) and a portable one of one arithmetic; they
must agree bitwise (the portable one is the vector one's reference), down to the subnormals
that bfloat16's pair step flushes, both must equal float64 maths up to rounding, and a
query's or a row's output must not depend on what else is in the call. The fused layer steps
(norms, SiLU, rotary) must equal their torch references and be per-row too.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from replica.checkpoints import SMOLLM2, checkpoint_for
from replica.checkpoints.shape import ModelShape
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
FLT_MIN = torch.finfo(torch.float32).tiny  # float32's smallest normal, 2^-126
CPU_FLAGS = set(kernels._cpu_flags().split())


def subnormal_share(exact: torch.Tensor) -> float:
    """The share of float64 values that float32 holds only as subnormals (nonzero, below
    FLT_MIN): what a test of the flushes must really contain."""
    magnitude = exact.abs()
    return ((magnitude > 0) & (magnitude < FLT_MIN)).double().mean().item()


def pair_order(k: int) -> torch.Tensor:
    """The order bfloat16's pair step walks k inputs: 1, 0, 3, 2, ..."""
    return torch.arange(k).view(-1, 2).flip(1).reshape(-1)


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


def tiny_context(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A query (heads x dim) and 96 keys and values (tokens x KV heads x dim) built so that
    every flush of bfloat16's pair step shows in the output:
    - q heads 0-2 (~1e-20) with KV head 0's keys (~1e-20): products ~1e-40, subnormal, and
      so are their partial sums; q heads 3-5 (~1e-18) with KV head 1's: ~1e-38, either side
      of FLT_MIN;
    - q heads 6-8's first 32 dims are subnormal (~1e-39), KV head 2's keys there ~1e37:
      products ~1e-2 in the scores, unless the inputs are read as zero;
    - KV head 0's values ~1e-38 (either side of FLT_MIN); KV head 1's subnormal and
      positive (~1e-39), so their weighted mean survives as a bfloat16 subnormal, unless the
      inputs are read as zero (then heads 3-5 output exact zeros)."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(HEADS, DIM, generator=gen, dtype=torch.float64)
    k, v = torch.randn(2, 96, KV_HEADS, DIM, generator=gen, dtype=torch.float64)
    q[:3] *= 1e-20
    q[3:6] *= 1e-18
    q[6:, :32] *= 1e-39
    k[:, :2] *= 1e-20
    k[:, 2, :32] *= 1e37
    v[:, 0] *= 1e-38
    v[:, 1] = v[:, 1].abs() * 1e-39
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_vector_and_portable_kernels_agree_bit_for_bit(dtype) -> None:
    """Including a query whose products with its keys, or whose inputs, or whose weights'
    products with its values are subnormal in float32 (``tiny_context``): bfloat16's pair
    step flushes them as VDPBF16PS does, float32's FMA keeps them. The test checks that they
    really are subnormal, and that the flushes show."""
    cache = make_cache(dtype, 16)
    spans = [(0, 40), (30, 1), (95, 1), (20, 10)]  # query 41 reads 96 keys, 6 blocks
    tables = tables_for(spans, 16, seed=3)  # disjoint: no other query reads query 41's
    meta = build_metadata(16, tables, spans, use_kernel=True)
    q = torch.randn(len(meta.query_seq), HEADS, DIM, generator=torch.Generator().manual_seed(8))
    q = q.to(dtype)
    q[41], k, v = tiny_context(dtype)
    blocks = torch.tensor(tables[2])
    reference_write_kv(cache, 0, k, v, (blocks[:, None] * 16 + torch.arange(16)).flatten())
    products = q[41].double()[:, None, :] * k.double()[:, torch.arange(HEADS) // 3].transpose(0, 1)
    partial = products[..., pair_order(DIM)].cumsum(-1)
    assert subnormal_share(products[:3]) > 0.9 and subnormal_share(partial[:3]) > 0.9
    assert 0.05 < subnormal_share(products[3:6]) < 0.95  # both sides
    assert subnormal_share(q[41, 6:, :32].double()) > 0.9
    assert subnormal_share(products[6:, :, :32]) == 0  # normal products of subnormal inputs
    assert 0.05 < subnormal_share(v[:, 0].double()) < 0.95
    assert subnormal_share(v[:, 1].double()) > 0.9
    vector = attend(q, cache, 0, meta, vector=True)
    assert torch.equal(vector, attend(q, cache, 0, meta, vector=False))
    if dtype == torch.bfloat16:  # subnormal values read as zero, or not
        assert not vector[41, 3:6].any()
    else:
        assert vector[41, 3:6].all()


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
    and rows whose products and partial sums are subnormal in float32, whose products
    straddle FLT_MIN, and whose inputs are subnormal: bfloat16's pair step flushes them as
    VDPBF16PS does, float32's FMA keeps them. The test checks that they really occur."""
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(200, 96, generator=gen)
    x = torch.randn(13, 96, generator=gen)
    weight[100:150] *= 1e-19  # x[7] (1e-19) with these: products ~1e-38, either side of FLT_MIN
    weight[150:] *= 1e-20  # x[3] (1e-20) with these: products ~1e-40, subnormal
    x[3] *= 1e-20
    x[7] *= 1e-19
    x[9] *= 1e-39  # subnormal inputs
    weight, x = weight.to(dtype), x.to(dtype)
    products = x.double()[:, None, :] * weight.double()[None, :, :]  # [rows, outputs, K]
    partial = products[..., pair_order(96)].cumsum(-1)
    assert subnormal_share(products[3, 150:]) > 0.9 and subnormal_share(partial[3, 150:]) > 0.9
    assert 0.05 < subnormal_share(products[7, 100:150]) < 0.95  # both sides
    assert subnormal_share(x[9].double()) > 0.9
    w = packed(weight)
    vector, portable = ops.linear(x, w, 200, True), ops.linear(x, w, 200, False)
    assert torch.equal(vector, portable)
    if dtype == torch.bfloat16:  # the flushes happened: those outputs are exactly zero
        assert not vector[3, 150:].any() and not vector[9].any()
    else:
        assert vector[3, 150:].abs().lt(FLT_MIN).all() and vector[3, 150:].ne(0).any()


def test_the_pair_step_flushes_as_ftz_decides_at_float_min() -> None:
    """x86's FTZ, which VDPBF16PS and the emulating vector paths use, flushes a result whose
    exact value rounds (to 24 bits, exponent unbounded) below FLT_MIN, though rounded with
    gradual underflow it is FLT_MIN itself. The portable pair step must decide the same; in
    float32, nothing is flushed. Row 0's exact sum is FLT_MIN - 2^-150 (flushed), row 1's
    FLT_MIN - 2^-151 (kept: it rounds to FLT_MIN either way)."""
    # pair order: x1*w1 = 2^-126, x0*w0 = 2^-149, then x3*w3 = -3 * 2^-150 or -5 * 2^-151
    x = torch.tensor([[2.0**-75, 2.0**-63, 0, 3 * 2.0**-75], [2.0**-75, 2.0**-63, 0, 5 * 2.0**-76]])
    w = torch.tensor([[2.0**-74, 2.0**-63, 0, -(2.0**-75)]])
    want = {torch.bfloat16: [0.0, FLT_MIN], torch.float32: [FLT_MIN, FLT_MIN]}
    for dtype, expected in want.items():
        xd, wd = x.to(dtype), w.to(dtype)
        assert torch.equal(xd.double(), x.double()) and torch.equal(wd.double(), w.double())
        for vector in (True, False):
            y = ops.linear(xd, packed(wd), 1, vector)
            assert y[:, 0].double().tolist() == expected, (dtype, vector)


def test_no_dtype_runs_the_portable_path_on_a_vector_cpu() -> None:
    """Every dtype the engine serves gets a vector path wherever the CPU has AVX2 and FMA:
    bfloat16 without native bfloat16 is emulated exactly, never left to the scalar code."""
    if not {"avx2", "fma"} <= CPU_FLAGS:
        pytest.skip("this CPU has no AVX2 and FMA: the kernels are portable here")
    for dtype in DTYPES:
        assert ops.linear_path(dtype) != "portable", dtype
        assert ops.attention_path(dtype) != "portable", dtype
    if os.environ.get(kernels.FLAGS_ENV):
        return  # a variant build: the paths below are the default build's
    avx512 = "avx512f" in CPU_FLAGS
    bf16 = ("avx512_bf16" if "avx512_bf16" in CPU_FLAGS else "avx512") if avx512 else "avx2"
    expected = {"float32": "avx512" if avx512 else "avx2", "bfloat16": bf16}
    for path in (ops.linear_path, ops.attention_path):
        assert {name: path(getattr(torch, name)) for name in expected} == expected


VARIANT_PATHS = """
import json, torch
from replica.model import kernels
kernels.load()
ops = torch.ops.prefix_serve
print(json.dumps({f"{kind}_{dt}": getattr(ops, f"{kind}_path")(getattr(torch, dt))
                  for kind in ("linear", "attention") for dt in ("float32", "bfloat16")}))
"""


@pytest.mark.skipif(
    "avx512f" not in CPU_FLAGS,
    reason="AVX-512F paths need a CPU with AVX-512F (this one has none): the build without "
    "AVX-512 BF16 is checked there only",
)
def test_avx512f_without_bf16_runs_bfloat16_vectorized_and_bit_exact() -> None:
    """The kernels built with -mno-avx512bf16 (a CPU with AVX-512F and no AVX-512 BF16, like
    Skylake-SP to Ice Lake) run bfloat16's linears and attention on AVX-512F, the pair step
    as two FMAs, and the bit-for-bit tests above pass on them, subnormals included."""
    env = {**os.environ, kernels.FLAGS_ENV: "-mno-avx512bf16"}
    root = Path(__file__).parent.parent
    run = subprocess.run(
        [sys.executable, "-c", VARIANT_PATHS], env=env, cwd=root, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    paths = json.loads(run.stdout.splitlines()[-1])
    assert set(paths.values()) == {"avx512"}, paths
    tests = "bit_for_bit or pair_step or a_linear_rows or alone_or_among"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k"]
    run = subprocess.run([*command, tests], env=env, cwd=root, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:]


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
    rotary = RotaryEmbedding(
        ModelShape(hidden_size=576, num_heads=9, num_kv_heads=3, rope_theta=100000.0)
    )
    cos, sin = rotary.at(torch.arange(100, 164), dt)
    qk = torch.randn(64, 12, 64, generator=gen).to(dt)
    ours, theirs = qk.clone(), qk.clone()
    rotate_(ours, cos, sin, fused=True)
    rotate_(theirs, cos, sin, fused=False)
    assert torch.equal(ours, theirs)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within one bfloat16 unit in the last place, relative to the values' size."""
    return bool(((a.float() - b.float()).abs() <= 2**-7 * b.float().abs() + 1e-6).all())
