"""The code's shape, checked: packages depend one way only, and nothing grows unreadable.

``kvindex`` (the block hash and the index contract) is at the bottom; ``replica`` (one engine
replica) and ``router`` (routing) each stand on it and never on each other; ``cluster`` (the
serving application) wires both; ``bench`` (measurement, not in the wheel) may use any of
them, and nothing uses it. Folders are split by concept, not by a count of modules (the
README's architecture table names each folder's); a file over 300 lines says at its top
which one concept keeps it whole.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# package -> the packages it may import (besides itself)
ALLOWED = {
    "kvindex": set(),
    "replica": {"kvindex"},
    "router": {"kvindex"},
    "cluster": {"kvindex", "replica", "router"},
    "bench": {"kvindex", "replica", "router", "cluster"},
}
PRODUCT = ("kvindex", "replica", "router", "cluster")
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 300
LONG_FILE_MARK = "Longer than 300 lines because"


def package_of(module: str) -> str | None:
    top = module.split(".")[0]
    return top if top in ALLOWED else None


def source_files(packages: tuple[str, ...] = tuple(ALLOWED)) -> Iterator[tuple[str, Path]]:
    for package in packages:
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


def violations(tree: ast.AST, module: str) -> list[str]:
    own = package_of(module)
    assert own is not None
    return [
        target
        for target in imported_modules(tree, module)
        if (package := package_of(target)) is not None
        and package != own
        and package not in ALLOWED[own]
    ]


def test_no_package_imports_one_it_may_not() -> None:
    found = []
    for module, path in source_files():
        found += [
            f"{path.relative_to(REPO)} imports {t}"
            for t in violations(ast.parse(path.read_text()), module)
        ]
    assert found == []


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("router.serve.router", "from replica.messages import EngineRequest"),
        ("replica.deployment", "import router.policies"),
        ("kvindex.reader", "from replica.engine.engine import Engine"),
        ("cluster.app", "from bench.harness.launcher import ServeCluster"),
        ("replica.engine.engine", "from cluster.config import ClusterArgs"),
    ],
)
def test_the_check_catches_a_forbidden_import(module: str, source: str) -> None:
    assert violations(ast.parse(source), module)


# replica/'s rooms, floor by floor (lowest first): a room may import its own floor's modules
# and those below, never above. One-module rooms are named by module.
REPLICA_FLOORS = (
    ("replica.errors", "replica.checkpoints", "replica.config", "replica.telemetry"),
    ("replica.sampling",),
    ("replica.messages",),
    ("replica.engine",),
    ("replica.kv",),
    ("replica.model", "replica.store"),
    ("replica.vllm",),  # vLLM's engine serves in the dtype ours would (replica.model.cpu)
    (
        "replica.args",
        "replica.balance",
        "replica.deployment",
        "replica.engine_loop",
        "replica.handoff",
        "replica.leaving",
        "replica.move_config",
        "replica.moves",
        "replica.process",
        "replica.publisher",
        "replica.pull",
        "replica.pull_config",
        "replica.store_publisher",
        "replica.trace_spans",
        "replica.vllm_replica",
    ),
)
# the two rooms of one floor that may not import each other either
APART = {("replica.model", "replica.store"), ("replica.store", "replica.model")}


def room_of(module: str) -> str | None:
    for floor in REPLICA_FLOORS:
        for room in floor:
            if module == room or module.startswith(room + "."):
                return room
    return None


def floor_of(room: str) -> int:
    return next(i for i, floor in enumerate(REPLICA_FLOORS) if room in floor)


def room_violations(tree: ast.AST, module: str) -> list[str]:
    """Imports of ``module`` (inside replica/) that go up a floor, or across rooms kept apart
    (the floor's top modules import each other freely: they are the replica itself)."""
    own = room_of(module)
    assert own is not None, module
    found = []
    for target in imported_modules(tree, module):
        room = room_of(target)
        if room is None or room == own:
            continue
        if floor_of(room) > floor_of(own) or (own, room) in APART:
            found.append(target)
    return found


def test_replicas_rooms_are_floors() -> None:
    modules = [(m, p) for m, p in source_files(("replica",)) if m != "replica"]
    unplaced = [m for m, _ in modules if room_of(m) is None]
    assert unplaced == []  # every module of replica/ is in a room of the plan
    found = [
        f"{path.relative_to(REPO)} imports {t}"
        for module, path in modules
        for t in room_violations(ast.parse(path.read_text()), module)
    ]
    assert found == []


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("replica.engine.engine", "from replica.model.runner import ModelRunner"),
        ("replica.engine.engine", "from replica.store.tier import StoreTier"),
        ("replica.sampling.sampler", "from replica.engine.sequence import Sequence"),
        ("replica.messages", "from replica.engine.sequence import Sequence"),
        ("replica.checkpoints.gguf", "from replica.model.llama import LlamaForCausalLM"),
        ("replica.kv.transfer", "from replica.model.attention import KVCache"),
        ("replica.model.runner", "from replica.store.tier import StoreTier"),
    ],
)
def test_the_room_check_catches_an_import_up_a_floor(module: str, source: str) -> None:
    assert room_violations(ast.parse(source), module)


SERVE_PRIVATE = ("ray.serve._private", "serve_context._")
# Serve's replica object, read for the flag it sets when it starts stopping its replica
REPLICA_PRIVATE = ("_replica_impl", "_shutting_down", "ray._private")


def test_serves_private_parts_are_used_in_the_serve_room_only() -> None:
    """Ray Serve's private modules and names change between releases: every use is in
    ``router/serve/`` (the adapter), so a Ray upgrade touches one room; and one module of
    the replica's, ``replica.leaving`` (the stop flag, for which Serve has no API)."""
    outside = [
        f"{path.relative_to(REPO)}: {needle}"
        for module, path in source_files(PRODUCT)
        if module != "replica.leaving"
        for needle in REPLICA_PRIVATE
        if needle in path.read_text()
    ]
    assert outside == []
    outside = [
        f"{path.relative_to(REPO)}: {needle}"
        for module, path in source_files(PRODUCT)
        if not module.startswith("router.serve")
        for needle in SERVE_PRIVATE
        if needle in path.read_text()
    ]
    inside = [
        needle
        for _, path in source_files(("router",))
        if "/serve/" in path.as_posix()
        for needle in SERVE_PRIVATE
        if needle in path.read_text()
    ]
    assert outside == [] and set(inside) == set(SERVE_PRIVATE)  # and there they are


def test_the_wheel_holds_only_what_serves() -> None:
    text = (REPO / "pyproject.toml").read_text()
    include = text.split("[tool.setuptools.packages.find]")[1].split("\n\n")[0]
    assert all(f'"{p}*"' in include for p in PRODUCT) and "bench" not in include


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


def test_building_the_app_and_a_tiny_ingress_load_no_torch() -> None:
    """Every deploy imports ``cluster.app`` in a Ray worker of its own to build the app, and
    an ingress imports ``cluster.ingress``: neither needs torch (~2-3 s of import on 2
    cores, ~190 MB in the ingress), which loads in the engine replicas only. A real model's
    ingress still loads it: transformers' tokenizer imports it."""
    script = (
        "import sys\n"
        "import cluster.app, cluster.ingress\n"
        "from cluster.config import ClusterArgs\n"
        "from replica.checkpoints import checkpoint_for\n"
        "args = ClusterArgs.model_validate({'engine': {'model': 'tiny-llama-6m'}})\n"
        "checkpoint_for(args.engine.model).tokenizer().encode('hello')\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))[:3])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
