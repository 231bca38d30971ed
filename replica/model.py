"""A Llama-family decoder (RMSNorm, RoPE, SwiGLU, grouped KV heads) over the paged KV cache.

Parameter names follow Hugging Face's ``LlamaForCausalLM``, so any checkpoint's weights load
with ``load_weights`` (``replica.checkpoints``); without one they are seeded random.
"""

from __future__ import annotations

import torch
from torch import nn

from replica.attention import AttentionMetadata, KVCache, paged_attention
from replica.model_shape import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


class RotaryEmbedding(nn.Module):
    """RoPE in the rotate-half layout that Hugging Face Llama checkpoints use."""

    def __init__(self, head_dim: int, max_position: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x``: [tokens, heads, head_dim], rotated by each token's position."""
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        kv_dim = config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv_dim, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.rotary = rotary

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = x.shape[0]
        q = self.rotary(self.q_proj(x).view(n, self.num_heads, self.head_dim), positions)
        k = self.rotary(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim), positions)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, k_cache, v_cache, meta)
        return self.o_proj(out.reshape(n, -1))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        rotary = RotaryEmbedding(config.head_dim, config.max_position, config.rope_theta)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_random(self, seed: int) -> None:
        """Seeded random weights: the same seed gives the same model in every process.

        The scale (std 0.1) is large enough that greedy output depends on the whole context
        (at 0.02 it collapses to one repeated token), so a wrong cache hit shows in the output.
        """
        gen = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            with torch.no_grad():
                if name.endswith("layernorm.weight") or name == "model.norm.weight":
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, 0.1, generator=gen)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states after the final norm for a flat batch of tokens."""
        h = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            h = h + layer.self_attn(
                layer.input_layernorm(h), positions, kv_cache.k[i], kv_cache.v[i], meta
            )
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face ``LlamaForCausalLM`` weights (strict: every name, every shape);
        a tied checkpoint may leave ``lm_head.weight`` out."""
        state = dict(state)
        if self.config.tie_word_embeddings:
            state["lm_head.weight"] = state.get("model.embed_tokens.weight")
        missing = sorted(set(self.state_dict()) - set(state))
        unexpected = sorted(set(state) - set(self.state_dict()))
        if missing or unexpected:
            raise ValueError(
                f"weights do not fit a Llama model: missing {missing[:3]}, "
                f"unexpected {unexpected[:3]}"
            )
        self.load_state_dict(state, strict=True)
