"""Model checkpoints: what each format gives, and one clear sentence for what is not one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pydantic
import pytest

from cluster.config import ClusterArgs
from replica.checkpoints import SMOLLM2, CheckpointError, checkpoint_for, smollm2_path
from replica.checkpoints.gguf import hf_name, unpermute_rotary
from replica.checkpoints.hf import export_hf_folder
from replica.config import EngineConfig
from replica.model.runner import ModelRunner


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q and K rows (its own formula)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def test_unpermute_undoes_llama_cpps_rotary_permutation() -> None:
    rng = np.random.default_rng(0)
    for heads, rows in ((9, 576), (3, 192), (2, 8)):
        weight = rng.standard_normal((rows, 5)).astype(np.float32)
        assert np.array_equal(unpermute_rotary(llama_cpp_permute(weight, heads), heads), weight)
        assert not np.array_equal(llama_cpp_permute(weight, heads), weight)


def test_gguf_names_map_to_hugging_face_names() -> None:
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    with pytest.raises(KeyError):
        hf_name("blk.0.attn_qkv.weight")


def test_smollm2_is_built_in_with_its_real_shape_and_name() -> None:
    config = EngineConfig(model=SMOLLM2)
    assert config.model_id == SMOLLM2
    shape = config.shape
    assert (shape.num_layers, shape.hidden_size, shape.num_heads, shape.num_kv_heads) == (
        30,
        576,
        9,
        3,
    )
    assert shape.vocab_size == 49152 and shape.tie_word_embeddings
    assert shape.rope_theta == 100000.0 and config.context_len == 8192
    assert shape.eos_token_ids == (0, 2)
    assert ClusterArgs().engine.model == SMOLLM2  # served by default


def test_an_exported_folder_loads_back_to_the_same_weights(tmp_path: Path) -> None:
    original = checkpoint_for(SMOLLM2)
    folder = export_hf_folder(original, tmp_path / "smollm2-hf")
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] == 100000.0  # transformers 5's place
    del config["rope_theta"]  # as transformers 5 writes it: only under rope_parameters
    (folder / "config.json").write_text(json.dumps(config))
    loaded = checkpoint_for(str(folder))
    assert loaded.shape == original.shape
    a, b = original.state_dict(), loaded.state_dict()
    assert set(b) == set(a) - {"lm_head.weight"}
    assert all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in b)
    assert loaded.tokenizer().render_chat([{"role": "user", "content": "Hi"}]) == (
        original.tokenizer().render_chat([{"role": "user", "content": "Hi"}])
    )


def bad_models(tmp_path: Path) -> dict[str, Path]:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 100)
    truncated = tmp_path / "truncated.gguf"
    with open(smollm2_path(), "rb") as f:
        truncated.write_bytes(f.read(4_000_000))  # the header and a few tensors
    no_config = tmp_path / "empty-folder"
    no_config.mkdir()
    not_llama = tmp_path / "gpt2-folder"
    not_llama.mkdir()
    (not_llama / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    return {"garbage": garbage, "truncated": truncated, "empty": no_config, "gpt2": not_llama}


def test_a_bad_checkpoint_fails_at_start_with_one_sentence_naming_it(tmp_path: Path) -> None:
    for kind, path in bad_models(tmp_path).items():
        with pytest.raises((CheckpointError, pydantic.ValidationError)) as info:
            ModelRunner(EngineConfig(model=str(path)))  # what a replica does when it starts
        message = str(info.value)
        assert str(path) in message, (kind, message)
        assert "Traceback" not in message
    with pytest.raises(pydantic.ValidationError, match="neither a built-in model"):
        ClusterArgs(engine={"model": "no-such-model"})


def test_our_gguf_header_reader_reads_what_the_gguf_package_reads() -> None:
    """``GGUFFile`` (ours, fast) against ``gguf.GGUFReader`` (the reference) on SmolLM2:
    every metadata field, every tensor's name, type, shape and bytes."""
    import gguf

    from replica.checkpoints.gguf_file import GGUFFile

    path = smollm2_path()
    ours, reference = GGUFFile(path), gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert fields.keys() == ours.metadata.keys()
    assert all(fields[k] == ours.metadata[k] for k in fields)
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152
    assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
    for mine, theirs in zip(ours.tensors, reference.tensors, strict=True):
        assert mine.ggml_type == theirs.tensor_type.value
        data = ours.data(mine)
        assert (data.shape, data.dtype) == (theirs.data.shape, theirs.data.dtype), mine.name
        assert data.tobytes() == theirs.data.tobytes(), mine.name
