"""Turns a scheduled batch into tensors, runs the model and returns next-token logits."""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Callable
from pathlib import Path

import torch

from replica.checkpoints import CheckpointError, checkpoint_for
from replica.config import EngineConfig
from replica.engine.engine import Engine
from replica.engine.step import ScheduledBatch
from replica.model import kernels
from replica.model.attention import KVCache, build_metadata
from replica.model.cpu import resolve_dtype
from replica.model.llama import LlamaForCausalLM
from replica.model.memory import keep_freed_memory_mapped
from replica.model.packed_linear import pack_linears


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
        self.use_kernel = _use_kernel(config.deterministic)
        weights = checkpoint.identity() + (f"|seed={config.seed}" if state is None else "")
        # what a block's KV depends on besides its tokens: the node store keys on it
        self.kv_source = f"{weights}|{dtype}|{numerics(self.use_kernel)}"
        # after counting: packed weights are no parameters
        pack_linears(self.model, kernel=self.use_kernel)
        m = config.shape
        self.kv_cache = KVCache(
            m.num_layers,
            config.num_blocks,
            config.block_size,
            m.num_kv_heads,
            m.head_dim,
            dtype,
            shared=config.shared_kv_pool,
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
        last_rows: list[int] = []
        tables: list[list[int]] = []
        spans: list[tuple[int, int]] = []
        for i, (seq, n, rows) in enumerate(
            zip(batch.seqs, batch.num_new_tokens, batch.logit_rows, strict=True)
        ):
            start, first = len(input_ids), seq.num_computed_tokens
            input_ids += batch.input_tokens(i)
            positions += range(first, first + n)
            last_rows += range(start + n - rows, start + n)
            tables.append(seq.block_table[: -(-(first + n) // bs)])
            spans.append((first, n))
        meta = build_metadata(bs, tables, spans, self.use_kernel)
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            self.kv_cache,
            meta,
        )
        return self.model.compute_logits(hidden[torch.tensor(last_rows, dtype=torch.long)])


@functools.cache
def numerics(use_kernel: bool) -> str:
    """What computes the KV here, as an id: the model code's source and the kernels' build
    (their source, compiler flags, torch version and CPU), or torch's version without them.
    Blocks computed under another id may differ in their last bits, so a store written by
    other code is never read (``replica.store.layout.fingerprint``)."""
    digest = hashlib.blake2b(digest_size=8)
    for source in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(source.read_bytes())
    engine = kernels.library_path().name if use_kernel else f"torch-{torch.__version__}"
    return f"{engine}|model-{digest.hexdigest()}"


def _use_kernel(deterministic: bool) -> bool:
    """The C++ attention serves wherever it builds; deterministic serving requires it."""
    if deterministic:
        try:
            kernels.load()
        except (kernels.KernelBuildError, OSError) as exc:
            raise kernels.KernelBuildError(
                f"deterministic: true needs the engine's C++ kernels, which failed here: {exc}"
            ) from None
        return True
    return kernels.available()


def build_engine(
    config: EngineConfig | None = None, clock: Callable[[], float] = time.monotonic
) -> Engine:
    """An engine with the real model as its runner (``config`` defaults to the cluster's)."""
    config = config or EngineConfig()
    return Engine(config, ModelRunner(config), clock)
