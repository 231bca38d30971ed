"""The shape of a Llama-family decoder, as every checkpoint format describes it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ModelShape(BaseModel):
    """A Llama-family decoder. The defaults are the embedded ~6M-parameter random model
    (``tiny-llama-6m``), whose byte tokenizer has 258 ids and ends a text with id 257."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = Field(258, gt=0)
    hidden_size: int = Field(256, gt=0)
    num_layers: int = Field(8, gt=0)
    num_heads: int = Field(8, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    intermediate_size: int = Field(704, gt=0)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position: int = Field(4096, gt=0)
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = Field((257,), description="generation stops at these")

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelShape:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size % num_heads and num_heads % num_kv_heads must be 0")
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads
