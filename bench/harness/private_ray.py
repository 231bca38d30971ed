"""A Ray instance of one test or experiment's own, on this machine, and its clean removal.

``ray start --head`` with every port it would otherwise take by default (GCS, dashboard, its
agent, the client server, metrics) chosen free, and a temporary folder of its own
(``RAY_TMPDIR`` and ``--temp-dir``): ``serve run`` given its address deploys there, and no
one else's ``ray start`` or ``serve run`` on the machine can find it (they look for a
cluster in their own temporary folder). Every process it starts, and every worker those
start, inherits a marker in its environment (``PREFIX_SERVE_RAY``, a fresh id); stopping
signals exactly the processes that carry it, never ``ray stop`` (which stops every Ray
instance on the host).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from bench.harness.redis_server import free_ports

MARKER = "PREFIX_SERVE_RAY"
PROC = Path("/proc")


class PrivateRay:
    def __init__(self, log_path: Path, dashboard: bool = True) -> None:
        """``dashboard`` False: no dashboard (nor Serve's REST API, which ``serve deploy``
        and ``serve status`` need); ``ray start`` then takes ~1-2 s less and uses 1-3 s less
        CPU in its first seconds on 2 cores (measured), for a cluster that needs neither."""
        self.dashboard = dashboard
        self.id = uuid.uuid4().hex[:12]
        # short: Ray's Unix sockets live under it and their paths are capped at 107 bytes
        self.temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
        # every port chosen at once, so no two are the same
        self.port, self.dashboard_port, *self._ports = free_ports(5)
        self.log_path = log_path
        self.env = {MARKER: self.id, "RAY_TMPDIR": str(self.temp_dir)}
        # vLLM's ZMQ sockets (one file each, left behind when its engines are killed) go
        # here too, removed with it, instead of into /tmp (about 28 a suite run, counted)
        self.env["VLLM_RPC_BASE_PATH"] = str(self.temp_dir)
        self.env["RAY_ADDRESS"] = f"127.0.0.1:{self.port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def start(self, env: dict[str, str], python: Path | None = None) -> PrivateRay:
        """``python``: the interpreter whose Ray starts (its workers run in it; default
        this one)."""
        ray = Path(python or sys.executable).with_name("ray")
        command = [
            str(ray),
            "start",
            "--head",
            "--node-ip-address=127.0.0.1",
            f"--port={self.port}",
            f"--dashboard-port={self.dashboard_port}",
            f"--dashboard-agent-listen-port={self._ports[0]}",
            f"--ray-client-server-port={self._ports[1]}",
            f"--metrics-export-port={self._ports[2]}",
            f"--num-cpus={os.cpu_count() or 1}",
            f"--temp-dir={self.temp_dir}",
            "--disable-usage-stats",
            f"--include-dashboard={str(self.dashboard).lower()}",
        ]
        run_env = {**env, **self.env}
        run_env.pop("RAY_ADDRESS")  # the head is started, not joined
        with open(self.log_path, "ab") as log:
            done = subprocess.run(
                command, env=run_env, stdout=log, stderr=subprocess.STDOUT, timeout=180
            )
        if done.returncode != 0:
            self.stop()
            raise RuntimeError(f"ray start failed; see {self.log_path}")
        return self

    def pids(self) -> list[int]:
        """Every live process of this instance (those whose environment has its marker)."""
        mark = f"{MARKER}={self.id}".encode()
        found = []
        for entry in PROC.iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if mark in environ.split(b"\0"):
                found.append(int(entry.name))
        return found

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to every process of this instance but its GCS, then to the GCS, SIGKILL
        to those left after ``grace_s``, then its temporary folder removed.

        The GCS goes last because a raylet that gets SIGTERM while the GCS is stopping
        waits out its own timeouts (~10 s, measured); with the GCS still up it is gone in
        under a second, and the GCS a tenth of a second after it."""
        gcs = {pid for pid in self.pids() if _is_gcs(pid)}
        self._signal(signal.SIGTERM, grace_s, lambda pid: pid not in gcs)
        self._signal(signal.SIGTERM, grace_s)
        self._signal(signal.SIGKILL, 5.0)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _signal(self, sig: int, wait_s: float, which: Callable[[int], bool] = bool) -> None:
        """``sig`` to this instance's processes that ``which`` picks; wait for them to go."""
        targets = [pid for pid in self.pids() if which(pid)]
        for pid in targets:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while set(targets) & set(self.pids()) and time.monotonic() < deadline:
            time.sleep(0.1)


def _is_gcs(pid: int) -> bool:
    try:
        command = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return False
    return command.endswith(b"gcs_server")
