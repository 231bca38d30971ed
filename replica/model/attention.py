"""Paged attention: keys and values live in blocks, read through each sequence's block table.

Two implementations of one contract. ``replica/model/kernels/attention.cpp`` is the one that
serves: every query walks its keys block by block from position 0 in two passes (scores and
their maximum, then the exponentials and the weighted values), so its output is bitwise the
same whatever else is in the step (batch-invariant). The
pure-torch functions below are its reference: the tests compare the two, and the engine runs
them where no kernel could be built and invariance was not asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from replica.kv.shared_pool import PoolLocator, SharedPool, shared_memory_available

DECODE_TILE = 8  # decodes attended together (sharing the blocks they have in common)
PREFILL_TILE = 32  # rows of one prompt chunk attended together


class KVCache:
    """All keys and values in one tensor, block-major:
    ``[num_blocks, num_layers, 2, kv_heads, block_size * head_dim]``.

    A block holds every layer's K and V of its tokens in one contiguous region (what copying
    or moving a block needs). Within a (block, layer, head), with ``pack`` P = 2 for bfloat16
    (pairs, as AVX-512 BF16 dot products take them) and 1 otherwise, K element (token l,
    dim d) is at ``((d // P) * block_size + l) * P + d % P`` and V element (l, d) at
    ``((l // P) * head_dim + d) * P + l % P`` (the kernel's comment says why).
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        shared: bool = False,
    ) -> None:
        self.block_size, self.head_dim = block_size, head_dim
        self.pack = 2 if dtype == torch.bfloat16 else 1
        if block_size % self.pack or head_dim % self.pack:
            raise ValueError("bfloat16 needs an even block_size and head_dim")
        shape = (num_blocks, num_layers, 2, num_kv_heads, block_size * head_dim)
        # shared: on a memfd that same-node replicas read when they pull (``shared_pool``)
        self.locator: PoolLocator | None = None
        if shared and shared_memory_available():
            pool = SharedPool(shape, dtype)
            self.data, self.generations, self.locator = pool.data, pool.generations, pool.locator
            self._pool = pool  # keeps the mapping (and the memfd) alive
        else:
            self.data = torch.zeros(shape, dtype=dtype)
            self.generations = np.zeros(num_blocks, np.int64)

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy block ``src`` into ``dst``, every layer's K and V (the copy-on-write of a
        forked sequence's partial block)."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], dtype=torch.long)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long)
        self.data[dst] = self.data[src]

    def keys(self, layer: int, blocks: torch.Tensor) -> torch.Tensor:
        """The keys of ``blocks`` in token order: ``[len(blocks) * block_size, kv_heads, dim]``."""
        return self._key_view(self.data[blocks, layer, 0]).flatten(0, 1)

    def values(self, layer: int, blocks: torch.Tensor) -> torch.Tensor:
        """The values of ``blocks`` in token order, like ``keys``."""
        return self._value_view(self.data[blocks, layer, 1]).flatten(0, 1)

    def _key_view(self, k: torch.Tensor) -> torch.Tensor:
        """``[blocks, kv, bs * dim]`` in K's layout as ``[blocks, bs, kv, dim]`` (a view)."""
        n, kv, p = k.shape[0], k.shape[1], self.pack
        k = k.view(n, kv, self.head_dim // p, self.block_size, p)
        return k.permute(0, 3, 1, 2, 4).flatten(3, 4)

    def _value_view(self, v: torch.Tensor) -> torch.Tensor:
        """``[blocks, kv, bs * dim]`` in V's layout as ``[blocks, bs, kv, dim]`` (a view)."""
        n, kv, p = v.shape[0], v.shape[1], self.pack
        v = v.view(n, kv, self.block_size // p, self.head_dim, p)
        return v.permute(0, 2, 4, 1, 3).flatten(1, 2)


@dataclass
class AttentionMetadata:
    """Where a step's tokens write their KV and what each of them attends to.

    Query row ``t`` of the step's flat batch belongs to sequence ``query_seq[t]`` (a row of
    ``block_tables``) and sees that sequence's first ``query_ctx[t]`` tokens (its own
    included). ``tile_rows[tile_starts[i]:tile_starts[i + 1]]`` are the rows attended
    together: a tile decides what shares reads, never what a query computes.
    """

    slot_mapping: torch.Tensor  # [tokens] int64, flat slot = block * block_size + offset
    block_tables: torch.Tensor  # [sequences, max_blocks] int32, padded with 0
    query_seq: torch.Tensor  # [tokens] int32
    query_ctx: torch.Tensor  # [tokens] int32
    tile_starts: torch.Tensor  # [tiles + 1] int32
    tile_rows: torch.Tensor  # [tokens] int32
    use_kernel: bool = True


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: KVCache,
    layer: int,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Write this step's ``k``/``v`` into the cache, then attend through the block tables.

    The write happens for the whole step before any read, so a sequence may attend to blocks
    that another sequence of the same step is filling (a prefix shared on arrival).
    ``q``: [tokens, heads, dim]; ``k``, ``v``: [tokens, kv_heads, dim]. Returns like ``q``.
    """
    scale = q.shape[-1] ** -0.5
    if meta.use_kernel:
        torch.ops.prefix_serve.write_kv(cache.data, layer, k, v, meta.slot_mapping)
        return kernel_attention(q, cache, layer, meta, scale)
    reference_write_kv(cache, layer, k, v, meta.slot_mapping)
    return reference_attention(q, cache, layer, meta, scale)


def kernel_attention(
    q: torch.Tensor,
    cache: KVCache,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
    vector: bool = True,
) -> torch.Tensor:
    """The C++ kernel's attention (``vector=False``: its portable path, for the tests)."""
    return torch.ops.prefix_serve.paged_attention(
        q,
        cache.data,
        layer,
        meta.block_tables,
        meta.query_seq,
        meta.query_ctx,
        meta.tile_starts,
        meta.tile_rows,
        scale,
        vector,
    )


def reference_write_kv(
    cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """What the kernel's ``write_kv`` does, in torch."""
    p, bs, dim = cache.pack, cache.block_size, cache.head_dim
    block, offset = (slots // bs)[:, None, None], (slots % bs)[:, None, None]
    heads = torch.arange(k.shape[1])[None, :, None]
    d = torch.arange(dim)[None, None, :]
    keys = cache.data[:, layer, 0].view(-1, k.shape[1], dim // p, bs, p)
    values = cache.data[:, layer, 1].view(-1, k.shape[1], bs // p, dim, p)
    keys[block, heads, d // p, offset, d % p] = k
    values[block, heads, offset // p, d, offset % p] = v


def reference_attention(
    q: torch.Tensor, cache: KVCache, layer: int, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Each sequence's queries against its keys in one masked softmax (float32, float64 for
    a float64 model): the kernel's result up to rounding, not bitwise."""
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty_like(q)
    group = q.shape[1] // cache.data.shape[3]
    for s in meta.query_seq.unique().tolist():
        rows = (meta.query_seq == s).nonzero().flatten()
        ctx = meta.query_ctx[rows].long()
        num_blocks = -(-int(ctx.max()) // cache.block_size)
        blocks = meta.block_tables[s, :num_blocks].long()
        keys = cache.keys(layer, blocks).repeat_interleave(group, 1).transpose(0, 1).to(acc)
        values = cache.values(layer, blocks).repeat_interleave(group, 1).transpose(0, 1)
        visible = torch.arange(keys.shape[1])[None, :] < ctx[:, None]  # [rows, keys]
        query = q[rows].transpose(0, 1).to(acc)  # [heads, rows, dim]
        scores = (query @ keys.transpose(1, 2)) * scale
        weights = F.softmax(scores.masked_fill(~visible, -torch.inf), dim=-1)
        out[rows] = (weights @ values.to(acc)).transpose(0, 1).to(q.dtype)
    return out


def build_metadata(
    block_size: int,
    tables: list[list[int]],
    spans: list[tuple[int, int]],
    use_kernel: bool,
) -> AttentionMetadata:
    """Metadata for a step whose sequence ``i`` computes tokens ``[first, first + n)`` given
    as ``spans[i] = (first, n)``, its rows consecutive in the flat batch in sequence order."""
    query_seq: list[int] = []
    query_ctx: list[int] = []
    slots: list[int] = []
    for i, ((first, n), table) in enumerate(zip(spans, tables, strict=True)):
        query_seq += [i] * n
        query_ctx += range(first + 1, first + n + 1)
        slots += (
            table[p // block_size] * block_size + p % block_size for p in range(first, first + n)
        )
    width = max((len(t) for t in tables), default=1)
    padded = [t + [0] * (width - len(t)) for t in tables]
    tile_rows, tile_starts = _tiles(tables, spans)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        block_tables=torch.tensor(padded, dtype=torch.int32).view(len(tables), width),
        query_seq=torch.tensor(query_seq, dtype=torch.int32),
        query_ctx=torch.tensor(query_ctx, dtype=torch.int32),
        tile_starts=torch.tensor(tile_starts, dtype=torch.int32),
        tile_rows=torch.tensor(tile_rows, dtype=torch.int32),
        use_kernel=use_kernel,
    )


def _tiles(tables: list[list[int]], spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Prompt chunks in tiles of ``PREFILL_TILE`` consecutive rows; decodes grouped by the
    first physical block of their table (those sharing a cached prefix), ``DECODE_TILE`` to a
    tile."""
    rows: list[int] = []
    starts = [0]
    by_first: dict[int, list[int]] = {}
    row = 0
    for (_, n), table in zip(spans, tables, strict=True):
        if n == 1:
            by_first.setdefault(table[0], []).append(row)
        else:
            for start in range(row, row + n, PREFILL_TILE):
                rows += range(start, min(start + PREFILL_TILE, row + n))
                starts.append(len(rows))
        row += n
    for members in by_first.values():
        for start in range(0, len(members), DECODE_TILE):
            rows += members[start : start + DECODE_TILE]
            starts.append(len(rows))
    return rows, starts
