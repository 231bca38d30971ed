"""Start and stop a real cluster the way a user does: ``serve run`` on a config file.

Used by the end-to-end tests and the routing experiments. The config is written from
``ClusterArgs``. Without a ``ray_address`` the cluster gets a Ray instance of its own
(``bench.harness.private_ray``: its own ports and temporary folder, so it never joins or
stops a Ray someone else started on the machine), ``serve run`` deploys into it, and
stopping stops both. Given a ``ray_address`` (an existing, possibly multi-node Ray
cluster) or a ``ray`` (a private instance the caller started, shared by the clusters it
runs one after another), ``serve run`` joins it, and stopping shuts down the application
only: the Ray cluster belongs to whoever started it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import yaml

from bench.harness.private_ray import PrivateRay
from bench.harness.ready import cluster_ready
from bench.harness.redis_server import free_port
from cluster.config import ClusterArgs
from cluster.tenants import key_records
from kvindex.reader import IndexReader
from replica.store.config import store_namespace
from replica.store.files import remove_cluster_stores

REPO = Path(__file__).resolve().parents[2]


def serve_config(
    args: ClusterArgs, port: int, app_name: str = "llm", proxy_location: str = "HeadOnly"
) -> dict[str, Any]:
    """A ``serve run`` config for one application built by ``cluster.app:build_app``. One
    proxy, on the head node: nodes sharing a host cannot each bind the port (on Kubernetes,
    ``EveryNode`` behind the serve Service is the convention; see deploy/kubernetes)."""
    return {
        "proxy_location": proxy_location,
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            {
                "name": app_name,
                "route_prefix": "/",
                "import_path": "cluster.app:build_app",
                "args": args.model_dump(mode="json", exclude_none=True),
            }
        ],
    }


def cluster_env(repo: Path = REPO) -> dict[str, str]:
    """The environment ``serve run`` (and a private Ray for it) runs in."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    # the experiments may name classes of bench/ (not installed) in the config: Ray's
    # workers inherit this path from the driver
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    return env


def _default_sigint() -> None:
    """A shell's background jobs (CI, nohup) inherit SIGINT ignored, and Python then never
    raises KeyboardInterrupt, so ``serve run`` would skip its graceful shutdown."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class ServeCluster:
    """``serve run`` in a subprocess, ready when every engine replica has registered."""

    def __init__(
        self,
        args: ClusterArgs,
        port: int | None = None,
        log_path: Path | None = None,
        ray_address: str | None = None,
        repo: Path = REPO,
        app_args: dict[str, Any] | None = None,
        ray: PrivateRay | None = None,
        dashboard: bool = False,
        python: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """``repo`` and ``app_args``: another revision of this project (a worktree) and its
        builder's arguments as written in that revision's schema; ``args`` must then name
        the same model and index (readiness is read from the index). ``dashboard``: its own
        Ray runs Ray's dashboard (``scale`` and ``dashboard_url`` need it). ``python``: the
        interpreter of another virtualenv that has this project installed (the vLLM
        backend's, ``make install-vllm``): its ``serve`` and its Ray run the cluster.
        ``env``: variables added to ``serve run``'s and its Ray's (``OTEL_*`` for traces)."""
        self.args = args
        self.ray_address = ray_address
        self.repo = repo
        self.app_args = app_args
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._dir = Path(tempfile.mkdtemp(prefix="serve-"))
        self.log_path = log_path or self._dir / "serve.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._ray: PrivateRay | None = ray
        self._own_ray = ray is None and ray_address is None
        self._dashboard = dashboard
        self.python = Path(python or sys.executable)
        self.env = dict(env or {})

    def start(self, timeout_s: float = 180.0) -> ServeCluster:
        config = self._dir / "config.yaml"
        written = serve_config(self.args, self.port)
        if self.app_args is not None:
            written["applications"][0]["args"] = self.app_args
        config.write_text(yaml.safe_dump(written))
        env = cluster_env(self.repo) | self.env
        if self.ray_address is not None:
            env["RAY_ADDRESS"] = self.ray_address
        else:
            if self._ray is None:
                self._ray = PrivateRay(self.log_path, self._dashboard).start(env, self.python)
            env.update(self._ray.env)
        serve = self.python.with_name("serve")
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                [str(serve), "run", str(config)],
                cwd=self.repo,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_default_sigint,
            )
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop(keep_logs=True)
            raise
        return self

    def stop(
        self, timeout_s: float = 60.0, keep_logs: bool = False, keep_store: bool = False
    ) -> None:
        """SIGINT first: ``serve run`` then shuts Serve down gracefully (replicas run their
        destructors and leave the index). SIGTERM if that hangs (Ray stops, destructors do
        not run), SIGKILL last.

        ``keep_store``: leave the node's store for a cluster started after this one.
        The temporary folder (config and ``serve.log``) is removed after a graceful stop,
        and kept for a post-mortem when ``keep_logs`` is set (a failed test or run) or the
        stop was not graceful; its path is then printed on stderr."""
        graceful = True
        if self._proc is not None:
            graceful = self._signal_until_stopped(timeout_s)
            self._proc = None
        if self._own_ray and self._ray is not None:  # this cluster's own Ray, nothing else
            self._ray.stop()
            self._ray = None
        # the node store outlives its cluster by design (a restart starts warm); a test's
        # or a run's cluster is gone for good, unless a restart is what it tests
        if not keep_store:
            store = self.args.store
            remove_cluster_stores(store.directory, store_namespace(self.args.index))
        if keep_logs or not graceful:
            sys.stderr.write(f"serve run's config and log are kept in {self._dir}\n")
        elif self._dir.exists():
            shutil.rmtree(self._dir, ignore_errors=True)

    def _signal_until_stopped(self, timeout_s: float) -> bool:
        """SIGINT, then SIGTERM, then SIGKILL; True if SIGINT alone stopped it cleanly."""
        assert self._proc is not None
        for sig, wait_s in ((signal.SIGINT, timeout_s), (signal.SIGTERM, 30.0)):
            if self._proc.poll() is not None:
                break
            self._proc.send_signal(sig)
            try:
                self._proc.wait(timeout=wait_s)
                return sig == signal.SIGINT and self._proc.returncode == 0
            except subprocess.TimeoutExpired:
                continue
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        return False

    def scale(self, num_replicas: int, timeout_s: float = 120.0) -> None:
        """Scale the engine deployment as an operator would: ``serve deploy`` of the same
        config with ``num_replicas`` set for ``EngineReplica`` in its ``deployments``
        section. Serve treats that as a lightweight update: it starts or drains replicas and
        leaves the others (and their caches) alone. (Changing ``args`` instead would be a
        code update, which replaces every replica.)"""
        self._redeploy([{"name": "EngineReplica", "num_replicas": num_replicas}], timeout_s)

    def restart_ingress(self, generation: int, timeout_s: float = 120.0) -> None:
        """Replace every ingress replica (each a router) as a rolling upgrade does: the
        ingress's actor options changed (an environment variable naming ``generation``), a
        heavyweight update of that deployment alone. Serve starts new ingress replicas and
        drains the old (their open streams finish); engine replicas are left alone."""
        options = {
            "num_cpus": self.args.ingress_num_cpus,
            "resources": self.args.ingress_resources,
            "runtime_env": {"env_vars": {"PREFIX_SERVE_INGRESS_GENERATION": str(generation)}},
        }
        self._redeploy([{"name": "Ingress", "ray_actor_options": options}], timeout_s)

    def _redeploy(self, deployments: list[dict[str, Any]], timeout_s: float) -> None:
        """``serve deploy`` of this cluster's config with a ``deployments`` section."""
        config = serve_config(self.args, self.port)
        if self.app_args is not None:
            config["applications"][0]["args"] = self.app_args
        config["applications"][0]["deployments"] = deployments
        path = self._dir / "redeploy.yaml"
        path.write_text(yaml.safe_dump(config))
        serve = self.python.with_name("serve")
        env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
        address = ["--address", self.dashboard_url()]
        subprocess.run(
            [str(serve), "deploy", str(path), *address],
            cwd=REPO,
            env=env,
            check=True,
            capture_output=True,
            timeout=timeout_s,
        )

    def ray_pids(self) -> list[int]:
        """The processes of this cluster's Ray, its own or the caller's private one (none
        when it joined a given address)."""
        return self._ray.pids() if self._ray is not None else []

    def replica_pids(self, deployment: str) -> list[int]:
        """This cluster's replica processes of one deployment (``Ingress``, ``EngineReplica``),
        by their process titles (``ray::ServeReplica:llm:Ingress``, with ``.<method>`` while
        busy; ``ray::SERVE_REPLICA::llm#Ingress#...`` while it starts)."""
        found = []
        for pid in self.ray_pids():
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if re.search(
                rf"(SERVE_REPLICA::.*#{deployment}#|ServeReplica:[^:]*:{deployment}\b)".encode(),
                title,
            ):
                found.append(pid)
        return found

    def dashboard_url(self) -> str:
        """This cluster's Ray dashboard (its own Ray's, or read from ``serve run``'s log)."""
        if self._ray is not None:
            if not self._ray.dashboard:  # ``scale`` would fail later with a connection error
                raise RuntimeError(
                    "this cluster's Ray has no dashboard: ServeCluster(dashboard=True)"
                )
            return self._ray.dashboard_url
        for line in self.log_path.read_text(errors="replace").splitlines():
            if "dashboard at" in line.lower() and "http" in line:
                return "http" + line.split("http", 1)[1].split()[0].rstrip(".")
        return "http://127.0.0.1:8265"

    def stats(self) -> dict[str, Any]:
        """The ingress's ``/cluster/stats`` (with the first API key, if keys are set)."""
        keys = key_records(self.args.api_keys)
        headers = {"authorization": f"Bearer {keys[0].key}"} if keys else {}
        return httpx.get(f"{self.base_url}/cluster/stats", headers=headers, timeout=10).json()

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        index = IndexReader(self.args.index, self.args.engine.model_id)
        scaling = self.args.autoscaling
        wanted = scaling.min_replicas if scaling else self.args.num_replicas
        try:
            while time.monotonic() < deadline:
                if self._proc is not None and self._proc.poll() is not None:
                    raise RuntimeError(f"serve run exited; see {self.log_path}")
                if cluster_ready(self.base_url, self.args, index, wanted, self.stats):
                    return
                time.sleep(0.5)
        finally:
            index.close()
        raise TimeoutError(f"cluster not ready after {timeout_s:.0f} s; see {self.log_path}")

    def __enter__(self) -> ServeCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop(keep_logs=exc_type is not None)
