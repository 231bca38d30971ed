"""Every result table the README and docs/results.md place after a marker naming a kept run
(``<!-- table: docs/results/<run>.json -->``) is exactly what ``bench.tables`` renders from
that run: a table cannot drift from the JSON it came from, nor from the commit and CPU it
names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench.tables import render

ROOT = Path(__file__).resolve().parent.parent
DOCS = {name: (ROOT / name).read_text() for name in ("README.md", "docs/results.md")}
MARKER = re.compile(r"<!-- table: (\S+) -->\n")
PLACED = [(doc, m.group(1), m.end()) for doc, text in DOCS.items() for m in MARKER.finditer(text)]


def test_the_kept_runs_have_tables() -> None:
    kept = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs" / "results").glob("*.json")}
    placed = {path for _, path, _ in PLACED}
    assert kept and kept <= placed, kept - placed


@pytest.mark.parametrize(("doc", "path", "at"), PLACED, ids=[f"{d}:{p}" for d, p, _ in PLACED])
def test_a_placed_table_is_its_run_rendered(doc: str, path: str, at: int) -> None:
    expected = render(ROOT / path, path)
    assert DOCS[doc][at:].startswith(expected), f"{doc}: python -m bench.tables {path}"
