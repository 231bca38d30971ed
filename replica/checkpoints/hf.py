"""A Hugging Face Llama, Qwen2 or Qwen3 folder (``config.json``, ``*.safetensors``,
``tokenizer.json``), and the way back: any checkpoint written out as such a folder (for
transformers and vLLM)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from replica.checkpoints import Checkpoint, CheckpointError
from replica.checkpoints.families import FAMILY_SWITCHES, freq_factors, refusal, rope_parameters
from replica.checkpoints.registry import file_identity
from replica.checkpoints.shape import ModelShape
from replica.checkpoints.tokenizer import END_TOKENS, HFTokenizer, Tokenizer

if TYPE_CHECKING:  # torch loads with the weights, not with a tokenizer (the ingress's)
    import torch


class HFFolderCheckpoint(Checkpoint):
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.name = folder.name
        self._shape = _shape(folder)

    @property
    def shape(self) -> ModelShape:
        return self._shape

    def state_dict(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.folder}: no *.safetensors weights")
        state: dict[str, torch.Tensor] = {}
        for file in files:
            try:
                state.update(load_file(str(file)))
            except Exception as exc:  # a truncated or corrupt file
                raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from None
        return {k: v.float() for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}

    def identity(self) -> str:
        return file_identity(
            self.folder / "config.json", *sorted(self.folder.glob("*.safetensors"))
        )

    def tokenizer(self) -> Tokenizer:
        if not (self.folder / "tokenizer.json").is_file():
            raise CheckpointError(f"{self.folder}: no tokenizer.json")
        return HFTokenizer(str(self.folder))


def _shape(folder: Path) -> ModelShape:
    """Read ``config.json`` (a Llama, Qwen2 or Qwen3 config; anything else is refused with
    the reason, ``families.refusal``)."""
    try:
        hf = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{folder}: no readable config.json ({exc})") from None
    hf.setdefault("model_type", "llama")
    reason = refusal(hf)
    if reason:
        raise CheckpointError(f"{folder}: {reason}")
    eos = hf.get("eos_token_id")
    try:
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        return ModelShape(
            architecture=hf["model_type"],
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            intermediate_size=hf["intermediate_size"],
            rope_theta=rope_parameters(hf)["rope_theta"],
            rope_freq_factors=freq_factors(hf, head_dim),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            max_position=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            eos_token_ids=tuple(
                sorted({*(eos if isinstance(eos, list) else [eos]), *_end_tokens(folder)} - {None})
            ),
            **FAMILY_SWITCHES[hf["model_type"]],
        )
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"{folder}/config.json: incomplete or invalid ({exc})") from None


def _end_tokens(folder: Path) -> tuple[int, ...]:
    """Ids of the end-of-turn tokens ``tokenizer.json`` declares (the engine stops there)."""
    try:
        added = json.loads((folder / "tokenizer.json").read_text()).get("added_tokens", [])
    except (OSError, ValueError):
        return ()
    return tuple(sorted(t["id"] for t in added if t.get("content") in END_TOKENS))


_HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def hf_config(shape: ModelShape) -> dict[str, Any]:
    """``config.json`` of the Hugging Face model with this shape. A shape with scaled rotary
    frequencies (read from a GGUF file's factors) has no such config: refused."""
    if shape.rope_freq_factors is not None:
        raise CheckpointError("rotary frequency factors have no Hugging Face config to export")
    config = {
        "architectures": [_HF_CLASSES[shape.architecture]],
        "model_type": shape.architecture,
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "intermediate_size": shape.intermediate_size,
        "hidden_act": "silu",
        "rope_theta": shape.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "rms_norm_eps": shape.rms_norm_eps,
        "max_position_embeddings": shape.max_position,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "attention_bias": False,
        "eos_token_id": list(shape.eos_token_ids),
        "torch_dtype": "float32",
    }
    if shape.architecture == "llama":
        config["mlp_bias"] = False
    return config


def export_hf_folder(checkpoint: Checkpoint, folder: Path) -> Path:
    """Write ``checkpoint`` as a Hugging Face folder of its family (float32 safetensors, config and,
    for a real model, its tokenizer with the chat template), for peers to load."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    state = checkpoint.state_dict()
    if state is None:
        raise CheckpointError(f"{checkpoint.name}: random weights have no file to export")
    if checkpoint.shape.tie_word_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(hf_config(checkpoint.shape), indent=2))
    tokenizer = checkpoint.tokenizer()
    if isinstance(tokenizer, HFTokenizer):
        tokenizer.save(str(folder))
    return folder


if __name__ == "__main__":  # `make install-vllm`: python -m replica.checkpoints.hf MODEL FOLDER
    import sys

    from replica.checkpoints.registry import checkpoint_for

    export_hf_folder(checkpoint_for(sys.argv[1]), Path(sys.argv[2]))
