"""Cascade attention: decoding sequences that share cached prefix blocks attend to them once.

A prefix cache makes many running sequences hold the very same physical blocks (a system
prompt every chat starts with). Paged attention without a custom kernel gathers each
sequence's keys and values into a padded batch, copying a shared 560-token prefix once per
sequence and reading it once per sequence again. Here such a group's queries attend to the
prefix blocks together, in one matrix product, and each sequence attends alone only to its
own tail; the two partial results merge exactly through their log-sum-exp, as in
FlashAttention's split-KV (and vLLM's cascade attention on GPUs):

    out = (out_prefix * exp(lse_prefix) + out_tail * exp(lse_tail)) / exp(lse)
    lse = log(exp(lse_prefix) + exp(lse_tail))

The result equals ordinary attention up to float rounding (the tests compare greedy tokens
and logits with transformers).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

MIN_SHARED_BLOCKS = 2  # a shorter shared prefix is not worth a separate pass


@dataclass(frozen=True)
class SharedPrefix:
    """Decoding sequences ``members`` (indices among the step's decodes) whose block tables
    all start with ``blocks``."""

    blocks: torch.Tensor  # [num_shared_blocks]
    members: torch.Tensor | slice  # [num_members], or a slice when they are consecutive


@dataclass(frozen=True)
class DecodePlan:
    """What each decode attends to: its own tail (``tail_tables``, the blocks after its
    group's shared prefix, padded with block 0, and ``tail_lens`` valid tokens), plus the
    shared prefix of its group, if it is in one."""

    tail_tables: torch.Tensor  # [num_decodes, max_tail_blocks]
    tail_lens: torch.Tensor  # [num_decodes]
    shared: list[SharedPrefix]


def plan_decodes(tables: list[list[int]], lens: list[int], block_size: int) -> DecodePlan:
    """Group decodes by the physical blocks their tables start with (the longest run all
    members share), and cut each table after its group's shared run."""
    by_first: dict[int, list[int]] = defaultdict(list)
    for i, table in enumerate(tables):
        by_first[table[0]].append(i)
    cut = [0] * len(tables)
    shared = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        common = _common_prefix([tables[i] for i in members])
        if common < MIN_SHARED_BLOCKS:
            continue
        for i in members:
            cut[i] = common
        blocks = torch.tensor(tables[members[0]][:common], dtype=torch.long)
        consecutive = members == list(range(members[0], members[-1] + 1))
        index = slice(members[0], members[-1] + 1) if consecutive else torch.tensor(members)
        shared.append(SharedPrefix(blocks, index))
    tails = [t[c:] for t, c in zip(tables, cut, strict=True)]
    width = max(len(t) for t in tails)
    padded = [t + [0] * (width - len(t)) for t in tails]
    return DecodePlan(
        tail_tables=torch.tensor(padded, dtype=torch.long).view(len(tails), width),
        tail_lens=torch.tensor([n - c * block_size for n, c in zip(lens, cut, strict=True)]),
        shared=shared,
    )


def attend(
    grouped_q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
) -> torch.Tensor:
    """Decode attention with shared prefixes: ``grouped_q`` is ``[decodes, kv_heads, group,
    dim]`` (query heads folded onto their KV head); returns the same shape, in float32 (in
    float64 for a float64 model: the merge then runs in float64, like its log-sum-exps)."""
    keys = k_cache[plan.tail_tables].flatten(1, 2).transpose(1, 2)  # [decodes, kv, len, dim]
    values = v_cache[plan.tail_tables].flatten(1, 2).transpose(1, 2)
    invalid = torch.arange(keys.shape[2]).unsqueeze(0) >= plan.tail_lens.unsqueeze(1)
    bias = torch.zeros(invalid.shape, dtype=grouped_q.dtype).masked_fill_(invalid, -torch.inf)
    out, lse = flash(grouped_q, keys, values, bias[:, None, None, :], scale)
    acc = torch.promote_types(grouped_q.dtype, torch.float32)
    out = out.to(acc)
    for prefix in plan.shared:
        members = prefix.members
        q = grouped_q[members]  # [n, kv, group, dim]
        n, kv, group, dim = q.shape
        keys = k_cache[prefix.blocks].flatten(0, 1).transpose(0, 1)  # [kv, len, dim]
        values = v_cache[prefix.blocks].flatten(0, 1).transpose(0, 1)
        rows = q.permute(1, 0, 2, 3).reshape(1, kv, n * group, dim)
        p_out, p_lse = flash(rows, keys.unsqueeze(0), values.unsqueeze(0), None, scale)
        p_out = p_out.to(acc).view(kv, n, group, dim).permute(1, 0, 2, 3)
        p_lse = p_lse.view(kv, n, group).permute(1, 0, 2)
        # slices make these views and in-place updates (the common case: one system prompt)
        out[members], lse[members] = merge(out[members], lse[members], p_out, p_lse, True)
    return out


def flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA's CPU flash kernel, which also returns each query's log-sum-exp (what a merge
    needs): ``[batch, heads, queries, dim]`` in, output and ``[batch, heads, queries]`` out."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=mask, scale=scale
    )


def merge(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    with_lse: bool = False,
) -> Any:
    """Attention over keys A and keys B from attention over each (float32 outputs and their
    log-sum-exps): the softmax of the union, exactly."""
    total = torch.logaddexp(lse_a, lse_b)
    out = out_a * (lse_a - total).exp().unsqueeze(-1) + out_b * (lse_b - total).exp().unsqueeze(-1)
    return (out, total) if with_lse else out


def _common_prefix(tables: list[list[int]]) -> int:
    """How many leading entries every table shares."""
    shortest = min(len(t) for t in tables)
    n = 0
    while n < shortest and all(t[n] == tables[0][n] for t in tables):
        n += 1
    return n
