"""The README stays true to the code where a test can tell: every configuration field is in
its Configuration section, every module in its architecture table, and every experiment
has a reproducing command (in docs/results.md, or the README next to its numbers)."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel

from bench.__main__ import EXPERIMENTS
from cluster.config import Autoscaling, ClusterArgs
from kvindex.config import IndexConfig
from replica.config import EngineConfig
from replica.move_config import MoveConfig
from replica.store.config import StoreConfig
from router.config import SECTIONS

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
RESULTS = (ROOT / "docs" / "results.md").read_text()


def section(title: str) -> str:
    start = README.index(f"## {title}")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else len(README)]


def test_every_configuration_field_is_documented() -> None:
    config = section("Configuration")
    models: list[type[BaseModel]] = [
        ClusterArgs,
        Autoscaling,
        EngineConfig,
        *SECTIONS,
        IndexConfig,
        StoreConfig,
        MoveConfig,
    ]
    missing = [
        f"{model.__name__}.{name}"
        for model in models
        for name in model.model_fields
        if f"`{name}`" not in config
    ]
    assert missing == []


def test_every_experiment_has_a_reproducing_command() -> None:
    commands = set(re.findall(r"python -m bench (\w+)", README + RESULTS))
    assert set(EXPERIMENTS) <= commands, set(EXPERIMENTS) - commands


def test_every_module_is_in_the_architecture_table() -> None:
    architecture = section("Architecture")
    root = ROOT
    modules = [
        p
        for package in ("kvindex", "replica", "router", "cluster", "bench")
        for p in sorted((root / package).rglob("*.py"))
        if not p.name.startswith("__")
    ]
    missing = [str(p.relative_to(root)) for p in modules if f"`{p.name}`" not in architecture]
    assert missing == []
