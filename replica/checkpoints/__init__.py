"""Where a model's weights, shape and tokenizer come from: ``registry.py`` resolves a model
name or path (built-in names, ``.gguf`` files via ``gguf.py``, Hugging Face folders via
``hf.py``), ``tokenizer.py`` turns text into ids and back with the model's chat template."""

from replica.checkpoints.registry import (
    BUILTIN_MODELS,
    SMOLLM2,
    TINY_MODEL,
    Checkpoint,
    CheckpointError,
    checkpoint_for,
    smollm2_path,
)

__all__ = [
    "BUILTIN_MODELS",
    "SMOLLM2",
    "TINY_MODEL",
    "Checkpoint",
    "CheckpointError",
    "checkpoint_for",
    "smollm2_path",
]
