"""Turns a scheduled batch into tensors, runs the model and returns next-token logits."""

from __future__ import annotations

import torch

from replica.attention import AttentionMetadata, KVCache, PrefillSpan
from replica.cascade import plan_decodes
from replica.checkpoints import CheckpointError, checkpoint_for
from replica.config import EngineConfig
from replica.cpu import resolve_dtype
from replica.memory import keep_freed_memory_mapped
from replica.model import LlamaForCausalLM
from replica.packed_linear import pack_linears
from replica.scheduler import ScheduledBatch


class ModelRunner:
    """Owns the model weights and the paged KV cache of one engine."""

    def __init__(self, config: EngineConfig) -> None:
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        keep_freed_memory_mapped()
        dtype = resolve_dtype(config.dtype)
        checkpoint = checkpoint_for(config.model)
        model = LlamaForCausalLM(config.shape)
        state = checkpoint.state_dict()
        if state is None:
            model.init_random(config.seed)
        else:
            try:
                model.load_weights(state)
            except (ValueError, RuntimeError) as exc:  # names or shapes that do not fit
                raise CheckpointError(f"{checkpoint.name}: {exc}") from None
        self.model = model.to(dtype).eval()
        self.num_parameters = sum(p.numel() for p in self.model.parameters())
        pack_linears(self.model)  # after counting: packed weights are no parameters
        m = config.shape
        self.kv_cache = KVCache(
            m.num_layers, config.num_blocks, config.block_size, m.num_kv_heads, m.head_dim, dtype
        )
        self.block_size = config.block_size

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run every scheduled token; the logits ([rows, vocab], float32) of the last
        ``batch.logit_rows[i]`` tokens of each sequence i, in batch order. Block copies of
        forked sequences run first."""
        self.kv_cache.copy_blocks(batch.block_copies)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_rows: list[int] = []
        prefills: list[PrefillSpan] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        for seq, n, rows in zip(batch.seqs, batch.num_new_tokens, batch.logit_rows, strict=True):
            start, first = len(input_ids), seq.num_computed_tokens
            context_len = first + n
            input_ids += seq.token_ids[first:context_len]
            positions += range(first, context_len)
            slots += (seq.block_table[p // bs] * bs + p % bs for p in range(first, context_len))
            last_rows += range(start + n - rows, start + n)
            used_blocks = seq.block_table[: -(-context_len // bs)]
            if n == 1:
                decode_rows.append(start)
                decode_tables.append(used_blocks)
                decode_lens.append(context_len)
            else:
                table = torch.tensor(used_blocks, dtype=torch.long)
                prefills.append(PrefillSpan(start, start + n, context_len, table))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            prefills=prefills,
            decode_rows=torch.tensor(decode_rows, dtype=torch.long),
            decode_plan=plan_decodes(decode_tables, decode_lens, bs) if decode_tables else None,
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            self.kv_cache,
            meta,
        )
        return self.model.compute_logits(hidden[torch.tensor(last_rows, dtype=torch.long)])
