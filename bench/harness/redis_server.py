"""A throwaway local ``redis-server`` process (tests, experiments, ``make serve``)."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis


def free_port() -> int:
    return free_ports(1)[0]


RAY_WORKER_PORTS_END = 20_000  # Ray's workers listen on 10002-19999 unless told otherwise


def quiet_ports() -> range:
    """Ports no process gets without naming them: above Ray's worker ports and below the
    system's ephemeral range, where ``bind(0)`` and outgoing connections take theirs. A port
    chosen there stays free until its owner binds it seconds later; one chosen by
    ``bind(0)`` did not (Serve's proxy once found its port taken by then)."""
    try:
        first = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]
        return range(RAY_WORKER_PORTS_END, int(first))
    except (OSError, ValueError, IndexError):
        return range(RAY_WORKER_PORTS_END, 32_768)


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports, from ``quiet_ports`` where it has room: all
    bound at once, then released (one at a time, the system may hand the same port out
    twice: a private Ray once got one port for two of its components and did not start)."""
    quiet = quiet_ports()
    candidates = random.sample(quiet, min(len(quiet), 50 * count)) if len(quiet) > 100 else []
    sockets: list[socket.socket] = []
    try:
        for port in [*candidates, *[0] * count]:  # bind(0): where no quiet port was free
            if len(sockets) == count:
                break
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class LocalRedis:
    """Runs ``redis-server`` on a free loopback port, without persistence.

    ``stop`` kills it (SIGKILL, like a crash) and ``start`` brings up an empty one on the same
    port, so tests can take Redis away under a running system and give it back.
    """

    def __init__(self, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "redis-server not found: install Debian's redis-server "
                "(`make install` does: scripts/ensure-system.sh install)"
            )
        self.binary = binary
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = Path(tempfile.mkdtemp(prefix="redis-"))
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 10.0) -> LocalRedis:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", str(self._dir)]
        args += ["--enable-debug-command", "local"]  # fault tests inject DEBUG SLEEP
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)
        client.close()
        return self

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        """Stop the server for good and remove its working directory."""
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
