"""Memory of a cluster's engine replicas, and the shared memory a peer leaves, read from
``/proc`` (Linux).

A replica is a Ray actor whose process title starts with ``ray::ServeReplica:<app>:<name>``
(its engine may run in child processes, as vLLM's engine core does: they count as the
replica's). Resident set (RSS) counts shared pages in every process that maps them (torch's
libraries, the model file's page cache mapping); proportional set (PSS) splits each shared
page between its sharers, so PSS summed over the machine is its real use.

``shm_sweep`` removes the ``/dev/shm`` segments a peer's processes created and left behind
when they were killed (vLLM's message queues: 160-250 MB each, four per Ray Serve LLM
round), where this project's node store lives too.
"""

from __future__ import annotations

import fnmatch
import os
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROC = Path("/proc")
SHM = Path("/dev/shm")
# What a killed peer leaves in /dev/shm: Python's multiprocessing.shared_memory segments
# (``psm_<hex>``: vLLM's ShmRingBuffer message queues, its tensor arena and object store,
# unlinked only by their creator's ``__del__`` or by a resource tracker that a kill takes
# down too), torch's shared tensors (``torch_<pid>_<n>``) and multiprocessing's named
# semaphores under spawn (``sem.mp-<id>``), and Intel OpenMP's registration files
# (``__KMP_REGISTERED_LIB_<pid>_0``, 1 KiB each: every process that loaded the preloaded
# libiomp5 and was killed leaves one; a 6-round stack run left 42). Never this project's node store
# (``prefix-serve-store-*``): it is meant to outlive its replicas.
PEER_SHM_PATTERNS = ("psm_*", "torch_*", "sem.mp-*", "__KMP_REGISTERED_LIB_*")


def _cmdline(pid: int) -> str:
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in (PROC / str(pid) / "task").glob("*/children"):
        try:
            kids += [int(k) for k in task.read_text().split()]
        except OSError:
            continue
    return kids


def _rollup(pid: int) -> dict[str, int]:
    """Rss and Pss of one process in KiB (zero if it has gone)."""
    values = {"Rss": 0, "Pss": 0}
    try:
        for line in (PROC / str(pid) / "smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in values:
                values[key] = int(rest.split()[0])
    except OSError:
        pass
    return values


def replica_processes(title: str) -> list[int]:
    """Pids of the processes whose title starts with ``ray::ServeReplica:`` and holds
    ``title`` (the deployment name)."""
    found = []
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            line = _cmdline(int(entry.name))
            if line.startswith("ray::ServeReplica:") and title in line.split()[0]:
                found.append(int(entry.name))
    return sorted(found)


def replica_memory(title: str) -> list[dict[str, float]]:
    """Per replica of deployment ``title``: RSS and PSS in MiB, its descendants included."""
    out = []
    for pid in replica_processes(title):
        tree, todo = [], [pid]
        while todo:
            tree.append(todo.pop())
            todo += _children(tree[-1])
        sums = [_rollup(p) for p in tree]
        out.append(
            {
                "pid": pid,
                "processes": len(tree),
                "rss_mib": round(sum(s["Rss"] for s in sums) / 1024, 1),
                "pss_mib": round(sum(s["Pss"] for s in sums) / 1024, 1),
            }
        )
    return out


def _matching(root: Path, patterns: Iterable[str]) -> set[str]:
    """Names directly under ``root`` that match one of ``patterns`` and belong to this user
    (a peer we start runs as us; someone else's segments are never ours to remove)."""
    found = set()
    try:
        entries = list(os.scandir(root))
    except OSError:
        return found
    for entry in entries:
        try:
            mine = entry.stat(follow_symlinks=False).st_uid == os.getuid()
        except OSError:
            continue  # gone meanwhile
        if mine and any(fnmatch.fnmatchcase(entry.name, p) for p in patterns):
            found.add(entry.name)
    return found


def _held_by(pid_dir: Path, prefix: str) -> set[str]:
    """Names under ``prefix`` that one process has open (``fd/``) or mapped (``maps``).
    A process we may not read is another user's: the segments here are created 0600, so
    it cannot hold ours (root aside, and a sweep is run as the peer's user)."""
    names = set()
    try:
        fds = list((pid_dir / "fd").iterdir())
    except OSError:
        fds = []
    for fd in fds:
        try:
            names.add(os.readlink(fd))
        except OSError:
            continue  # closed meanwhile
    try:
        maps = (pid_dir / "maps").read_text().splitlines()
    except OSError:
        maps = []
    names |= {fields[5] for line in maps if len(fields := line.split(maxsplit=5)) == 6}
    return {n[len(prefix) :].removesuffix(" (deleted)") for n in names if n.startswith(prefix)}


def shm_in_use(root: Path = SHM) -> set[str]:
    """Names under ``root`` that any live process has open or mapped (a running cluster's
    node store, a concurrent benchmark's queues): never removed."""
    prefix = f"{root}/"
    used: set[str] = set()
    for pid_dir in PROC.iterdir():
        if pid_dir.name.isdigit():
            used |= _held_by(pid_dir, prefix)
    return used


@dataclass
class ShmSweep:
    """What ``root`` held before a peer started; ``finish`` removes what appeared since."""

    root: Path
    patterns: tuple[str, ...]
    before: frozenset[str]
    removed: dict[str, int] = field(default_factory=dict)  # name -> bytes
    kept_in_use: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, patterns: Iterable[str] = PEER_SHM_PATTERNS, root: Path = SHM) -> ShmSweep:
        patterns = tuple(patterns)
        return cls(root, patterns, frozenset(_matching(root, patterns)))

    def finish(self, settle_s: float = 10.0) -> None:
        """Remove the new segments no process holds; call once the peer's processes are
        stopped. Ones still held are retried for ``settle_s`` (a killed process's children
        may take a moment to go), then kept."""
        deadline = time.monotonic() + settle_s
        while True:
            new = _matching(self.root, self.patterns) - self.before
            held = new & shm_in_use(self.root)
            for name in sorted(new - held):
                self._unlink(name)
            if not held or time.monotonic() >= deadline:
                self.kept_in_use = sorted(held)
                break
            time.sleep(0.5)
        if self.removed:
            mib = sum(self.removed.values()) / 2**20
            print(
                f"shm_sweep: removed {len(self.removed)} left in {self.root} ({mib:.0f} MiB)",
                file=sys.stderr,
            )

    def _unlink(self, name: str) -> None:
        path = self.root / name
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return  # its owner removed it meanwhile
        self.removed[name] = size

    def summary(self) -> dict[str, Any]:
        """For a run's JSON: what was removed after the peer stopped."""
        return {
            "shm_removed": len(self.removed),
            "shm_removed_mib": round(sum(self.removed.values()) / 2**20, 1),
            "shm_kept_in_use": self.kept_in_use,
        }


@contextmanager
def shm_sweep(
    patterns: Iterable[str] = PEER_SHM_PATTERNS, root: Path = SHM, settle_s: float = 10.0
) -> Iterator[ShmSweep]:
    """Run a peer inside: on exit (its processes ended by then, inside the block), remove
    the shared-memory segments of ``patterns`` that appeared meanwhile and that no live
    process has open or mapped. What existed before is never touched."""
    sweep = ShmSweep.start(patterns, root)
    try:
        yield sweep
    finally:
        sweep.finish(settle_s)
