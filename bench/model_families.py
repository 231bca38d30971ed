"""Small random-weight models of each served family, built by transformers with no download.

Each family has its quirks switched on (Llama 3: ``rope_type: llama3`` with a short original
context, so the scaling changes most frequencies, and tied embeddings; Qwen2.5: biases on
Q, K and V; Qwen3: per-head Q/K norms and a head size that is not hidden / heads), grouped
query heads at ratios the built-in models do not use, and the family's own chat template
(``bench/chat_templates``) on SmolLM2's BPE vocabulary with the family's special tokens.
Biases and norm weights are drawn at random too (transformers starts them at 0 and 1, which
would hide a bias or a norm applied in the wrong place), and the weights' scale (0.1) makes
greedy output depend on the whole context.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from replica.checkpoints import SMOLLM2, checkpoint_for

TEMPLATES = Path(__file__).parent / "chat_templates"
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}
# family -> (transformers config class, its fields, special tokens, bos, eos)
FAMILIES: dict[str, tuple[str, dict[str, Any], list[str], str | None, str]] = {
    "llama3": (
        "LlamaConfig",
        {
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "rope_parameters": LLAMA3_ROPE,
            "tie_word_embeddings": True,
        },
        [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
        ],
        "<|begin_of_text|>",
        "<|eot_id|>",
    ),
    "qwen2": (
        "Qwen2Config",
        {
            "hidden_size": 256,
            "num_attention_heads": 8,
            "num_key_value_heads": 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "tie_word_embeddings": False,
        },
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"],
        None,
        "<|im_end|>",
    ),
    "qwen3": (
        "Qwen3Config",
        {
            "hidden_size": 256,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "tie_word_embeddings": True,
        },
        [
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<tool_call>",
            "</tool_call>",
            "<think>",
            "</think>",
        ],
        None,
        "<|im_end|>",
    ),
}
COMMON = {
    "num_hidden_layers": 3,
    "intermediate_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.1,
}


# Llama-3.2-1B's real shape (its config.json), for the speed benchmark's random weights
LLAMA_3_2_1B = {
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {**LLAMA3_ROPE, "factor": 32.0, "original_max_position_embeddings": 8192},
    "tie_word_embeddings": True,
}


# seed 0's Qwen3 (head size 128) answers two of the eight test prompts with one repeated
# token; the tests need every prompt its own answer, so that a wrong cache hit shows
SEEDS = {"qwen3": 1}


def family_tokenizer(family: str) -> Any:
    """SmolLM2's BPE with the family's special tokens, BOS/EOS and chat template."""
    _, _, specials, bos, eos = FAMILIES[family]
    base = checkpoint_for(SMOLLM2).tokenizer()
    folder = Path(base.hf.name_or_path)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.bos_token, tok.eos_token = bos, eos
    tok.chat_template = (TEMPLATES / f"{family}.jinja").read_text()
    return tok


def build_family(
    family: str, folder: Path, seed: int | None = None, shape: dict[str, Any] | None = None
) -> Path:
    """Write a random-weight model of ``family`` to ``folder`` as transformers saves it
    (float32 safetensors, config.json, tokenizer files with the chat template); ``shape``
    replaces the small test shape (its vocabulary may be larger than the tokenizer's)."""
    config_class, fields, _, _, _ = FAMILIES[family]
    tok = family_tokenizer(family)
    sizes = shape or {**COMMON, **fields, "vocab_size": len(tok)}
    config = getattr(transformers, config_class)(
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, **sizes
    )
    seed = SEEDS.get(family, 0) if seed is None else seed
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5, generator=gen)
            elif name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5, generator=gen)
    model.eval().save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder


if __name__ == "__main__":  # python -m bench.model_families FOLDER: Llama-3.2-1B's shape
    import sys

    build_family("llama3", Path(sys.argv[1]), shape=LLAMA_3_2_1B)
