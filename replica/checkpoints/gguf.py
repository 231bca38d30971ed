"""A llama.cpp GGUF file (architectures ``llama``, ``qwen2``, ``qwen3``): shape and tokenizer
from its metadata, weights dequantized.

The header is read by ``gguf_file.GGUFFile`` (a tenth of a second, where ``gguf.GGUFReader``
takes seconds), weights by ``gguf.quants.dequantize``; every weight is dequantized to
float32 (any type ``gguf`` dequantizes: F32, F16, BF16, Q4_1, Q8_0, the K-quants...) and
renamed to Hugging Face names. For Llama models llama.cpp's converter permutes the rows of
the Q and K projections for its rotary layout (pairs of adjacent dimensions instead of two
halves); ``unpermute_rotary`` undoes that, as transformers' own GGUF loader does (Qwen
models keep the rotate-half layout: no permutation). Llama 3's rotary scaling is stored as
the ``rope_freqs`` tensor, one divisor per frequency: it becomes part of the shape.
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from replica.checkpoints import Checkpoint, CheckpointError
from replica.checkpoints.families import FAMILY_SWITCHES
from replica.checkpoints.gguf_file import GGUFFile
from replica.checkpoints.registry import file_identity
from replica.checkpoints.shape import ModelShape
from replica.checkpoints.tokenizer import END_TOKENS, HFTokenizer, Tokenizer
from replica.checkpoints.tokenizer_cache import tokenizer_folder

if TYPE_CHECKING:  # torch loads with the weights, not with a tokenizer (the ingress's)
    import torch

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: per head, rows ``(pair, 2)`` back to
    ``(2, half)`` (the rotate-half layout that Hugging Face checkpoints use)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def hf_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    raise KeyError(gguf_name)


class GGUFCheckpoint(Checkpoint):
    def __init__(self, path: Path, name: str | None = None) -> None:
        self.path = path
        self.name = name or path.stem
        self._file = _open(path)
        self._shape = _shape(self._file, path)

    @property
    def shape(self) -> ModelShape:
        return self._shape

    def state_dict(self) -> dict[str, torch.Tensor]:
        import torch
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        shape, tensors = self._shape, self._file.tensors
        start = time.monotonic()
        _progress(f"loading {self.name}: {len(tensors)} tensors from {self.path}")
        state: dict[str, torch.Tensor] = {}
        for i, tensor in enumerate(tensors, 1):
            if tensor.name == ROPE_FREQS:  # in the shape already
                continue
            try:
                name = hf_name(tensor.name)
                data = self._file.data(tensor)
                kind = GGMLQuantizationType(tensor.ggml_type)
                weight = dequantize(data, kind).astype(np.float32)
            except Exception as exc:  # truncated data, an unknown type or tensor name
                raise CheckpointError(f"{self.path}: tensor {tensor.name}: {exc}") from None
            if shape.architecture == "llama" and name.endswith("q_proj.weight"):
                weight = unpermute_rotary(weight, shape.num_heads)
            elif shape.architecture == "llama" and name.endswith("k_proj.weight"):
                weight = unpermute_rotary(weight, shape.num_kv_heads)
            state[name] = torch.from_numpy(np.ascontiguousarray(weight))
            if i % max(1, len(tensors) // 4) == 0:
                _progress(f"loading {self.name}: {i}/{len(tensors)} tensors")
        params = sum(t.numel() for t in state.values())
        elapsed = time.monotonic() - start
        _progress(f"loaded {self.name}: {params / 1e6:.1f}M parameters in {elapsed:.1f} s")
        return state

    def tokenizer(self) -> Tokenizer:
        return _tokenizer(self.path)

    def identity(self) -> str:
        return file_identity(self.path)


@functools.lru_cache(maxsize=4)
def _tokenizer(path: Path) -> HFTokenizer:
    folder = tokenizer_folder(path)  # converted once (``tokenizer_cache``)
    if folder is None:
        return HFTokenizer(str(path.parent), gguf_file=path.name)
    return HFTokenizer(str(folder))


def _open(path: Path) -> GGUFFile:
    try:
        return GGUFFile(path)
    except Exception as exc:  # struct, decode and value errors: whatever a corrupt header hits
        raise CheckpointError(
            f"{path}: not a readable GGUF file, truncated or corrupt ({exc})"
        ) from None


def _shape(file: GGUFFile, path: Path) -> ModelShape:
    arch = file.metadata.get("general.architecture")
    if arch not in FAMILY_SWITCHES:
        raise CheckpointError(
            f"{path}: a '{arch}' model; the served architectures are {', '.join(FAMILY_SWITCHES)}"
        )

    def field(key: str, default: Any = None) -> Any:
        return file.metadata.get(f"{arch}.{key}", default)

    tokens = file.metadata.get("tokenizer.ggml.tokens") or []
    eos = file.metadata.get("tokenizer.ggml.eos_token_id")
    ends = {tokens.index(t) for t in END_TOKENS if t in tokens}
    heads = field("attention.head_count")
    names = {t.name for t in file.tensors}
    try:
        return ModelShape(
            architecture=arch,
            vocab_size=field("vocab_size", len(tokens)),
            hidden_size=field("embedding_length"),
            num_layers=field("block_count"),
            num_heads=heads,
            num_kv_heads=field("attention.head_count_kv", heads),
            head_dim=field("attention.key_length", 0),
            intermediate_size=field("feed_forward_length"),
            rope_theta=field("rope.freq_base", 10000.0),
            rope_freq_factors=_freq_factors(file),
            qkv_bias="blk.0.attn_q.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names,
            rms_norm_eps=field("attention.layer_norm_rms_epsilon", 1e-5),
            max_position=field("context_length", 4096),
            tie_word_embeddings="output.weight" not in names,
            eos_token_ids=tuple(sorted({eos, *ends} - {None})),
        )
    except ValueError as exc:
        raise CheckpointError(f"{path}: incomplete {arch} metadata ({exc})") from None


ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's Llama 3 rotary divisors, one per frequency


def _freq_factors(file: GGUFFile) -> tuple[float, ...] | None:
    tensor = next((t for t in file.tensors if t.name == ROPE_FREQS), None)
    if tensor is None:
        return None
    return tuple(float(f) for f in np.asarray(file.data(tensor), dtype=np.float64).ravel())


def _progress(line: str) -> None:
    """Weight loading takes seconds: say so where `serve run` and a terminal show it."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
