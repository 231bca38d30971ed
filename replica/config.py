"""Configuration a user writes: the model shape and the engine's sizes (pydantic, validated)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from replica.hashing import BlockHasher
from replica.tokenizer import ByteTokenizer


class ModelConfig(BaseModel):
    """A Llama-family decoder. The defaults are the embedded ~6M-parameter model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = Field(ByteTokenizer.vocab_size, gt=0)
    hidden_size: int = Field(256, gt=0)
    num_layers: int = Field(8, gt=0)
    num_heads: int = Field(8, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    intermediate_size: int = Field(704, gt=0)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position: int = Field(4096, gt=0)
    tie_word_embeddings: bool = False
    bos_token_id: int = ByteTokenizer.bos_token_id
    eos_token_id: int = ByteTokenizer.eos_token_id

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size % num_heads and num_heads % num_kv_heads must be 0")
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, folder: str | Path) -> ModelConfig:
        """Read a Hugging Face Llama ``config.json``."""
        hf = json.loads((Path(folder) / "config.json").read_text())
        eos = hf.get("eos_token_id", 2)
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
            intermediate_size=hf["intermediate_size"],
            rope_theta=hf.get("rope_theta", 10000.0),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            max_position=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            bos_token_id=hf.get("bos_token_id", 1),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
        )


class EngineConfig(BaseModel):
    """Sizes and switches of one engine (one replica).

    ``model_id`` names the model in the API and roots every block hash, so engines that must
    share cache entries (and the router that predicts them) use the same ``model_id``,
    ``block_size`` and ``hash_secret``.
    """

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model_id: str = "tiny-llama-6m"
    model: ModelConfig = ModelConfig()
    model_path: str | None = Field(
        None, description="Hugging Face Llama folder (config.json + *.safetensors)."
    )
    block_size: int = Field(16, gt=0)
    num_blocks: int = Field(1024, gt=0)
    max_num_seqs: int = Field(32, gt=0)
    max_num_batched_tokens: int = Field(4096, gt=0)
    max_model_len: int | None = Field(None, gt=0, description="Defaults to the model's.")
    enable_prefix_cache: bool = True
    seed: int = 0
    dtype: Literal["float32", "float64", "bfloat16"] = "float32"
    num_threads: int | None = Field(None, gt=0, description="torch threads; None = default.")
    hash_secret: str | None = Field(None, description="Cluster secret that keys block hashes.")

    @model_validator(mode="after")
    def _load_model_shape(self) -> EngineConfig:
        if self.model_path is not None:
            self.model = ModelConfig.from_hf(self.model_path)
        if self.max_model_len is not None and self.max_model_len > self.model.max_position:
            raise ValueError("max_model_len exceeds the model's max_position")
        return self

    @property
    def context_len(self) -> int:
        """The longest prompt plus ``max_tokens`` served: ``max_model_len`` or the model's."""
        return self.max_model_len or self.model.max_position

    def block_hasher(self) -> BlockHasher:
        """The hash chain of this engine's cache; the router must use the same one."""
        return BlockHasher(self.block_size, self.model_id, (self.hash_secret or "").encode())
