"""A Hugging Face folder of a served family written as a GGUF file, the way llama.cpp's
converter writes it: the architecture's metadata keys, the BPE vocabulary with its merges and
chat template, Llama's Q/K rows permuted into llama.cpp's rotary layout, Llama 3's rotary
scaling as a ``rope_freqs`` tensor, norms and biases in F32 and every matrix in the type
asked for (K-quants where a row is a multiple of 256, else Q8_0, as llama.cpp falls back).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from gguf.constants import GGMLQuantizationType as Q
from kquants import quantize_k
from safetensors.numpy import load_file

from replica.checkpoints.gguf import ROPE_FREQS, hf_name
from replica.checkpoints.hf import HFFolderCheckpoint

K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
_TENSOR_NAMES = ("token_embd", "output_norm", "output") + tuple(
    f"blk.{{}}.{n}"
    for n in (
        "attn_norm", "attn_q_norm", "attn_k_norm", "ffn_norm", "attn_q", "attn_k", "attn_v",
        "attn_output", "ffn_gate", "ffn_up", "ffn_down",
    )
)  # fmt: skip


def gguf_names(num_layers: int) -> dict[str, str]:
    """Hugging Face name -> GGUF name, for every tensor a family can have."""
    names = {}
    for pattern in _TENSOR_NAMES:
        for layer in range(num_layers) if "{}" in pattern else [None]:
            base = pattern.format(layer)
            for kind in ("weight", "bias"):
                names[hf_name(f"{base}.{kind}")] = f"{base}.{kind}"
    return names


def permute_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order: per head, the two halves interleaved as pairs."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def quantized(weight: np.ndarray, kind: Q) -> tuple[np.ndarray, Q]:
    """The stored array and its type: 1-D tensors stay F32 (llama.cpp keeps norms and
    biases so); a K-quant needs rows of 256, else Q8_0."""
    if weight.ndim == 1 or kind == Q.F32:
        return weight.astype(np.float32), Q.F32
    if kind in K_QUANTS:
        if weight.shape[-1] % 256:
            return gguf.quants.quantize(weight, Q.Q8_0), Q.Q8_0
        return quantize_k(weight, kind), kind
    return gguf.quants.quantize(weight, kind), kind


def write_gguf(folder: Path, path: Path, kind: Q) -> dict[str, tuple[np.ndarray, Q]]:
    """Write ``folder``'s model to ``path``; returns what each GGUF tensor holds (the stored
    array and its type), for the tests to dequantize themselves."""
    shape = HFFolderCheckpoint(folder).shape
    arch = shape.architecture
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(shape.max_position)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_block_count(shape.num_layers)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    writer.add_vocab_size(shape.vocab_size)
    _add_tokenizer(writer, folder)
    stored: dict[str, tuple[np.ndarray, Q]] = {}
    names = gguf_names(shape.num_layers)
    for name, weight in sorted(load_file(str(folder / "model.safetensors")).items()):
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = shape.num_heads if "q_proj" in name else shape.num_kv_heads
            weight = permute_rotary(weight, heads)
        stored[names[name]] = quantized(weight, kind)
    if shape.rope_freq_factors is not None:
        stored[ROPE_FREQS] = (np.array(shape.rope_freq_factors, np.float32), Q.F32)
    for name, (data, dtype) in stored.items():
        writer.add_tensor(name, data, raw_dtype=dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def _add_tokenizer(writer: gguf.GGUFWriter, folder: Path) -> None:
    """The BPE vocabulary as llama.cpp stores a GPT-2 style one, with the chat template."""
    spec = json.loads((folder / "tokenizer.json").read_text())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    vocab = dict(spec["model"]["vocab"])
    special = {t["content"]: t["id"] for t in spec["added_tokens"]}
    vocab.update(special)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    for key, add in (
        ("bos_token", writer.add_bos_token_id),
        ("eos_token", writer.add_eos_token_id),
    ):
        if config.get(key):
            add(vocab[config[key]])
    template = folder / "chat_template.jinja"
    writer.add_chat_template(
        template.read_text() if template.is_file() else config["chat_template"]
    )
