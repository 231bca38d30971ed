"""Llama 3, Qwen2.5 and Qwen3 models, held to transformers.

For each family a random-weight model that transformers builds from a small config
(``bench.model_families``: a few layers, grouped query heads, the family's quirks on) is
saved as a Hugging Face folder and loaded by us. In float32: 32 greedy tokens equal to
transformers' on 8 chat prompts (up to ~1,000 tokens), logits within 1e-3. In bfloat16 (the
dtype we serve): alone, batched, behind a cached prefix and chunked give the same tokens and
bitwise the same logits. Each GGUF type written from the same weights loads to exactly what
``gguf`` dequantizes, and the F32 file to exactly the folder's weights.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from chat_prompts import CONVERSATIONS, chat_prompts
from conftest import RowsByPosition, transformers_greedy
from gguf.constants import GGMLQuantizationType as Q
from gguf_files import write_gguf

from bench.model_families import FAMILIES, LLAMA3_ROPE, build_family
from replica.checkpoints import CheckpointError, checkpoint_for
from replica.checkpoints.gguf import ROPE_FREQS, GGUFCheckpoint, hf_name, unpermute_rotary
from replica.checkpoints.hf import HFFolderCheckpoint
from replica.config import EngineConfig
from replica.engine.engine import Engine
from replica.engine.step import ScheduledBatch
from replica.model.runner import ModelRunner
from replica.sampling.params import SamplingParams

NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
LOGIT_TOLERANCE = 1e-3
FAMILY_NAMES = sorted(FAMILIES)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: build_family(f, root / f) for f in FAMILY_NAMES}


class Rows:
    """The real runner, keeping each sampled row (float32: clone; bfloat16 runs: digest)."""

    def __init__(self, runner: ModelRunner, keep) -> None:
        self.runner, self.keep_as = runner, keep
        self.rows = RowsByPosition()
        self.batches: list[ScheduledBatch] = []

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        logits = self.runner.execute(batch)
        self.batches.append(batch)
        self.rows.keep(batch, logits, self.keep_as)
        return logits


def digest(row: torch.Tensor) -> bytes:
    return hashlib.blake2b(row.numpy().tobytes(), digest_size=16).digest()


def engine_on(folder: Path, dtype: str, keep, **config) -> tuple[Engine, Rows]:
    engine_config = EngineConfig(model=str(folder), dtype=dtype, num_blocks=512, **config)
    rows = Rows(ModelRunner(engine_config), keep)
    return Engine(engine_config, runner=rows), rows


def transformers_reference(folder: Path, prompts: list[list[int]]):
    """transformers' greedy tokens and the logits behind each, prompt by prompt."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return transformers_greedy(model, prompts, NEW_TOKENS)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_float32_greedy_tokens_and_logits_equal_transformers(folders, family) -> None:
    folder = folders[family]
    prompts = chat_prompts(checkpoint_for(str(folder)).tokenizer())
    assert max(len(p) for p in prompts) > 900
    reference = transformers_reference(folder, prompts)
    engine, rows = engine_on(folder, "float32", torch.Tensor.clone)
    outs = engine.generate(prompts, GREEDY)
    for out, (tokens, logits) in zip(outs, reference, strict=True):
        assert out.token_ids == tokens
        ours = rows.rows[out.request_id][-NEW_TOKENS:]
        worst = max(float((a - b).abs().max()) for a, b in zip(ours, logits, strict=True))
        assert worst < LOGIT_TOLERANCE, (family, worst)
    assert len({tuple(t) for t, _ in reference}) == len(prompts)  # each its own answer
    engine.check_invariants()


def test_the_family_quirks_are_what_the_outputs_depend_on(folders) -> None:
    """The tests above can fail: each family's shape switches its quirk on, and the Llama 3
    model served without its rotary scaling (what the engine did before) answers otherwise."""
    shapes = {f: checkpoint_for(str(folders[f])).shape for f in FAMILY_NAMES}
    assert shapes["llama3"].rope_freq_factors is not None
    assert len(set(shapes["llama3"].rope_freq_factors)) > 3  # kept, blended and slowed
    assert shapes["qwen2"].qkv_bias and not shapes["qwen2"].qk_norm
    assert shapes["qwen3"].qk_norm and shapes["qwen3"].q_size != shapes["qwen3"].hidden_size
    folder = folders["llama3"]
    prompts = chat_prompts(checkpoint_for(str(folder)).tokenizer())
    reference = [tokens for tokens, _ in transformers_reference(folder, prompts)]
    unscaled = folder.parent / "llama3-unscaled"
    shutil.copytree(folder, unscaled)
    config = json.loads((unscaled / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": LLAMA3_ROPE["rope_theta"]}
    (unscaled / "config.json").write_text(json.dumps(config))
    engine, _ = engine_on(unscaled, "float32", torch.Tensor.clone)
    outs = engine.generate(prompts, GREEDY)
    assert sum(o.token_ids == t for o, t in zip(outs, reference, strict=True)) <= 2


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_bfloat16_alone_batched_cached_and_chunked_are_bitwise_the_same(folders, family) -> None:
    folder = folders[family]
    prompts = chat_prompts(checkpoint_for(str(folder)).tokenizer())

    def run(**config) -> list[tuple[list[int], list[bytes]]]:
        engine, rows = engine_on(folder, "bfloat16", digest, **config)
        outs = engine.generate(prompts, GREEDY)
        engine.check_invariants()
        return [(o.token_ids, rows.rows.upto(o.request_id, NEW_TOKENS)) for o in outs]

    engine, rows = engine_on(folder, "bfloat16", digest, enable_prefix_cache=False)
    alone = []
    for p in prompts:
        out = engine.generate([p], GREEDY)[0]
        alone.append((out.token_ids, rows.rows.upto(out.request_id, NEW_TOKENS)))
    assert len({tuple(t) for t, _ in alone}) == len(prompts)
    assert run(enable_prefix_cache=False) == alone  # batched: prefills beside decodes
    assert run(max_num_batched_tokens=64) == alone  # chunked over many steps
    engine, rows = engine_on(folder, "bfloat16", digest)
    engine.generate([prompts[1]], GREEDY)  # the shared system prompt is cached now
    outs = engine.generate(prompts, GREEDY)
    assert all(outs[i].num_cached_tokens >= 256 for i in (2, 3))
    cached = [(o.token_ids, rows.rows.upto(o.request_id, NEW_TOKENS)) for o in outs]
    assert cached == alone


GGUF_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q6_K, Q.Q5_K, Q.Q4_K, Q.Q4_1)
# the worst weight error relative to the tensor's largest weight, by the type's precision
GGUF_ERROR = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 1e-2, Q.Q6_K: 2e-2}
GGUF_ERROR |= {Q.Q5_K: 4e-2, Q.Q4_K: 8e-2, Q.Q4_1: 8e-2}


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_gguf_type_loads_to_what_gguf_dequantizes(folders, family, tmp_path) -> None:
    folder = folders[family]
    source = HFFolderCheckpoint(folder)
    original = source.state_dict()
    for kind in GGUF_TYPES:
        path = tmp_path / f"{family}-{kind.name}.gguf"
        stored = write_gguf(folder, path, kind)
        checkpoint = GGUFCheckpoint(path)
        assert_same_shape(checkpoint.shape.model_dump(), source.shape.model_dump())
        loaded = checkpoint.state_dict()
        assert set(loaded) == set(original)
        types = {t for _, t in stored.values()}
        assert kind in types
        for gguf_name, (data, stored_type) in stored.items():
            if gguf_name == ROPE_FREQS:
                continue
            want = gguf.quants.dequantize(data, stored_type).astype(np.float32)
            name = hf_name(gguf_name)
            if family == "llama3" and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = source.shape.num_heads if "q_proj" in name else source.shape.num_kv_heads
                want = unpermute_rotary(want, heads)
            assert np.array_equal(loaded[name].numpy(), want), (kind.name, name)
            scale = float(original[name].abs().max())
            error = float((loaded[name] - original[name]).abs().max()) / scale
            assert error <= GGUF_ERROR[stored_type], (kind.name, name, error)


def assert_same_shape(ours: dict, want: dict) -> None:
    """The same shape, floats as a GGUF file stores them (float32)."""
    for key, value in want.items():
        floats = isinstance(value, tuple) and bool(value) and isinstance(value[0], float)
        if key == "eos_token_ids":
            assert set(value) <= set(ours[key]) or set(ours[key]) <= set(value)
        elif isinstance(value, float) or floats:
            assert ours[key] == pytest.approx(value, rel=1e-6), key
        else:
            assert ours[key] == value, key


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_the_f32_gguf_serves_what_the_folder_serves(folders, family, tmp_path) -> None:
    """Same weights through the GGUF path (llama.cpp's layout): bitwise the same tokens and
    logits. The file's chat template renders the same prompts; the ids are compared for
    Llama only, because our test vocabulary is SmolLM2's GPT-2 style BPE and transformers
    converts a Qwen GGUF's vocabulary with Qwen's own pre-tokenizer (as a real Qwen file
    needs)."""
    folder = folders[family]
    path = tmp_path / f"{family}.gguf"
    write_gguf(folder, path, Q.F32)
    ours, theirs = checkpoint_for(str(folder)).tokenizer(), checkpoint_for(str(path)).tokenizer()
    for system, user in CONVERSATIONS:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        assert ours.render_chat(messages) == theirs.render_chat(messages)
    from_folder = chat_prompts(ours)
    if family == "llama3":
        assert chat_prompts(theirs) == from_folder
    runs = []
    for model in (folder, path):
        engine, rows = engine_on(model, "bfloat16", digest)
        outs = engine.generate(from_folder[:3], GREEDY)
        runs.append([(o.token_ids, rows.rows.upto(o.request_id, NEW_TOKENS)) for o in outs])
    assert runs[0] == runs[1]


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({"model_type": "qwen2_moe", "num_experts": 8}, "mixture-of-experts"),
        ({"model_type": "qwen2_vl", "vision_config": {}}, "multimodal"),
        ({"model_type": "qwen2", "use_sliding_window": True}, "sliding-window"),
        ({"model_type": "mistral", "sliding_window": 4096}, "served architectures"),
        ({"model_type": "llama", "rope_parameters": {"rope_type": "yarn"}}, "rope_type 'yarn'"),
        ({"model_type": "qwen3", "attention_bias": True}, "attention_bias"),
    ],
)
def test_what_is_not_served_is_refused_by_name(folders, tmp_path, config, reason) -> None:
    folder = tmp_path / "model"
    shutil.copytree(folders["qwen3"], folder)
    hf = json.loads((folder / "config.json").read_text()) | config
    (folder / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match=reason):
        checkpoint_for(str(folder))
