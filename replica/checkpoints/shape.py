"""The shape of a Llama-family decoder, as every checkpoint format describes it.

One record covers the families served (``ARCHITECTURES``): what tells them apart is a
handful of switches the model reads (biases on Q, K and V; an RMSNorm on each head of Q and
K; a head size of its own; scaled rotary frequencies), never the family's name.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# The families served, by their Hugging Face ``model_type`` (and GGUF architecture name).
Architecture = Literal["llama", "qwen2", "qwen3"]
ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3")


class ModelShape(BaseModel):
    """A Llama-family decoder. The defaults are the embedded ~6M-parameter random model
    (``tiny-llama-6m``), whose byte tokenizer has 258 ids and ends a text with id 257."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    architecture: Architecture = "llama"
    vocab_size: int = Field(258, gt=0)
    hidden_size: int = Field(256, gt=0)
    num_layers: int = Field(8, gt=0)
    num_heads: int = Field(8, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    head_dim: int = Field(0, ge=0, description="0: hidden_size / num_heads")
    intermediate_size: int = Field(704, gt=0)
    rope_theta: float = 10000.0
    rope_freq_factors: tuple[float, ...] | None = Field(
        None, description="each rotary frequency divided by its factor (Llama 3's scaling)"
    )
    qkv_bias: bool = Field(False, description="Q, K and V projections have biases (Qwen2)")
    qk_norm: bool = Field(False, description="an RMSNorm over each head of Q and K (Qwen3)")
    rms_norm_eps: float = 1e-5
    max_position: int = Field(4096, gt=0)
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = Field((257,), description="generation stops at these")

    @model_validator(mode="before")
    @classmethod
    def _default_head_dim(cls, data: Any) -> Any:
        """``head_dim`` 0 or absent: ``hidden_size / num_heads`` (a model where the two
        differ, as Qwen3's do, names its own)."""
        if not isinstance(data, dict) or data.get("head_dim"):
            return data
        hidden, heads = data.get("hidden_size", 256), data.get("num_heads", 8)
        if not (isinstance(hidden, int) and isinstance(heads, int) and heads > 0):
            return data  # the field checks name what is wrong
        if hidden % heads:
            raise ValueError("hidden_size % num_heads must be 0 where head_dim is not given")
        return {**data, "head_dim": hidden // heads}

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelShape:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads % num_kv_heads must be 0")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (rotary pairs)")
        factors = self.rope_freq_factors
        if factors is not None and len(factors) != self.head_dim // 2:
            raise ValueError(f"rope_freq_factors: {len(factors)} given, head_dim / 2 needed")
        return self

    @property
    def q_size(self) -> int:
        """Width of all query heads together (the attention output's width too)."""
        return self.num_heads * self.head_dim
