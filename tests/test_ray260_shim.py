"""The start-up shim that lets Ray 2.60's KV-aware ingress import under vLLM 0.32
(``bench/peers/ray260_vllm_shim.py``): the old module name answers with the new module,
and only when the new one exists."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.peers import ray260_vllm_shim as shim


@pytest.fixture
def fake_vllm(tmp_path: Path) -> Iterator[Path]:
    """A package named ``vllm`` with the new module only, first on the path."""
    root = tmp_path / "vllm"
    (root / "renderers").mkdir(parents=True)
    (root / "entrypoints").mkdir()
    for init in (root, root / "renderers", root / "entrypoints"):
        (init / "__init__.py").write_text("")
    (root / "renderers" / "chat_utils.py").write_text("def load_chat_template():\n    return 42\n")
    sys.path.insert(0, str(tmp_path))
    try:
        yield root
    finally:
        sys.path.remove(str(tmp_path))
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, shim._Alias)]
        for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
            del sys.modules[name]


def test_the_old_name_imports_the_moved_module(fake_vllm: Path) -> None:
    """Without the shim the old name fails; with it, both names are one module."""
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(shim.OLD)
    shim.install()
    shim.install()  # twice: one finder
    assert sum(isinstance(f, shim._Alias) for f in sys.meta_path) == 1
    old = importlib.import_module(shim.OLD)
    assert old is importlib.import_module(shim.NEW)
    assert old.load_chat_template() == 42


def test_without_the_new_module_the_old_name_still_fails(fake_vllm: Path) -> None:
    """An older vLLM (no ``vllm.renderers.chat_utils``) is left alone."""
    (fake_vllm / "renderers" / "chat_utils.py").unlink()
    shim.install()
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(shim.OLD)
