"""A Llama-family decoder (RMSNorm, RoPE, SwiGLU, grouped KV heads) over the paged KV cache.

Parameter names follow Hugging Face's ``LlamaForCausalLM`` (and ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``, which share them) except that Q/K/V and gate/up are fused
(``load_weights`` fuses any checkpoint's weights, ``hf_state_dict`` splits them back);
without a checkpoint the weights are seeded random. The families differ only in what the
shape switches on (``ModelShape``): Q/K/V biases, per-head Q/K norms, the head size, the
rotary frequencies' factors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replica.checkpoints.shape import ModelShape
from replica.model.attention import AttentionMetadata, KVCache, paged_attention


class RMSNorm(nn.Module):
    """Normalized in float32, then scaled in the model's dtype (as Hugging Face does).

    ``fused`` runs the C++ kernels (``kernels/layers.cpp``); the torch code is their
    reference. ``add_forward`` adds a layer's output to the residual stream first (in
    place) and normalizes the sum: one pass instead of two."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        if fused:
            return torch.ops.prefix_serve.rms_norm(x, self.weight, self.eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return normed.to(x.dtype) * self.weight

    def add_forward(self, residual: torch.Tensor, x: torch.Tensor, fused: bool) -> torch.Tensor:
        """``residual += x``, then the norm of the new residual."""
        if fused:
            return torch.ops.prefix_serve.add_rms_norm(residual, x, self.weight, self.eps)
        residual.add_(x)
        return self.forward(residual)


class RotaryEmbedding(nn.Module):
    """RoPE in the rotate-half layout that Hugging Face Llama checkpoints use. ``at`` looks up
    a step's positions once; every layer then rotates with them."""

    def __init__(self, config: ModelShape) -> None:
        super().__init__()
        head_dim, theta = config.head_dim, config.rope_theta
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        if config.rope_freq_factors is not None:  # Llama 3's long-context scaling
            inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float64)
        max_position = config.max_position
        angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each token in the model's dtype: ``[tokens, head_dim]``."""
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool) -> None:
    """``x``: [tokens, heads, head_dim] (a view), rotated in place by each token's position
    (``cos``, ``sin``: [tokens, head_dim])."""
    if fused:
        torch.ops.prefix_serve.rope(x, cos, sin)
        return
    half = x.shape[-1] // 2
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x.copy_(x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin)


def norm_heads_(x: torch.Tensor, norm: RMSNorm, fused: bool) -> None:
    """``x``: [tokens, heads, head_dim] (a view), each head's row normalized in place."""
    rows = x.reshape(-1, x.shape[-1])  # a copy: the heads are a slice of the fused rows
    x.copy_(norm(rows, fused).view_as(x))


class LlamaAttention(nn.Module):
    """Q, K and V come from one fused projection (one matrix product instead of three);
    Q and K are normalized per head where the family does it (Qwen3), then rotated
    together."""

    def __init__(self, config: ModelShape) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        kv_dim = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, config.q_size + 2 * kv_dim, bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        layer: int,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = x.shape[0]
        qk_heads = self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(x).view(n, qk_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            norm_heads_(qkv[:, : self.num_heads], self.q_norm, meta.use_kernel)
            norm_heads_(qkv[:, self.num_heads : qk_heads], self.k_norm, meta.use_kernel)
        rotate_(qkv[:, :qk_heads], *rope, fused=meta.use_kernel)
        q, k, v = qkv[:, : self.num_heads], qkv[:, self.num_heads : qk_heads], qkv[:, qk_heads:]
        out = paged_attention(q, k, v, kv_cache, layer, meta)
        return self.o_proj(out.reshape(n, -1))


class LlamaMLP(nn.Module):
    """SwiGLU with the gate and up projections fused into one matrix product."""

    def __init__(self, config: ModelShape) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if fused:
            return self.down_proj(torch.ops.prefix_serve.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelShape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelShape) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelShape) -> None:
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
                if name.endswith("norm.weight"):
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
        """Hidden states after the final norm for a flat batch of tokens. The residual stream
        is updated in place and normalized in the same pass (``RMSNorm.add_forward``)."""
        fused = meta.use_kernel
        residual = self.model.embed_tokens(input_ids)
        rope = self.model.rotary.at(positions, residual.dtype)
        layers = self.model.layers
        x = layers[0].input_layernorm(residual, fused)
        for i, layer in enumerate(layers):
            attended = layer.self_attn(x, rope, kv_cache, i, meta)
            x = layer.post_attention_layernorm.add_forward(residual, attended, fused)
            after = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            x = after.add_forward(residual, layer.mlp(x, fused), fused)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face ``LlamaForCausalLM`` (or Qwen2, Qwen3) weights (strict: every
        name, every shape); a tied checkpoint may leave ``lm_head.weight`` out. Q, K, V and
        gate, up are fused here (weights and biases), row blocks in that order."""
        state = dict(state)
        if self.config.tie_word_embeddings:
            state["lm_head.weight"] = state.get("model.embed_tokens.weight")
        ours = {}
        for name in self.state_dict():
            sources = _hf_names(name)
            missing = [src for src in sources if state.get(src) is None]
            if missing:
                raise ValueError(f"weights do not fit a Llama model: missing {missing[0]}")
            ours[name] = torch.cat([state.pop(src) for src in sources])
        if state:
            raise ValueError(f"weights do not fit a Llama model: unexpected {sorted(state)[:3]}")
        self.load_state_dict(ours, strict=True)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under Hugging Face ``LlamaForCausalLM`` names (fused ones split)."""
        cfg = self.config
        kv = cfg.num_kv_heads * cfg.head_dim
        rows = {"qkv_proj": [cfg.q_size, kv, kv], "gate_up_proj": [cfg.intermediate_size] * 2}
        out = {}
        for name, tensor in self.state_dict().items():
            sources = _hf_names(name)
            module = name.rsplit(".", 2)[-2]
            pieces = tensor.split(rows[module]) if module in rows else [tensor]
            out.update(
                {src: piece.contiguous() for src, piece in zip(sources, pieces, strict=True)}
            )
        return out


def _hf_names(name: str) -> list[str]:
    """The Hugging Face parameter names one of ours holds (several for a fused one)."""
    head, _, kind = name.rpartition(".")
    prefix, _, module = head.rpartition(".")
    if module in _FUSED:
        return [f"{prefix}.{part}.{kind}" for part in _FUSED[module]]
    return [name]


# Our fused projections and the Hugging Face ones they hold, in row order.
_FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
