"""Break each rule the README states about block bookkeeping, one at a time, in a copy of
the tree, and run the unit tests meant to hold it: every mutation must make a test fail.

    .venv/bin/python scripts/mutation_check.py      # about 3 minutes on 2 cores

Prints one line per mutation (the first failing test) and exits 1 if any survived.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENGINE_TESTS = ["tests/test_block_manager.py", "tests/test_scheduler.py", "tests/test_engine.py"]
NEWEST = "victim = max([seq, *pending], key=lambda s: order[id(s)])"
# (what the mutation breaks, file, text replaced, its replacement)
MUTATIONS = [
    (
        "lookup without the parent check",
        "replica/engine/prefix_cache.py",
        "and e.parent in level\n",
        "\n",
    ),
    (
        "preemption takes the oldest",
        "replica/engine/scheduler.py",
        NEWEST,
        NEWEST.replace("max", "min"),
    ),
    (
        "preemption takes the one needing the block",
        "replica/engine/scheduler.py",
        NEWEST,
        "victim = seq",
    ),
    (
        "cached blocks not available (preempt before evicting)",
        "replica/engine/block_allocator.py",
        "return len(self._free) + len(self._cached)",
        "return len(self._free)",
    ),
]


def survives(path: str, old: str, new: str) -> tuple[bool, str]:
    """Apply one mutation to a copy of the tree and run the tests; (survived, first failure)."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "tree"
        skip = shutil.ignore_patterns(".venv*", ".git", "results", "mutants", "*.egg-info")
        shutil.copytree(REPO, copy, ignore=skip)
        source = copy / path
        text = source.read_text()
        assert text.count(old) == 1, f"{path}: the mutated text must occur exactly once"
        source.write_text(text.replace(old, new))
        env = {**os.environ, "PYTHONPATH": str(copy), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
        run = subprocess.run(
            [*cmd, *ENGINE_TESTS], cwd=copy, env=env, capture_output=True, text=True
        )
        failed = [line for line in run.stdout.splitlines() if line.startswith("FAILED")]
        return run.returncode == 0, (failed[0] if failed else run.stdout[-300:])


def main() -> None:
    survivors = 0
    for name, path, old, new in MUTATIONS:
        survived, detail = survives(path, old, new)
        survivors += survived
        print(f"{'SURVIVED' if survived else 'caught'}: {name}: {detail}", flush=True)
    sys.exit(1 if survivors else 0)


if __name__ == "__main__":
    main()
