"""Opening a node's store file, and sweeping away stores nobody can use.

``open_node_store`` maps ``<directory>/prefix-serve-store-<cluster>-<fingerprint>``,
creating it (and its header) under the file's exclusive ``flock`` if it is new. A file
whose header is not this version's, or disagrees with its name, is unlinked (processes
still mapping it keep their pages) and created afresh: a store written by another
version is ignored, never misread.

Every process that has a store open holds a shared ``flock`` on its ``.users`` file for
as long as it does (the kernel drops it when the process dies, SIGKILL included).
``sweep`` removes a store only when it can take that lock exclusively (nobody has the
store open) and the store is of this cluster with another fingerprint (another model,
block size, secret, layout or version: blocks no replica here can use), or unused for
``stale_after_s`` (another cluster's, long gone). A store's side files (``SIDECARS``: its
``.users`` lock and its publisher's lock, ``replica.store_publisher``) are never taken for
stores of their own, and go with their store.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import time

from replica.store.layout import FILE_PREFIX, file_name
from replica.store.node_store import NodeStore, StoreGeometry, read_header, write_header

USERS, PUBLISHER = ".users", ".publisher"
SIDECARS = (USERS, PUBLISHER)  # a store's side files: the path plus one of these


def publisher_lock_path(store_path: str) -> str:
    """The file whose ``flock`` makes one replica of the node the store's publisher."""
    return store_path + PUBLISHER


class StoreFile(NodeStore):
    """A ``NodeStore`` on a node's shared file; ``close`` leaves the file for the others."""

    users_fd: int = -1

    def close(self) -> None:
        super().close()
        with contextlib.suppress(OSError):
            os.utime(self.users_path)  # the last detach (``sweep``'s staleness clock)
        for fd in (self._fd, self.users_fd):
            if fd is not None and fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fd, self.users_fd = None, -1

    users_path: str = ""
    path: str = ""

    def leave(self) -> bool:
        """Give up this process's share of the store (its ``.users`` lock; the mapping
        stays until ``close``); True if no other process has it open now (the last one to
        leave always finds so, whatever the order in which several leave)."""
        if self.users_fd < 0:
            return False
        os.close(self.users_fd)
        self.users_fd = -1
        try:
            fd = os.open(self.users_path, os.O_RDWR)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)


def open_node_store(
    directory: str, cluster: str, fingerprint: bytes, geometry: StoreGeometry
) -> StoreFile:
    """This node's store for ``cluster`` and ``fingerprint``: the existing one (whatever
    its size) or a new one of ``geometry``."""
    path = os.path.join(directory, file_name(cluster, fingerprint))
    users_fd = _hold_users_lock(path + USERS)
    try:
        fd, found = _open_checked(path, fingerprint, geometry)
    except BaseException:
        os.close(users_fd)
        raise
    region = mmap.mmap(fd, found.file_bytes)
    store = StoreFile(region, found, fingerprint, fd=fd, reserve_dir=directory)
    store.users_fd, store.users_path, store.path = users_fd, path + USERS, path
    return store


def _hold_users_lock(users_path: str) -> int:
    """A shared lock on ``users_path`` that is on the file the path names now (a sweep may
    unlink it between our open and our lock: then open the new one)."""
    while True:
        fd = os.open(users_path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            if os.stat(users_path).st_ino == os.fstat(fd).st_ino:
                os.utime(users_path)
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _open_checked(
    path: str, fingerprint: bytes, geometry: StoreGeometry
) -> tuple[int, StoreGeometry]:
    for _ in range(3):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.fstat(fd).st_size == 0:
                os.ftruncate(fd, geometry.file_bytes)  # sparse: pages come as slots fill
                with mmap.mmap(fd, geometry.data_offset) as head:
                    write_header(head, geometry, fingerprint)
                return fd, geometry
            found = read_header(os.pread(fd, 4096, 0))
            size_ok = found is not None and os.fstat(fd).st_size >= found[0].file_bytes
            same = found is not None and (found[0].block_size, found[0].block_bytes) == (
                geometry.block_size,
                geometry.block_bytes,
            )
            if found is not None and size_ok and same and found[1] == fingerprint:
                return fd, found[0]
            os.unlink(path)  # another version's, torn or foreign: start afresh
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    raise OSError(f"could not open a node store at {path}")


def sweep(directory: str, cluster: str, fingerprint: bytes, stale_after_s: float) -> list[str]:
    """Remove the stores in ``directory`` nobody can use (see the module); their paths."""
    ours = file_name(cluster, fingerprint)
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(FILE_PREFIX) or name.endswith(SIDECARS) or name == ours:
            continue
        same_cluster = name[len(FILE_PREFIX) :].rsplit("-", 1)[0] == cluster
        path = os.path.join(directory, name)
        if _remove_if_unused(path, stale_after_s=0.0 if same_cluster else stale_after_s):
            removed.append(path)
    return removed


def _remove_if_unused(path: str, stale_after_s: float) -> bool:
    users = path + USERS
    try:
        fd = os.open(users, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # someone has it open
        os.close(fd)
        return False
    try:
        if time.time() - os.fstat(fd).st_mtime < stale_after_s:
            return False
        for p in (path, publisher_lock_path(path), users):  # the users lock last
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        return True
    finally:
        os.close(fd)


def remove_cluster_stores(directory: str, cluster: str | None) -> list[str]:
    """Remove every unused store of ``cluster`` (None: of every cluster) in ``directory``:
    a test's or a benchmark's teardown, and ``python -m replica.store clear``. A store some
    process has open is left alone."""
    removed = []
    start = FILE_PREFIX if cluster is None else f"{FILE_PREFIX}{cluster}-"
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if name.startswith(start) and not name.endswith(SIDECARS):
                path = os.path.join(directory, name)
                if _remove_if_unused(path, 0.0):
                    removed.append(path)
    return removed
