"""Memory of a cluster's engine replicas, read from ``/proc`` (Linux).

A replica is a Ray actor whose process title starts with ``ray::ServeReplica:<app>:<name>``
(its engine may run in child processes, as vLLM's engine core does: they count as the
replica's). Resident set (RSS) counts shared pages in every process that maps them (torch's
libraries, the model file's page cache mapping); proportional set (PSS) splits each shared
page between its sharers, so PSS summed over the machine is its real use.
"""

from __future__ import annotations

from pathlib import Path

PROC = Path("/proc")


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
