"""A GGUF file's metadata and tensor table, read straight from its bytes.

``gguf.GGUFReader`` builds a numpy view for every part of every field, ~150,000 of them for
SmolLM2's tokenizer arrays: 3.8 s, paid by every process that resolves the default model
(the app's build task, the ingress, every replica). This reads the same header in a tenth
of a second: ``struct`` for scalars and strings, ``numpy`` for numeric arrays, tensors as
views of one read-only mapping. ``tests/test_checkpoints.py`` holds it to ``GGUFReader``
field by field and tensor by tensor.

Layout (GGUF v2 and v3, little-endian): magic ``GGUF``, version u32, tensor count u64,
metadata count u64; each metadata entry a string key, a u32 type, a value (an array is an
element type u32, a count u64 and its elements); each tensor a string name, a u32 rank,
u64 dims (innermost first), a u32 ggml type, a u64 offset into the data section, which
starts at the next multiple of ``general.alignment`` (32 unless set).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
STRING, ARRAY = 8, 9
# GGUF value type -> struct format of one scalar (STRING and ARRAY are read apart)
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
# ggml tensor types stored as plain numbers (the rest are quantized blocks of bytes)
_PLAIN = {
    0: np.float32,
    1: np.float16,
    24: np.int8,
    25: np.int16,
    26: np.int32,
    27: np.int64,
    28: np.float64,
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # innermost first, as the file stores them
    ggml_type: int
    offset: int  # from the start of the file


class GGUFFile:
    """``metadata`` (key -> int, float, bool, str or list) and ``tensors`` of one file."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = len(MAGIC)
        if self._map[:4] != MAGIC:
            raise ValueError("no GGUF magic")
        version, n_tensors, n_fields = self._unpack("<IQQ")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (2 and 3 are read)")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I")[0])
        infos = [self._tensor_info() for _ in range(n_tensors)]
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors = [TensorInfo(n, d, t, start + o) for n, d, t, o in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("a tensor name appears twice")

    def data(self, tensor: TensorInfo) -> np.ndarray:
        """The tensor's stored data (read-only), shaped as ``gguf.GGUFReader`` shapes it:
        numbers outermost dim first; quantized types as rows of bytes."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        shape = tuple(reversed(tensor.dims))
        plain = _PLAIN.get(tensor.ggml_type)
        if plain is not None:
            dtype, count = np.dtype(plain), int(np.prod(shape))
        else:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(tensor.ggml_type)]
            if shape[-1] % block:
                raise ValueError(f"{tensor.name}: a row is not a whole number of blocks")
            shape = (*shape[:-1], shape[-1] // block * size)
            dtype, count = np.dtype(np.uint8), int(np.prod(shape))
        if tensor.offset + count * dtype.itemsize > len(self._map):
            raise ValueError(f"{tensor.name}: the file ends inside its data")
        return np.frombuffer(self._map, dtype, count, tensor.offset).reshape(shape)

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        raw = self._map[self._pos : self._pos + n]
        if len(raw) != n:
            raise ValueError("the file ends inside a string")
        self._pos += n
        return raw.decode("utf-8")

    def _value(self, kind: int) -> Any:
        if kind == STRING:
            return self._string()
        if kind == ARRAY:
            item, count = self._unpack("<IQ")
            return self._array(item, count)
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self._unpack("<" + fmt)[0]

    def _array(self, item: int, count: int) -> list[Any]:
        if item == STRING:
            return [self._string() for _ in range(count)]
        if item == ARRAY:
            return [self._value(ARRAY) for _ in range(count)]
        fmt = _SCALARS.get(item)
        if fmt is None:
            raise ValueError(f"unknown GGUF array type {item}")
        dtype = np.dtype("<" + fmt) if fmt != "?" else np.dtype(np.bool_)
        if self._pos + count * dtype.itemsize > len(self._map):
            raise ValueError("the file ends inside an array")
        values = np.frombuffer(self._map, dtype, count, self._pos)
        self._pos += count * dtype.itemsize
        return values.tolist()

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        (rank,) = self._unpack("<I")
        dims = self._unpack(f"<{rank}Q")
        kind, offset = self._unpack("<IQ")
        return name, tuple(dims), kind, offset
