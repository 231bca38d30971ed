"""The code's shape, checked: packages depend one way only, and nothing grows unreadable.

Layers, lowest first: ``replica`` (one engine replica: engine, block hash, index client) <
``router`` (policies and the Ray Serve request router) < ``cluster`` (the serving application)
< ``bench`` (measurement tools). A module may import its own layer or a lower
one, never a higher one; the measurement tools may use the application, never the reverse.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LAYERS = ["replica", "router", "cluster", "bench"]
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 300
LONG_FILE_MARK = "Longer than 300 lines because"


def layer_of(module: str) -> int | None:
    """The layer a dotted module name belongs to (the most specific match), or None."""
    matches = [
        i for i, name in enumerate(LAYERS) if module == name or module.startswith(name + ".")
    ]
    return max(matches) if matches else None


def source_files() -> Iterator[tuple[str, Path]]:
    for package in ("replica", "router", "cluster"):
        for path in sorted((REPO / package).rglob("*.py")):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            yield module.removesuffix(".__init__"), path


def imported_modules(tree: ast.AST, module: str) -> Iterator[str]:
    """Every module an ``import`` or ``from ... import`` names (relative ones resolved)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: -node.level]
                yield ".".join([*base, node.module] if node.module else base)
            elif node.module:
                yield node.module
                yield from (f"{node.module}.{alias.name}" for alias in node.names)


def test_layer_of_picks_the_most_specific_layer() -> None:
    assert layer_of("replica.engine") == 0
    assert layer_of("router.policies") == 1
    assert layer_of("cluster.ingress") == 2
    assert layer_of("bench.workloads") == 3
    assert layer_of("ray.serve") is None


def test_no_package_imports_a_package_above_it() -> None:
    upward = []
    for module, path in source_files():
        own = layer_of(module)
        assert own is not None
        for target in imported_modules(ast.parse(path.read_text()), module):
            layer = layer_of(target)
            if layer is not None and layer > own:
                upward.append(f"{path.relative_to(REPO)} imports {target}")
    assert upward == []


def test_the_check_catches_an_upward_import() -> None:
    tree = ast.parse("from cluster.config import ClusterArgs\nimport router.policies")
    targets = list(imported_modules(tree, "replica.deployment"))
    assert [t for t in targets if (layer_of(t) or 0) > layer_of("replica.deployment")]


@pytest.mark.parametrize(("module", "path"), list(source_files()), ids=lambda v: str(v))
def test_functions_and_files_stay_short(module: str, path: Path) -> None:
    text = path.read_text()
    tree = ast.parse(text)
    long_functions = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long_functions == []
    if len(text.splitlines()) > MAX_FILE_LINES:
        assert LONG_FILE_MARK in (ast.get_docstring(tree) or ""), (
            f"{module} has over {MAX_FILE_LINES} lines; split it or say why at its top"
        )
