"""What a benchmark's peer leaves in ``/dev/shm`` is removed once it has stopped, and nothing
else is: ``bench.harness.memory.shm_sweep``, run around the Ray Serve LLM stack and every vLLM
worker.

The leak is made the way vLLM's message queues make it: a real child process creates a
``multiprocessing.shared_memory.SharedMemory`` segment and dies by SIGKILL without unlinking
it, after telling Python's resource tracker to forget it (the tracker would unlink it at
exit otherwise; in the stack, Ray kills the tracker together with vLLM's processes).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path

import pytest

from bench.harness.memory import SHM, shm_in_use, shm_sweep
from bench.peers.engines import WorkerSession

SIZE = 1 << 20
# create a segment, forget it in the resource tracker, print its name; then die by SIGKILL
# (no __del__, no atexit), or with "hold", wait on stdin with it mapped
CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from multiprocessing import resource_tracker, shared_memory
    segment = shared_memory.SharedMemory(create=True, size=int(sys.argv[1]))
    resource_tracker.unregister(segment._name, "shared_memory")
    print(segment.name, flush=True)
    if sys.argv[2:] == ["hold"]:
        sys.stdin.read()
    os.kill(os.getpid(), signal.SIGKILL)
    """
)
pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="needs /dev/shm (Linux)")


def leak() -> str:
    """A segment left in /dev/shm by a process that died without unlinking it."""
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(SIZE)], capture_output=True, text=True, timeout=60
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    name = child.stdout.strip()
    assert (SHM / name).exists(), "the child's segment should outlive it (the leak)"
    return name


@pytest.fixture
def names() -> Iterator[list[str]]:
    """Segments a test made: removed after it, whatever it asserted."""
    made: list[str] = []
    yield made
    for name in made:
        (SHM / name).unlink(missing_ok=True)


def test_a_segment_left_by_a_killed_process_is_removed(names: list[str]) -> None:
    with shm_sweep() as sweep:
        names.append(leak())
    assert not (SHM / names[0]).exists()
    assert sweep.removed == {names[0]: SIZE}
    assert sweep.summary()["shm_removed"] == 1


def test_what_existed_before_is_kept(names: list[str]) -> None:
    names.append(leak())  # left before the peer started: not the sweep's to judge
    with shm_sweep():
        names.append(leak())
    assert (SHM / names[0]).exists()
    assert not (SHM / names[1]).exists()


def test_a_segment_a_live_process_holds_is_kept(names: list[str]) -> None:
    with shm_sweep(settle_s=1.0) as sweep:
        holder = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(SIZE), "hold"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert holder.stdout is not None
        names.append(holder.stdout.readline().strip())
        mine = shared_memory.SharedMemory(create=True, size=SIZE)  # open in this process
        names.append(mine.name)
    try:
        assert names[0] in shm_in_use()
        assert (SHM / names[0]).exists() and (SHM / names[1]).exists()
        assert sorted(sweep.kept_in_use) == sorted(names)
    finally:
        holder.kill()
        holder.wait()
        mine.close()


def test_only_the_kinds_a_peer_leaves_are_removed(tmp_path: Path) -> None:
    """A node store file (``prefix-serve-store-*``) that no one holds is never a peer's."""
    store = SHM / f"prefix-serve-store-test-{tmp_path.name}"
    try:
        with shm_sweep():
            store.write_bytes(b"\0" * 4096)
        assert store.exists()
    finally:
        store.unlink(missing_ok=True)


def test_a_worker_session_removes_what_its_worker_left(tmp_path: Path) -> None:
    """The vLLM worker's session: the worker leaks a segment, its close removes it."""
    script = tmp_path / "worker.py"
    script.write_text(
        "import json, subprocess, sys\n"
        f"CHILD = {CHILD!r}\n"
        f"name = subprocess.run([sys.executable, '-c', CHILD, '{SIZE}'],\n"
        "                      capture_output=True, text=True).stdout.strip()\n"
        "print(json.dumps({'leaked': name}), flush=True)\n"
        "sys.stdin.read()\n"
    )
    session = WorkerSession(Path(sys.executable), script, {"threads": 1}, tmp_path / "log")
    name = session.started["leaked"]
    try:
        assert (SHM / name).exists()
        session.close()
        assert not (SHM / name).exists()
        assert session.shm.summary()["shm_removed"] == 1
    finally:
        (SHM / name).unlink(missing_ok=True)


def test_the_summary_is_json() -> None:
    with shm_sweep() as sweep:
        pass
    assert json.loads(json.dumps(sweep.summary()))["shm_removed"] == 0
